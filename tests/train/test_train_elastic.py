"""The trainer resumes a checkpoint saved on N processes on M: the global batch is kept (each
process's batch recomputed), the data continues at its global position, and it says so.

Each test runs 18 steps unresized (checkpoints at 6, 12 and 18) and resumes a copy of that
workdir's checkpoint 12 on the other process count. The loss of step 13, the first one after
the resume (the same parameters, the same global batch, other devices), equals the
unresized run's up to the order of floating-point reductions. Later steps are not compared:
this small model's training amplifies rounding differences (two unresized runs on 1 and 2
processes differ by 1e-7 at step 4 and by percents at step 8), whatever the data. Owned
shards, whose order depends on the process count, are refused in one line, nothing written.
"""

import json
import shutil
import subprocess

import pytest

from pipeline.convert import images
from tests.train.test_train import ROOT, env, train_cmd
from tests.train.test_train_multihost import Run, own_lines, summary

# No dropout: its masks come from "rbg" keys, whose bits follow the devices' layout.
FLAGS = ("--config.checkpoint_every_steps=6", "--config.log_every=1", "--config.dropout=0")


pytestmark = pytest.mark.slow  # trainer runs on one and two processes: `make test-slow`


def losses(workdir) -> dict[int, float]:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def one_process(workdir, data_dir, *extra) -> str:
  done = subprocess.run(
    train_cmd(workdir, data_dir, *FLAGS, "--config.num_steps=18", *extra),
    cwd=ROOT,
    env=env(),
    capture_output=True,
    text=True,
    timeout=400,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout + done.stderr


def two_processes(tmp_path, workdir, data_dir) -> str:
  run = Run(tmp_path, workdir, data_dir, *FLAGS, steps=18)
  assert run.wait(timeout=400) == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
  return run.output(0)


def at_checkpoint_12(unresized, workdir) -> None:
  """`workdir`: a copy of `unresized` as it was right after its checkpoint 12."""
  shutil.copytree(unresized, workdir, ignore=shutil.ignore_patterns("trainer.lock"))
  shutil.rmtree(workdir / "checkpoints" / "18")
  (workdir / "summary.json").unlink()
  rows = (workdir / "metrics.jsonl").read_text().splitlines()
  (workdir / "metrics.jsonl").write_text("".join(r + "\n" for r in rows[:12]))


def check_resumed(workdir, unresized, hosts: int, saved_on: int, out: str) -> None:
  on = "1 host" if hosts == 1 else f"{hosts} hosts"
  line = f"resumed from step 12 on {on} (saved on {saved_on}) ({workdir / 'checkpoints'})"
  assert line in out
  assert "aside" not in out
  assert summary(workdir)["steps"] == 18 and summary(workdir)["processes"] == hosts
  resumed, expected = losses(workdir), losses(unresized)
  assert sorted(resumed) == sorted(expected) == list(range(1, 19))
  assert resumed[13] == pytest.approx(expected[13], rel=1e-5, abs=0)


def test_two_processes_resumed_on_one(digits_dir, tmp_path):
  unresized, workdir = tmp_path / "unresized", tmp_path / "resized"
  two_processes(tmp_path, unresized, digits_dir)
  at_checkpoint_12(unresized, workdir)
  check_resumed(workdir, unresized, 1, 2, one_process(workdir, digits_dir))


def test_one_process_resumed_on_two(digits_dir, tmp_path):
  unresized, workdir = tmp_path / "unresized", tmp_path / "resized"
  one_process(unresized, digits_dir)
  at_checkpoint_12(unresized, workdir)
  check_resumed(workdir, unresized, 2, 1, two_processes(tmp_path, workdir, digits_dir))


def test_owned_shards_on_another_process_count_are_refused_in_one_line(digits_raw, tmp_path):
  data, workdir = tmp_path / "data", tmp_path / "w"
  images.convert(
    images.Request(digits_raw, data, val_fraction=0.2, seed=0, shard_size_mb=0.1),
    workers=1,
    progress=False,
  )
  owned = ("--config.input.sharding=shards", "--config.eval_input.sharding=records")
  one_process(workdir, data, *owned, "--config.num_steps=6")
  before = files(workdir)
  run = Run(tmp_path, workdir, data, *FLAGS, *owned, steps=12)
  codes = run.wait(timeout=300)
  for i in range(2):
    (line,) = own_lines(run.output(i))
    assert codes[i] == 2, run.output(i)[-3000:]
    assert "checkpoint 6 in" in line and "was saved by 1 process(es) and is good" in line
    assert "owned shards (sharding='shards')" in line and "resume on 1 process(es)" in line
  assert files(workdir) == before  # nothing written, nothing moved


def files(workdir) -> dict[str, int]:
  """Every file under `workdir` with its modification time, but the lock and the token by
  which processes check that they share the workdir (every start writes them)."""
  return {
    str(p): p.stat().st_mtime_ns
    for p in workdir.rglob("*")
    if p.is_file() and p.name not in ("trainer.lock", "processes.token")
  }
