"""Checkpoints you can trust: damaged ones are never loaded silently, the run falls back to
the previous one; one trainer per workdir; Ctrl-C saves; a failed save and a finished run
say so in one line; the logs carry no Orbax chatter. Real runs, real files, real signals."""

import hashlib
import json
import random
import re
import resource
import shutil
import signal
import subprocess

import pytest

from pipeline.convert import images
from tests.train.test_train import ROOT, env, summary, train_cmd, wait_for

pytestmark = pytest.mark.slow  # trainer runs (a module-scoped one shared): `make test-slow`

STEPS = ["--config.num_steps=6", "--config.checkpoint_every_steps=2", "--config.keep_checkpoints=3"]


def train(workdir, data_dir, *extra, **kwargs):
  return subprocess.run(
    train_cmd(workdir, data_dir, *STEPS, *extra),
    env=env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    **kwargs,
  )


@pytest.fixture(scope="module")
def finished(digits_dir, tmp_path_factory):
  """A 6-step run with checkpoints at steps 2, 4 and 6, and its output."""
  workdir = tmp_path_factory.mktemp("finished") / "run"
  out = train(workdir, digits_dir)
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir, out


def interrupted_copy(finished, tmp_path):
  """The finished run as if killed before its final eval: checkpoints, no summary."""
  workdir = tmp_path / "run"
  shutil.copytree(finished[0], workdir)
  (workdir / "summary.json").unlink()
  return workdir


