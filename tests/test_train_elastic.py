"""The trainer resumes a checkpoint saved on N processes on M: the global batch is kept (each
process's batch recomputed), the data continues at its global position, and the loss curve
is the unresized run's, equal up to the order of floating-point reductions.

The unresized run: one process, 18 steps, checkpoints at 6, 12 and 18, a loss logged every
2 steps. 2 -> 1: two processes train 12 steps, one process resumes them to 18. 1 -> 2: two
processes resume the unresized run's checkpoint 12 (a copy of its workdir) to 18.
"""

import json
import shutil
import subprocess

import pytest

from tests.test_train import ROOT, env, train_cmd
from tests.test_train_multihost import Run, summary

STEPS = ("--config.checkpoint_every_steps=6",)


def losses(workdir) -> dict[int, float]:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def one_process(workdir, data_dir, steps: int) -> str:
  done = subprocess.run(
    train_cmd(workdir, data_dir, *STEPS, f"--config.num_steps={steps}"),
    cwd=ROOT,
    env=env(),
    capture_output=True,
    text=True,
    timeout=400,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout + done.stderr


@pytest.fixture(scope="module")
def unresized(digits_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("unresized") / "w"
  one_process(workdir, digits_dir, 18)
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["12", "18"]
  return workdir


def test_two_processes_resumed_on_one_follow_the_unresized_loss_curve(
  digits_dir, tmp_path, unresized
):
  workdir = tmp_path / "w"
  run = Run(tmp_path, workdir, digits_dir, *STEPS, steps=12)
  assert run.wait(timeout=400) == [0, 0], run.output(0)[-3000:]
  out = one_process(workdir, digits_dir, 18)
  assert f"resumed from step 12 on 1 hosts (saved on 2) ({workdir / 'checkpoints'})" in out
  assert summary(workdir)["steps"] == 18 and summary(workdir)["processes"] == 1
  expected = losses(unresized)
  assert sorted(losses(workdir)) == sorted(expected) == list(range(2, 19, 2))
  assert losses(workdir) == pytest.approx(expected, rel=1e-4)


def test_one_process_resumed_on_two_follows_the_unresized_loss_curve(
  digits_dir, tmp_path, unresized
):
  workdir = tmp_path / "w"
  shutil.copytree(unresized, workdir, ignore=shutil.ignore_patterns("trainer.lock"))
  shutil.rmtree(workdir / "checkpoints" / "18")
  (workdir / "summary.json").unlink()
  rows = (workdir / "metrics.jsonl").read_text().splitlines()  # steps 14-18 logged again
  (workdir / "metrics.jsonl").write_text("".join(r + "\n" for r in rows[:6]))
  run = Run(tmp_path, workdir, digits_dir, *STEPS, steps=18)
  assert run.wait(timeout=400) == [0, 0], run.output(0)[-3000:]
  assert f"resumed from step 12 on 2 hosts (saved on 1) ({workdir / 'checkpoints'})" in (
    run.output(0)
  )
  assert summary(workdir)["steps"] == 18 and summary(workdir)["processes"] == 2
  assert losses(workdir) == pytest.approx(losses(unresized), rel=1e-4)
  assert sorted(losses(workdir)) == list(range(2, 19, 2))
