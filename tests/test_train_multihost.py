"""The trainer as two hosts of a pod slice: two `python -m train` processes on this machine,
joined by --coordinator_address/--num_processes/--process_id, one CPU device each.

They train and evaluate every validation record once; processes that would train different
things refuse in one line each before anything is saved; SIGTERM on one saves the same step
on both; a killed process is named by the survivor in one line; each run resumes.
"""

import json
import pathlib
import signal
import socket
import subprocess
import time

import pytest

from tests.test_train import env, train_cmd

ROOT = pathlib.Path(__file__).resolve().parent.parent
VALIDATION = 60  # records in digits_dir's validation split


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Run:
  """Two trainer processes; `extra[i]` are process i's own extra arguments, `cwds[i]` its
  working directory (a relative data_dir then names each host's own mount, as on a pod)."""

  def __init__(
    self, tmp_path, workdir, data_dir, *args, extra=((), ()), steps=14, cwds=(ROOT, ROOT)
  ):
    port = free_port()
    self.logs = [tmp_path / f"process{i}-{port}.log" for i in range(2)]
    self.procs = []
    for i in range(2):
      cmd = train_cmd(
        workdir,
        data_dir,
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={i}",
        "--heartbeat_timeout=30",  # a busy 2-core machine must not lose a process
        f"--config.num_steps={steps}",
        *args,
        *extra[i],
      )
      with open(self.logs[i], "w") as log:
        self.procs.append(
          subprocess.Popen(cmd, cwd=cwds[i], env=env(), stdout=log, stderr=subprocess.STDOUT)
        )

  def output(self, i: int) -> str:
    return self.logs[i].read_text()

  def wait(self, timeout: float) -> list[int]:
    """Exit statuses, waiting at most `timeout` s in all (a hang fails the test)."""
    deadline = time.monotonic() + timeout
    try:
      return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
    except subprocess.TimeoutExpired:
      pytest.fail(f"still running after {timeout} s:\n{self.output(0)[-2000:]}")
    finally:
      for p in self.procs:
        p.kill()
        p.wait()

  def wait_for(self, text: str, i: int = 0, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while text not in self.output(i):
      assert all(p.poll() is None for p in self.procs), self.output(0)[-3000:]
      assert time.monotonic() < deadline, f"no {text!r}:\n{self.output(i)[-3000:]}"
      time.sleep(0.1)


def own_lines(out: str) -> list[str]:
  return [line for line in out.splitlines() if line.startswith("python -m train:")]


def summary(workdir) -> dict:
  return json.loads((pathlib.Path(workdir) / "summary.json").read_text())


def test_two_processes_train_and_evaluate_every_validation_record_once(digits_dir, tmp_path):
  run = Run(tmp_path, tmp_path / "w", digits_dir, "--config.checkpoint_every_steps=7")
  assert run.wait(timeout=400) == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
  result = summary(tmp_path / "w")
  assert result["processes"] == 2 and result["devices"] == 2
  assert result["steps"] == 14
  assert result["eval_examples"] == VALIDATION
  assert sorted(p.name for p in (tmp_path / "w" / "checkpoints").iterdir()) == ["14", "7"]


@pytest.mark.parametrize(
  "extra, field",
  [
    ((), ("--config.seed=1",)),
    ((), ("--config.batch_size=64",)),
    ((), ("--config.input.image_size=24",)),
    ((), ("--config.optimizer=sgd",)),
  ],
  ids=["seed", "batch_size", "image_size", "optimizer"],
)
def test_processes_that_disagree_refuse_in_one_line_before_saving(
  digits_dir, tmp_path, extra, field
):
  run = Run(tmp_path, tmp_path / "w", digits_dir, extra=(extra, field))
  codes = run.wait(timeout=60)
  name = field[0].split("=")[0].removeprefix("--")
  for i in range(2):
    lines = own_lines(run.output(i))
    assert codes[i] == 2 and len(lines) == 1, run.output(i)[-3000:]
    assert f"processes disagree on {name}: process 0 has" in lines[0]
    assert "process 1 " in lines[0]
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_a_different_dataset_on_one_process_is_refused(digits_dir, photos_dir, tmp_path):
  run = Run(
    tmp_path, tmp_path / "w", digits_dir, extra=((), (f"--config.input.data_dir={photos_dir}",))
  )
  codes = run.wait(timeout=60)
  for i in range(2):
    (line,) = own_lines(run.output(i))
    assert codes[i] == 2 and "processes disagree on config.input.data_dir" in line


def test_a_workdir_each_process_sees_alone_is_refused(digits_dir, tmp_path):
  run = Run(
    tmp_path,
    tmp_path / "shared",
    digits_dir,
    extra=((), ("--workdir", str(tmp_path / "local1"))),
  )
  codes = run.wait(timeout=60)
  for i in range(2):
    (line,) = own_lines(run.output(i))
    assert codes[i] == 2 and "the workdir is not shared: process 1 cannot read" in line


def test_a_model_axis_across_processes_is_refused(digits_dir, tmp_path):
  run = Run(tmp_path, tmp_path / "w", digits_dir, "--config.model_parallel=2")
  codes = run.wait(timeout=60)
  for i in range(2):
    (line,) = own_lines(run.output(i))
    assert codes[i] == 2 and "config.model_parallel=2 spans processes" in line


def test_sigterm_on_one_process_saves_the_same_step_on_both_and_resumes(digits_dir, tmp_path):
  workdir = tmp_path / "w"
  flags = ("--config.checkpoint_every_steps=1000",)
  run = Run(tmp_path, workdir, digits_dir, *flags, steps=400)
  run.wait_for("step      4")
  run.procs[1].send_signal(signal.SIGTERM)
  assert run.wait(timeout=60) == [143, 143], run.output(0)[-3000:]
  (saved,) = [int(p.name) for p in (workdir / "checkpoints").iterdir()]
  assert f"saved checkpoint at step {saved} on all 2 processes" in run.output(0)

  again = Run(tmp_path, workdir, digits_dir, *flags, steps=saved + 4)
  assert again.wait(timeout=400) == [0, 0], again.output(0)[-3000:]
  assert f"resumed from step {saved}" in again.output(0)
  assert summary(workdir)["steps"] == saved + 4


@pytest.mark.parametrize("killed", [1, 0], ids=["worker", "coordinator"])
def test_a_killed_process_is_named_by_the_survivor_and_the_run_resumes(
  digits_dir, tmp_path, killed
):
  workdir = tmp_path / "w"
  flags = ("--config.checkpoint_every_steps=4",)
  run = Run(tmp_path, workdir, digits_dir, *flags, steps=400)
  run.wait_for("step      6")
  run.procs[killed].send_signal(signal.SIGKILL)
  survivor = 1 - killed
  run.procs[survivor].wait(timeout=120)
  out = run.output(survivor)
  assert run.procs[survivor].returncode == 1, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  (line,) = own_lines(out)
  assert f"lost process {killed}" in line and "re-run the same command on every host" in line
  saved = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert f"the last checkpoint is step {saved}" in line
  run.wait(timeout=10)

  again = Run(tmp_path, workdir, digits_dir, *flags, steps=saved + 2)
  assert again.wait(timeout=400) == [0, 0], again.output(0)[-3000:]
  assert f"resumed from step {saved}" in again.output(0)


def test_the_distributed_services_verdicts_name_the_lost_process():
  """The texts jax 0.10.2 printed here when process 1, then process 0, was SIGKILLed."""
  from train import supervise

  worker = (
    "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n"
    "The tasks have crashed. Check the task logs for an earlier error"
  )
  leader = (
    "absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader "
    "task was preempted/died/restarted unexpectedly or this task is experiencing network issues."
  )
  assert supervise.lost_process(worker) == "process 1"
  assert supervise.lost_process(leader) == "process 0 (the coordinator)"
  assert supervise.flag(["--workdir", "a", "--workdir=b"], "workdir") == "b"  # as absl reads it
  assert supervise.wanted(["--num_processes=2"]) and not supervise.wanted(["--num_processes=1"])
