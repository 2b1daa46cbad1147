"""What a run tells its user: TensorBoard reads the scalars the trainer writes, metrics.jsonl
keeps earlier runs' rows, curves.png is a picture of them, and process 0's log shows every
host when they differ. A report file that is damaged or cannot be written is one warning
line, never the end of the run, never a file lost."""

import json
import resource
import signal
import subprocess
import sys
import time
import urllib.request
import warnings

import numpy as np
import pytest
from PIL import Image

import pipeline
from tests.conftest import free_port
from tests.train.test_train import ROOT, env, train_cmd
from train import podview, report
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


def rows_of(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def warnings_in(text):
  lines = text.splitlines()
  assert "Traceback" not in text and all(x.startswith("warning: ") for x in lines), text
  return lines


@pytest.mark.parametrize(
  "damaged",
  [
    b'{"step": 2, "train/loss": 2.0}\n{"step": 4, "train/lo',  # a write cut short
    b'{"step": 2, "train/loss": 2.0}\n{"epoch": 1}\n',  # a row without a step
    b"\x89PNG\r\n\x1a\n not metrics",  # not JSON
  ],
)
def test_a_damaged_or_foreign_metrics_file_is_set_aside_with_one_warning(tmp_path, capsys, damaged):
  (tmp_path / "metrics.jsonl").write_bytes(damaged)
  log_run(tmp_path, [6, 8], loss=1.0)
  (warning,) = warnings_in(capsys.readouterr().err)
  aside = tmp_path / "metrics.jsonl.damaged"
  assert warning.startswith(f"warning: {tmp_path / 'metrics.jsonl'} line ")
  assert warning.endswith(f"is not a metrics row: moved it to {aside} and began anew")
  assert aside.read_bytes() == damaged  # kept as it was, for whoever wrote it
  assert [r["step"] for r in rows_of(tmp_path)] == [6, 8]
  (tmp_path / "metrics.jsonl").write_bytes(damaged)  # again: the first one aside is kept
  log_run(tmp_path, [10], loss=0.5)
  assert (tmp_path / "metrics.jsonl.damaged-2").read_bytes() == damaged
  assert aside.read_bytes() == damaged and [r["step"] for r in rows_of(tmp_path)] == [10]


@pytest.mark.parametrize("name", ["metrics.jsonl", "curves.png"])
def test_a_report_file_that_cannot_be_written_is_one_warning_and_the_other_is_written(
  tmp_path, capsys, name
):
  (tmp_path / name).mkdir()
  log_run(tmp_path, [2, 4], loss=1.0)
  (warning,) = warnings_in(capsys.readouterr().err)
  assert warning.startswith(f"warning: cannot write {tmp_path / name} (Is a directory")
  other = {"metrics.jsonl", "curves.png"} - {name}
  assert (tmp_path / other.pop()).is_file()
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "curves.png",
    "metrics.jsonl",
    "tensorboard",
  ]


def test_a_disk_full_while_writing_leaves_the_earlier_report_whole(tmp_path, capsys):
  log_run(tmp_path, [2, 4], loss=2.0)
  before = {n: (tmp_path / n).read_bytes() for n in ("metrics.jsonl", "curves.png")}
  log = report.Log(tmp_path)
  for step in range(6, 400, 2):  # a report larger than the disk has room for
    log.scalars(step, "train", {"loss": 1.0, "accuracy": 0.5, "input_wait_share": 0.01})
  limit = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit: EFBIG
  resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))  # room for 4 KiB a file
  try:
    log.close()
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    signal.signal(signal.SIGXFSZ, handler)
  warnings = warnings_in(capsys.readouterr().err)
  assert [w.split(" (")[0] for w in warnings] == [
    f"warning: cannot write {tmp_path / n}" for n in ("tensorboard", "metrics.jsonl", "curves.png")
  ]
  assert all("(File too large" in w for w in warnings)
  assert {n: (tmp_path / n).read_bytes() for n in before} == before
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "curves.png",
    "metrics.jsonl",
    "tensorboard",
  ]


