"""Training: exact resume after SIGKILL, SIGTERM checkpoints, a run on 8 devices; progress."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest
from etils import epath

from train import agreement, checkpoints, report, train

ROOT = pathlib.Path(__file__).resolve().parents[2]


def train_cmd(workdir, data_dir, *overrides):
  return [
    sys.executable,
    "-m",
    "train",
    "--config",
    str(ROOT / "configs/default.py"),
    "--workdir",
    str(workdir),
    f"--config.input.data_dir={data_dir}",
    "--config.batch_size=32",
    "--config.log_every=2",
    "--config.eval_every_steps=1000",
    "--config.synthetic_steps=2",
    *overrides,
  ]


def env():
  # One CPU device per run keeps the subprocesses quick; the 8-device run is in-process.
  e = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  e["PYTHONPATH"] = str(ROOT)
  return e


def summary(workdir):
  return json.loads((pathlib.Path(workdir) / "summary.json").read_text())


def plan_mb(describe: str) -> tuple[int, int]:
  """(planned, budget) MB of a loader's `memory: P of B MB (...)`."""
  planned, budget = re.match(r"memory: ([\d,]+) of ([\d,]+) MB", describe).groups()
  return int(planned.replace(",", "")), int(budget.replace(",", ""))


def damage_train_records(data_dir: pathlib.Path, first: int) -> None:
  """Flips a byte in the JPEG of every train record from index `first` on: the shard keeps
  its size and the manifest its digest-free checks; reading such a record fails."""
  shard = data_dir / "train.array_record-00000-of-00001"
  data = bytearray(shard.read_bytes())
  at = data.find(b"\xff\xd8\xff")  # where each record's JPEG starts
  for _ in range(first):
    at = data.find(b"\xff\xd8\xff", at + 3)
  while at != -1:
    data[at + 1] ^= 0xFF
    at = data.find(b"\xff\xd8\xff", at + 3)
  shard.write_bytes(bytes(data))


def wait_for(predicate, proc, timeout=240):
  deadline = time.time() + timeout
  while not predicate():
    assert proc.poll() is None, proc.stdout.read() if proc.stdout else "training exited early"
    assert time.time() < deadline, "timed out waiting for training"
    time.sleep(0.05)


def test_input_bound_verdict_uses_the_profiler_thresholds():
  assert report.verdict(0.25) == "input-bound"
  assert report.verdict(0.20) == "input-bound"
  assert report.verdict(0.07) == "moderately input-bound"
  assert report.verdict(0.049) == "not input-bound"


def test_hosts_agree_on_all_but_the_settings_that_change_no_batch_and_on_the_c_decoder(
  tmp_path,
):
  assert agreement.per_host("config.input.performance.num_threads")
  assert agreement.per_host("config.eval_input.performance.read_ahead")
  assert not agreement.per_host("config.input.decoding.cache_mb")  # changes pixels
  assert not agreement.per_host("config.input.image_size")
  (tmp_path / "ops.py").write_text("x = 1\n")
  (tmp_path / "_jpeg.c").write_text("int x;\n")
  before = agreement.sources_digest(tmp_path)
  (tmp_path / "_jpeg.c").write_text("int y;\n")
  assert agreement.sources_digest(tmp_path) != before
  assert agreement.code_version().endswith(", C JPEG decoder")


def test_a_resume_on_one_host_of_a_checkpoint_saved_on_two_says_so_in_good_english(tmp_path):
  ckpt = checkpoints.Checkpoints(epath.Path(tmp_path), keep=1)
  ckpt.saved_on = 2  # as restoring a checkpoint of 2 processes sets it
  assert ckpt.resumed(12) == (
    f"resumed from step 12 on 1 host (saved on 2) ({tmp_path / 'checkpoints'})"
  )
  ckpt.close()