def largest_state_file(workdir, step):
  files = [p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
  return max(files, key=lambda p: p.stat().st_size)


def truncate(path):
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_16_bytes(path):
  data = bytearray(path.read_bytes())
  for i in random.Random(0).sample(range(len(data)), 16):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def shift_data_state(path):
  """A silent change: valid JSON, a valid state, but not the one that was saved."""
  text = path.read_text()
  path.write_text(re.sub(r'"next_index": (\d+)', lambda m: f'"next_index": {int(m[1]) - 1}', text))


def data_state_file(workdir, step):
  return next((workdir / "checkpoints" / str(step) / "data").glob("process_*.json"))


def test_training_logs_are_quiet(finished):
  workdir, out = finished
  lines = (out.stdout + out.stderr).splitlines()
  assert not [x for x in lines if re.match(r"[IWEF]\d{4} ", x) or "orbax" in x.lower()]
  trainer_lines = [x for x in out.stdout.splitlines() if not x.startswith("pipeline: ")]
  # only an input-bound run ends with what bounds its input and what to change (its last
  # window's stage figures permitting: `report.Reporter.advise`)
  advice = trainer_lines[11:]
  if advice:
    assert summary(workdir)["verdict"] != "not input-bound", out.stdout[-3000:]
    assert advice[0].startswith(("what bounds the input: ", "the input (")), advice
  assert [x.split()[0] for x in trainer_lines[:11]] == [
    "plan:",
    "note:",  # 6 steps end before the recipe's first eval: it evaluates at its end only
    "warning:",  # and its warmup is more than 25% of them
    "input",  # what the input wait measures, once
    "compiling",
    "compiled",
    "step",
    "step",
    "step",
    "eval:",
    "peak",  # RSS, the loader's planned memory and the step's host work, once
  ]


@pytest.mark.parametrize("garbage", [b"\x00\xff not json", b'["a list"]'])
def test_a_summary_this_trainer_did_not_write_is_refused_in_one_line(
  finished, digits_dir, tmp_path, garbage
):
  workdir = tmp_path / "run"
  shutil.copytree(finished[0], workdir)
  (workdir / "summary.json").write_bytes(garbage)
  out = train(workdir, digits_dir)
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.count("\n") == 1 and "is not a summary this trainer wrote" in out.stderr
  assert (workdir / "summary.json").read_bytes() == garbage  # nothing overwritten


def test_a_finished_run_rerun_says_already_done_and_keeps_its_summary(
  finished, digits_dir, tmp_path
):
  workdir = tmp_path / "run"
  shutil.copytree(finished[0], workdir)
  before = (workdir / "summary.json").read_bytes()
  out = train(workdir, digits_dir)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.startswith("already done: 6 steps") and "step " not in out.stdout
  assert (workdir / "summary.json").read_bytes() == before


@pytest.mark.parametrize(
  "damage, file",
  [
    (truncate, largest_state_file),
    (flip_16_bytes, largest_state_file),
    (shift_data_state, data_state_file),
  ],
)
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_resumes_exactly(
  finished, digits_dir, tmp_path, damage, file
):
  workdir = interrupted_copy(finished, tmp_path)
  damage(file(workdir, 6))
  out = train(workdir, digits_dir)
  assert out.returncode == 0, out.stderr[-3000:]
  warnings = [x for x in out.stderr.splitlines() if x.startswith("warning:")]
  assert len(warnings) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert f"checkpoint {workdir / 'checkpoints' / '6'} does not restore" in warnings[0]
  assert "resuming from step 4" in warnings[0]
  assert (workdir / "unrestorable" / "6").is_dir()  # kept for a post-mortem, not deleted
  assert "resumed from step 4" in out.stdout
  assert summary(workdir)["params_sha256"] == summary(finished[0])["params_sha256"]


def test_a_rerun_after_a_kill_mid_write_finishes_and_keeps_what_it_sets_aside(
  finished, digits_dir, tmp_path
):
  """Killed while saving a checkpoint at step 5 (after a Ctrl-C) and while writing
  metrics.jsonl: the re-run removes the unfinished save, moves the cut file aside, finishes."""
  workdir = interrupted_copy(finished, tmp_path)
  checkpoints = workdir / "checkpoints"
  shutil.copytree(checkpoints / "4", checkpoints / "5.orbax-checkpoint-tmp")
  metrics = workdir / "metrics.jsonl"
  cut = metrics.read_bytes()[:-20]
  metrics.write_bytes(cut)
  out = train(workdir, digits_dir)
  assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.stderr.splitlines() == [
    f"warning: removing 5.orbax-checkpoint-tmp from {checkpoints}: a save cut short "
    "(never restorable)",
    f"warning: {metrics} line 3 is not a metrics row: moved it to {metrics}.damaged and began anew",
  ]
  assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4", "6"]
  assert (workdir / "metrics.jsonl.damaged").read_bytes() == cut
  assert summary(workdir)["steps"] == 6
  assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [6]


def test_when_no_checkpoint_restores_the_run_is_refused_in_one_line(finished, digits_dir, tmp_path):
  workdir = interrupted_copy(finished, tmp_path)
  for step in (2, 4, 6):
    truncate(largest_state_file(workdir, step))
  out = train(workdir, digits_dir)
  assert out.returncode == 1
  assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert "no checkpoint in" in out.stderr and "step 2:" in out.stderr
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4", "6"]
  assert not (workdir / "summary.json").exists()


def without_shard_list(workdir, step):
  """Checkpoint `step` as saved before data states named their shard list."""
  path = data_state_file(workdir, step)
  state = json.loads(path.read_text())
  del state["stream"]["shards"]
  text = json.dumps(state, indent=4)  # as grain's handler writes it
  path.write_text(text)
  sums_path = workdir / "checkpoints" / str(step) / "checksums" / "metadata"
  sums = json.loads(sums_path.read_text())
  sums["data_sha256"] = [hashlib.sha256(text.encode()).hexdigest()]
  sums_path.write_text(json.dumps(sums))


def test_a_checkpoint_from_before_the_shard_list_resumes_exactly_with_a_warning(
  finished, digits_dir, tmp_path
):
  workdir = interrupted_copy(finished, tmp_path)
  shutil.rmtree(workdir / "checkpoints" / "6")
  without_shard_list(workdir, 4)
  out = train(workdir, digits_dir)
  assert out.returncode == 0 and "resumed from step 4" in out.stdout, out.stderr[-3000:]
  assert "saved before states named their shard list" in out.stderr
  assert summary(workdir)["params_sha256"] == summary(finished[0])["params_sha256"]


@pytest.fixture(scope="module")
def in_blocks(digits_dir, tmp_path_factory):
  """A 6-step run in the block order (a bucket's default), checkpoints at 2, 4 and 6."""
  workdir = tmp_path_factory.mktemp("blocks") / "run"
  out = train(workdir, digits_dir, "--config.input.order=blocks")
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir, out


def refused_and_kept(out, workdir) -> str:
  """The one line of a run refused with its checkpoints left in place."""
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert "checkpoint 6 in" in out.stderr and "is good" in out.stderr
  assert "aside" not in out.stderr and not (workdir / "unrestorable").exists()
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4", "6"]
  return out.stderr


def test_a_checkpoint_resumed_over_another_shard_list_is_refused_and_kept(
  finished, digits_raw, tmp_path
):
  workdir = interrupted_copy(finished, tmp_path)
  resharded = tmp_path / "resharded"  # the same images, converted into smaller shards
  images.convert(
    images.Request(digits_raw, resharded, val_fraction=0.2, seed=0, shard_size_mb=0.1),
    workers=1,
    progress=False,
  )
  line = refused_and_kept(train(workdir, resharded), workdir)
  assert re.search(r"another shard list \(1 shard\(s\) in the state, \d+ here\)", line)


@pytest.mark.parametrize(
  "flags, fix",
  [
    (
      (),
      "iterator state of order='blocks' cannot continue in order='global': pass "
      "--config.input.order=blocks",
    ),
    (
      ("--config.input.order=blocks", "--config.batch_size=16"),
      "cannot continue in blocks of 256 and windows of 64 (global batch 16): pass "
      "--config.input.window_blocks=128",
    ),
  ],
  ids=["order", "global_batch"],
)
def test_a_block_order_checkpoint_this_run_cannot_continue_names_the_flags_that_would(
  in_blocks, digits_dir, tmp_path, flags, fix
):
  workdir = interrupted_copy(in_blocks, tmp_path)
  assert refused_and_kept(train(workdir, digits_dir, *flags), workdir).endswith(fix + "\n")


def test_a_block_order_checkpoint_resumes_exactly_with_the_flag_its_refusal_names(
  in_blocks, digits_dir, tmp_path
):
  workdir = interrupted_copy(in_blocks, tmp_path)
  shutil.rmtree(workdir / "checkpoints" / "6")
  out = train(workdir, digits_dir, "--config.input.order=blocks")
  assert out.returncode == 0 and "resumed from step 4" in out.stdout, out.stderr[-3000:]
  assert summary(workdir)["params_sha256"] == summary(in_blocks[0])["params_sha256"]


def start(workdir, data_dir):
  return subprocess.Popen(
    train_cmd(workdir, data_dir, "--config.num_steps=400", "--config.checkpoint_every_steps=1000"),
    env=env(),
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def wait_for_line(proc, text):
  lines = []
  wait_for(lambda: lines.append(proc.stdout.readline()) or text in lines[-1], proc)


def test_a_second_trainer_on_the_same_workdir_is_refused(digits_dir, tmp_path):
  first = start(tmp_path, digits_dir)
  try:
    wait_for_line(first, "plan:")
    second = train(tmp_path, digits_dir)
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1, second.stderr[-3000:]
    assert f"{tmp_path} is in use by another trainer (pid {first.pid} on " in second.stderr
    assert first.poll() is None
  finally:
    first.kill()
    first.wait()


def test_sigint_saves_a_checkpoint_and_exits_130(digits_dir, tmp_path):
  proc = start(tmp_path, digits_dir)
  wait_for_line(proc, "step      4")
  proc.send_signal(signal.SIGINT)
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 130, out[-3000:]
  saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
  assert saved and 4 <= saved[0] < 400
  assert f"SIGINT: saved checkpoint at step {saved[0]}" in out


def test_a_failed_save_says_why_in_one_line(digits_dir, tmp_path):
  def disk_full_at_300_kb():  # under every data file of a checkpoint here (0.6-1 MB)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

  out = train(tmp_path, digits_dir, "--compilation_cache=", preexec_fn=disk_full_at_300_kb)
  assert out.returncode == 1
  assert out.stderr.count("\n") == 1, out.stderr[-3000:]
  assert re.search(r"saving checkpoint \d+ to .*checkpoints failed: File too large", out.stderr)