def test_a_run_stopped_before_its_first_log_line_draws_empty_curves_quietly(tmp_path):
  log = report.Log(tmp_path)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # matplotlib's "No artists with labels" among them
    log.close()
  assert (tmp_path / "metrics.jsonl").read_text() == ""
  assert Image.open(tmp_path / "curves.png").format == "PNG"


def test_tensorboard_serves_the_scalars_the_trainer_writes(tmp_path):
  log_run(tmp_path, [1, 2, 3], loss=1.5)
  port = free_port()
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
  slow_input = [Host(0, 100.0, 0.01), Host(1, 100.0, 0.30, 12.5)]
  slow_host = [Host(0, 100.0, 0.01), Host(1, 85.0, 0.01)]
  assert not podview.differ(even)
  assert podview.differ(slow_input) and podview.differ(slow_host)
  assert podview.worst(slow_input).process == 1
  assert podview.which(slow_input) == ": process 1, the worst of 2"
  assert podview.which(slow_input[:1]) == ""  # one process: nobody to name
  assert podview.rows(slow_input, report.verdict).splitlines() == [
    "  process 0:     100 img/s  input wait  1.0% (not input-bound)  0 requests/s  peak RSS 0 MB",
    "  process 1:     100 img/s  input wait 30.0% (input-bound)  12 requests/s  peak RSS 0 MB",
  ]


def test_a_hosts_memory_counts_its_worker_processes():
  alone = podview.rss_mb()
  child = subprocess.Popen(  # a worker holding 200 MB of touched pages
    [sys.executable, "-c", "import sys; b = bytearray(200 << 20); print(1, flush=True); input()"],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert child.stdout.readline() == "1\n"
    assert podview.rss_mb() >= alone + 200
  finally:
    child.kill()
    child.wait()


def test_one_process_gathers_its_own_row():
  assert podview.gather(120.0, 0.25, 40.0) == [Host(0, 120.0, 0.25, 40.0)]


def test_a_runs_per_host_figures_leave_out_the_first_window_but_not_its_peak_memory():
  windows = [
    [Host(0, 10.0, 0.9, 0, 900.0), Host(1, 10.0, 0.9)],  # right after compilation
    [Host(0, 100.0, 0.0, 0, 500.0), Host(1, 50.0, 0.25, 0, 300.0)],
    [Host(0, 100.0, 0.125), Host(1, 70.0, 0.5, 0, 400.0)],
  ]
  assert podview.mean(windows) == [
    Host(0, 100.0, 0.0625, 0, 900.0),
    Host(1, 60.0, 0.375, 0, 400.0),
  ]
  assert podview.mean(windows[:1]) == windows[0]
  assert podview.mean([]) == []


@pytest.mark.slow
def test_a_profiler_trace_of_a_run_shows_the_pipeline_stages(digits_dir, tmp_path):
  out = subprocess.run(
    train_cmd(tmp_path, digits_dir, "--config.num_steps=6", "--config.profile_steps=(2, 5)"),
    env=env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  (trace,) = (tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb")
  data = trace.read_bytes()
  for stage in ("read", "decode", "finish", "handoff"):  # plan runs ahead, before the trace
    assert f"pipeline.{stage}".encode() in data, stage


def test_an_input_bound_host_is_told_what_bounds_its_input_and_what_to_change(photos_dir):
  """`report.advise`: `pipeline.explain` on a real stream's window (`Input.stats()`), the
  host's cores and the step on device data, as config.input settings to try."""
  one_thread = {"num_workers": 0, "num_threads": 1}
  data = pipeline.input(photos_dir, global_batch_size=8, image_size=64, performance=one_thread)
  for _ in range(12):
    next(data)
  window = data.stats()
  data.close()
  first, *tries = report.advise(data.spec, window, step_s=1e-6, cores=8)
  assert first.startswith("what bounds the input: decode (num_threads=1 decode threads per "), first
  assert tries[0].startswith("  try config.input.performance.num_workers="), tries
  assert "config.input.performance.num_threads=" in tries[0] and "expected " in tries[0]
  (keeps_up,) = report.advise(data.spec, window, step_s=100.0, cores=8)
  assert "keeps up with a 100000 ms step" in keeps_up and "no input change" in keeps_up