@pytest.mark.slow
def test_killed_run_resumes_to_bitwise_identical_parameters(digits_dir, tmp_path):
  steps = ["--config.num_steps=12", "--config.checkpoint_every_steps=4"]
  whole = subprocess.run(
    train_cmd(tmp_path / "whole", digits_dir, *steps),
    env=env(),
    check=True,
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=600,
  )
  # Output to a pipe (not a terminal): compilation announced, then lines with an ETA; the
  # workdir holds the TensorBoard events, metrics.jsonl and the curves.
  out = whole.stdout.splitlines()
  compiling = out.index("compiling the train step...")
  assert [line for line in out[compiling:] if "ETA 0:" in line and "step" in line]
  assert list((tmp_path / "whole" / "tensorboard").glob("events.out.tfevents.*"))
  assert (tmp_path / "whole" / "curves.png").stat().st_size > 0
  metrics = (tmp_path / "whole" / "metrics.jsonl").read_text()
  assert metrics.count("\n") == 6  # log_every=2
  # each log line also holds process 0's pipeline stages (`pipeline.stats_of`)
  assert '"pipeline/decode_busy": ' in metrics and '"pipeline/handoff_wait_share": ' in metrics
  # peak RSS beside img/s, and the loader's planned share of performance.memory_mb
  assert '"memory/peak_rss_mb": ' in metrics
  done = summary(tmp_path / "whole")
  assert done["peak_rss_mb"] > 100 and done["loader_memory"].startswith("memory: ")
  # both loaders' plans: eval's within what train's left of the one default budget
  train_mb, eval_mb = (plan_mb(done[k]) for k in ("loader_memory", "eval_loader_memory"))
  assert eval_mb[1] == pytest.approx(train_mb[1] - train_mb[0], abs=1)
  line = f"the loaders plan train {train_mb[0]:,} of {train_mb[1]:,} MB, eval {eval_mb[0]:,} of"
  assert line in whole.stdout
  assert done["host_us_per_step"] > 0 and '"train/host_us_per_step": ' in metrics
  assert f"peak RSS {done['peak_rss_mb']:,.0f} MB on the largest host" in whole.stdout

  killed = tmp_path / "killed"
  proc = subprocess.Popen(
    train_cmd(killed, digits_dir, *steps),
    env=env(),
    cwd=ROOT,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  wait_for(lambda: (killed / "checkpoints" / "8").exists(), proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (killed / "summary.json").exists()
  done = subprocess.run(
    train_cmd(killed, digits_dir, *steps),
    env=env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resumed from step" in done.stderr + done.stdout
  assert summary(killed)["params_sha256"] == summary(tmp_path / "whole")["params_sha256"]
  assert summary(killed)["steps"] == 12


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_rerun_resumes(digits_dir, tmp_path):
  steps = ["--config.num_steps=400", "--config.checkpoint_every_steps=1000"]
  proc = subprocess.Popen(
    train_cmd(tmp_path, digits_dir, *steps),
    env=env(),
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  lines = []
  wait_for(lambda: lines.append(proc.stdout.readline()) or "step      4" in lines[-1], proc)
  proc.send_signal(signal.SIGTERM)
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 143, out[-3000:]
  saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
  assert saved and 4 <= saved[0] < 400
  assert f"saved checkpoint at step {saved[0]}" in out


def test_a_bad_record_ends_the_run_in_one_line_naming_it_and_the_option_to_skip(
  digits_dir, tmp_path
):
  data = tmp_path / "data"
  shutil.copytree(digits_dir, data)
  damage_train_records(data, first=20)
  out = subprocess.run(
    train_cmd(tmp_path / "w", data, "--config.num_steps=20"),
    env=env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr[-3000:]
  assert re.search(r"train.array_record-00000-of-00001 record \d+: corrupt record", out.stderr)
  assert "--config.input.on_error=skip skips bad records" in out.stderr


@pytest.mark.slow
def test_short_run_on_eight_devices(digits_dir, tmp_path):
  assert jax.device_count() == 8
  from configs import default

  config = default.get_config()
  config.input.data_dir = str(digits_dir)
  config.batch_size = 32
  config.num_steps = 4
  config.log_every = 2
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 1000
  config.synthetic_steps = 1
  result = train.train_and_evaluate(config, tmp_path)
  assert result["devices"] == 8 and result["steps"] == 4
  assert [row["process"] for row in result["hosts"]] == [0] and result["verdict_process"] == 0
  assert result["eval_examples"] == 60  # the whole validation split, each example once
  assert 0.0 <= result["eval_top1"] <= result["eval_top5"] <= 1.0
  assert (tmp_path / "checkpoints" / "4").exists()
