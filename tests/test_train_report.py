"""What a run tells its user: TensorBoard reads the scalars the trainer writes, metrics.jsonl
keeps earlier runs' rows, and curves.png is a picture of them."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
from PIL import Image

from train import report


def log_run(workdir, steps, loss):
  log = report.Log(workdir)
  for step in steps:
    log.scalars(step, "train", {"loss": loss, "accuracy": 0.5, "input_wait_share": 0.01})
  log.scalars(steps[-1], "eval", {"top1": 0.75, "top5": 0.9})
  log.close()


def test_a_resumed_run_keeps_earlier_rows_and_draws_the_curves(tmp_path):
  log_run(tmp_path, [2, 4, 6], loss=2.0)
  log_run(tmp_path, [6, 8], loss=1.0)  # resumed from step 4: step 6 logged again
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [2, 4, 6, 8]
  assert [r["train/loss"] for r in rows] == [2.0, 2.0, 1.0, 1.0]
  assert rows[-1]["eval/top1"] == 0.75
  picture = np.asarray(Image.open(tmp_path / "curves.png").convert("L"))
  assert picture.shape[1] > 600 and picture.min() < 100 < picture.max()  # lines on white


def test_tensorboard_serves_the_scalars_the_trainer_writes(tmp_path):
  log_run(tmp_path, [1, 2, 3], loss=1.5)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = subprocess.Popen(
    [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "tensorboard")]
    + ["--port", str(port), "--host", "127.0.0.1"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
  try:
    deadline = time.monotonic() + 120
    while True:
      try:
        tags = json.loads(urllib.request.urlopen(url, timeout=5).read())
        if tags:
          break
      except OSError:
        pass
      assert server.poll() is None and time.monotonic() < deadline, "tensorboard did not start"
      time.sleep(0.5)
  finally:
    server.kill()
    server.wait()
  (run,) = tags.values()
  assert {"train/loss", "train/accuracy", "eval/top1"} <= set(run)
