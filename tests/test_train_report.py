"""What a run tells its user: TensorBoard reads the scalars the trainer writes, metrics.jsonl
keeps earlier runs' rows, curves.png is a picture of them, and process 0's log shows every
host when they differ."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
from PIL import Image

from train import podview, report, train
from train.podview import Host


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


def test_process_0_shows_a_row_per_host_when_hosts_differ_and_names_the_worst():
  even = [Host(0, 100.0, 0.01), Host(1, 95.0, 0.04)]
  slow_input = [Host(0, 100.0, 0.01), Host(1, 100.0, 0.30)]
  slow_host = [Host(0, 100.0, 0.01), Host(1, 85.0, 0.01)]
  assert not podview.differ(even)
  assert podview.differ(slow_input) and podview.differ(slow_host)
  assert podview.worst(slow_input).process == 1
  assert podview.which(slow_input) == ": process 1, the worst of 2"
  assert podview.which(slow_input[:1]) == ""  # one process: nobody to name
  assert podview.rows(slow_input, train.verdict).splitlines() == [
    "  process 0:     100 img/s  input wait  1.0% (not input-bound)",
    "  process 1:     100 img/s  input wait 30.0% (input-bound)",
  ]


def test_one_process_gathers_its_own_row():
  assert podview.gather(120.0, 0.25) == [Host(0, 120.0, 0.25)]


def test_a_runs_per_host_figures_leave_out_the_first_window():
  windows = [
    [Host(0, 10.0, 0.9), Host(1, 10.0, 0.9)],  # right after compilation
    [Host(0, 100.0, 0.0), Host(1, 50.0, 0.25)],
    [Host(0, 100.0, 0.125), Host(1, 70.0, 0.5)],
  ]
  assert podview.mean(windows) == [Host(0, 100.0, 0.0625), Host(1, 60.0, 0.375)]
  assert podview.mean(windows[:1]) == windows[0]
  assert podview.mean([]) == []
