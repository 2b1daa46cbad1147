"""The trainer as two hosts of a pod slice: two `python -m train` processes on this machine,
joined by --coordinator_address/--num_processes/--process_id, one CPU device each.

They train and evaluate every validation record once; processes that would train different
things refuse in one line each before anything is saved, while settings that change no batch
may differ; a host behind slow storage is named in process 0's log; SIGTERM on one saves the
same step on both; a killed process is named by the survivor in one line; each run resumes. A
process that never joins, or is stopped before joining, is named by the others in one line; so
is one that fails, with its cause.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import pytest

from tests.conftest import free_port
from tests.train.test_train import damage_train_records, env, train_cmd
from tests.train.test_train_hosts import busy_port

pytestmark = pytest.mark.slow  # two or three trainer processes a test: `make test-slow`

ROOT = pathlib.Path(__file__).resolve().parents[2]
VALIDATION = 60  # records in digits_dir's validation split


class Run:
  """Trainer processes of a run of `count`; `extra[i]` are process i's own extra arguments,
  `cwd[i]` its working folder; only the processes in `started` are started; `port`: the
  coordinator's (default: a free one)."""

  def __init__(
    self,
    tmp_path,
    workdir,
    data_dir,
    *args,
    extra=((), ()),
    steps=14,
    count=2,
    started=None,
    cwd=None,
    port=None,
  ):
    port = port or free_port()
    self.logs = [tmp_path / f"process{i}-{port}.log" for i in range(count)]
    self.procs = {}  # process id -> its process
    for i in range(count) if started is None else started:
      cmd = train_cmd(
        workdir,
        data_dir,
        f"--coordinator_address=127.0.0.1:{port}",
        f"--num_processes={count}",
        f"--process_id={i}",
        "--heartbeat_timeout=30",  # a busy 2-core machine must not lose a process
        f"--config.num_steps={steps}",
        *args,
        *(extra[i] if i < len(extra) else ()),
      )
      with open(self.logs[i], "w") as log:
        self.procs[i] = subprocess.Popen(
          cmd, cwd=cwd[i] if cwd else ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT
        )

  def output(self, i: int) -> str:
    return self.logs[i].read_text()

  def wait(self, timeout: float) -> list[int]:
    """Exit statuses of the started processes, waiting at most `timeout` s in all (a hang
    fails the test)."""
    deadline = time.monotonic() + timeout
    try:
      return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs.values()]
    except subprocess.TimeoutExpired:
      pytest.fail(f"still running after {timeout} s:\n{self.output(min(self.procs))[-2000:]}")
    finally:
      for p in self.procs.values():
        p.kill()
        p.wait()

  def wait_for(self, text: str, i: int = 0, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while text not in self.output(i):
      assert all(p.poll() is None for p in self.procs.values()), self.output(i)[-3000:]
      assert time.monotonic() < deadline, f"no {text!r}:\n{self.output(i)[-3000:]}"
      time.sleep(0.1)


def own_lines(out: str) -> list[str]:
  return [line for line in out.splitlines() if line.startswith("python -m train:")]


def own_line(out: str) -> str:
  """The trainer's one line of `out` (failing with `out` if there are more or none)."""
  lines = own_lines(out)
  assert len(lines) == 1, out[-3000:]
  return lines[0]


def summary(workdir) -> dict:
  return json.loads((pathlib.Path(workdir) / "summary.json").read_text())


THREADS, AHEAD = "--config.input.performance.num_threads", "--config.input.performance.read_ahead"


@pytest.fixture(scope="module")
def finished(digits_dir, tmp_path_factory):
  """A 14-step run of two processes with checkpoints at 7 and 14, whose hosts set decode
  threads and read-ahead (which change no batch) each its own way: (workdir, run)."""
  tmp_path = tmp_path_factory.mktemp("finished")
  extra = ((f"{THREADS}=2",), (f"{THREADS}=1", f"{AHEAD}=1"))
  run = Run(tmp_path, tmp_path / "w", digits_dir, "--config.checkpoint_every_steps=7", extra=extra)
  assert run.wait(timeout=400) == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
  return tmp_path / "w", run


def test_two_processes_train_and_evaluate_every_validation_record_once(finished):
  workdir, _ = finished
  result = summary(workdir)
  assert result["processes"] == 2 and result["devices"] == 2
  assert result["steps"] == 14
  assert result["eval_examples"] == VALIDATION
  # each host's process tree measured itself (a JAX process alone holds well over 100 MB)
  assert [h["process"] for h in result["hosts"]] == [0, 1]
  assert all(h["peak_rss_mb"] > 100 for h in result["hosts"]), result["hosts"]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["14", "7"]


def test_processes_that_disagree_refuse_in_one_line_before_saving(digits_dir, tmp_path):
  run = Run(tmp_path, tmp_path / "w", digits_dir, extra=((), ("--config.seed=1",)))
  codes = run.wait(timeout=60)
  for i in range(2):
    line = own_line(run.output(i))
    assert codes[i] == 2 and "processes disagree on config.seed: process 0 has" in line
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_settings_that_change_no_batch_may_differ_and_each_host_says_its_own(finished):
  _, run = finished
  assert "pipeline: no worker processes, 2 decode threads" in run.output(0)
  assert "pipeline: no worker processes, 1 decode threads" in run.output(1)
  assert "process 1: follow process 0's log" in run.output(1)
  for i in range(2):
    out = run.output(i)
    assert "config.input.performance.num_threads differs per host: process 0 2, process 1 1" in out
    assert (
      "config.input.performance.read_ahead differs per host: process 0 None, process 1 1" in out
    )


def test_a_host_behind_slow_storage_is_named_input_bound_in_process_0s_log(
  storage_rig, digits_dir, tmp_path
):
  """Each host reads the digits through its own mount ("data" in its own folder): host 0's
  answers at once, host 1's after 50 ms, 5 reads a second, a read per record: at least 3.2 s
  for each of its batches of 16, against 1 s a step on device data at load 16. Small buffers
  and no record cache (the same on both) hold a few batches, all read ahead during a long
  compilation (at load 16 they fed windows 1 and 2: 0.0% and 0.2% input wait, then 49% and
  71%); 16 steps outlast them, so the last window waits for storage whatever the load. Both
  evaluate from the digits on local disk: the verdict is the train stream's, and the final
  eval through 5 reads a second took half the test's time."""
  cwds = [tmp_path / f"host{i}" for i in range(2)]
  small = (
    "--config.input.order=global",
    "--config.device_depth=1",
    "--config.input.performance.prefetch=1",
    "--config.input.performance.read_ahead=1",
    "--config.input.performance.record_cache_mb=0",
    "--config.log_every=4",
  )
  with (
    storage_rig.mount(digits_dir, latency_ms=0, mountpoint=cwds[0] / "data"),
    storage_rig.mount(digits_dir, latency_ms=50, mountpoint=cwds[1] / "data", requests_per_s=5),
  ):
    local_eval = f"--config.eval_input.data_dir={digits_dir}"
    run = Run(tmp_path, tmp_path / "w", "data", *small, local_eval, steps=16, cwd=cwds)
    codes = run.wait(timeout=400)
  assert codes == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
  out = run.output(0)
  log_lines = [line for line in out.splitlines() if line.startswith("step ")]
  assert len(log_lines) == 4, out[-3000:]
  assert "(input-bound: process 1, the worst of 2;" in log_lines[-1], out[-3000:]
  after = out.split(log_lines[-1], 1)[1].splitlines()  # the last window's host rows follow it
  row = next((line for line in after if line.startswith("  process 1: ")), "")
  assert "% (input-bound)  " in row, out[-3000:]
  result = summary(tmp_path / "w")
  assert result["verdict"] == "input-bound" and result["verdict_process"] == 1
  assert [row["process"] for row in result["hosts"]] == [0, 1]
  assert result["hosts"][1]["verdict"] == "input-bound"
  assert result["hosts"][1]["input_wait_share"] > result["hosts"][0]["input_wait_share"]
  assert all(row["requests_per_sec"] > 0 for row in result["hosts"])  # each host's own reads


def test_a_workdir_each_process_sees_alone_is_refused(digits_dir, tmp_path):
  run = Run(
    tmp_path,
    tmp_path / "shared",
    digits_dir,
    extra=((), ("--workdir", str(tmp_path / "local1"))),
  )
  codes = run.wait(timeout=60)
  for i in range(2):
    line = own_line(run.output(i))
    assert codes[i] == 2 and "the workdir is not shared: process 1 cannot read" in line


def test_a_model_axis_across_processes_is_refused(digits_dir, tmp_path):
  run = Run(tmp_path, tmp_path / "w", digits_dir, "--config.model_parallel=2")
  codes = run.wait(timeout=60)
  for i in range(2):
    line = own_line(run.output(i))
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


def test_a_host_frozen_past_the_heartbeat_names_itself_and_the_others_name_it(digits_dir, tmp_path):
  """Process 1 and its trainer SIGSTOPped (as a paused VM) for longer than the heartbeat
  timeout, then continued: process 0 says it lost process 1; process 1 says it was stopped,
  not that it lost the coordinator (gone by the time it wakes)."""
  import psutil

  run = Run(tmp_path, tmp_path / "w", digits_dir, "--config.checkpoint_every_steps=1000", steps=400)
  run.wait_for("step      4")
  frozen = [run.procs[1].pid, *(c.pid for c in psutil.Process(run.procs[1].pid).children())]
  for pid in frozen:
    os.kill(pid, signal.SIGSTOP)
  run.procs[0].wait(timeout=120)
  for pid in frozen:
    os.kill(pid, signal.SIGCONT)
  assert run.wait(timeout=60) == [1, 1], run.output(1)[-3000:]
  line = own_line(run.output(0))
  assert line.startswith("python -m train: lost process 1 of the run"), line
  line = own_line(run.output(1))
  assert line.startswith("python -m train: this process (1) was stopped for "), line
  assert "past --heartbeat_timeout=30, so the run lost it" in line


def test_a_host_stopped_for_seconds_is_named_in_process_0s_log_and_the_run_finishes(
  digits_dir, tmp_path
):
  """Process 1 and its trainer SIGSTOPped for 8 s (a paused VM, well within the heartbeat
  timeout), then continued: the run finishes on both hosts, and process 0's log names
  process 1 as the host that did not run, for about as long (`train.stalls`), where its own
  input wait would blame no one."""
  import psutil

  run = Run(tmp_path, tmp_path / "w", digits_dir, "--config.checkpoint_every_steps=1000", steps=24)
  run.wait_for("step      4")
  frozen = [run.procs[1].pid, *(c.pid for c in psutil.Process(run.procs[1].pid).children())]
  for pid in frozen:
    os.kill(pid, signal.SIGSTOP)
  time.sleep(8)
  for pid in frozen:
    os.kill(pid, signal.SIGCONT)
  assert run.wait(timeout=600) == [0, 0], run.output(0)[-3000:]
  said = [line for line in run.output(0).splitlines() if " did not run for " in line]
  assert len(said) == 1 and said[0].startswith("process 1 did not run for "), run.output(0)
  assert float(said[0].split()[6]) >= 7.0, said[0]  # 8 s, less at most one 0.5 s tick
  assert said[0].endswith("(stopped or starved of CPU): the others waited for it"), said[0]


def last_line(out: str) -> str:
  return out.rstrip().splitlines()[-1]


def test_a_process_that_never_starts_is_named_after_the_join_timeout(digits_dir, tmp_path):
  run = Run(tmp_path, tmp_path / "w", digits_dir, "--join_timeout=8", started=(0,))
  run.wait_for("process 0: waiting for process 1 to join", timeout=60)
  assert run.wait(timeout=130) == [1], run.output(0)[-3000:]
  assert "Traceback" not in run.output(0)
  assert last_line(run.output(0)).startswith("python -m train: process 1 never joined")


def test_a_taken_coordinator_port_is_one_line_on_every_host_without_the_join_timeout(
  digits_dir, tmp_path
):
  with busy_port() as held:
    port = held.getsockname()[1]
    run = Run(tmp_path, tmp_path / "w", digits_dir, "--join_timeout=600", port=port)
    codes = run.wait(timeout=300)  # well within --join_timeout: process 0 told process 1
  assert codes == [2, 2], run.output(0)[-3000:] + run.output(1)[-3000:]
  line = (
    f"the coordinator's port {port} is in use on process 0's host (127.0.0.1), so JAX's service "
    "cannot listen there: stop what holds it, or give every host another port in "
    "--coordinator_address"
  )
  assert own_lines(run.output(0)) == [f"python -m train: {line}"]
  assert own_lines(run.output(1)) == [f"python -m train: process 0 failed: {line}"]
  for i in range(2):
    assert "Traceback" not in run.output(i) and "SIGSEGV" not in run.output(i)


def test_sigterm_before_joining_exits_143_and_the_others_name_it(digits_dir, tmp_path):
  """Three processes, one never started; process 1 stopped while they wait for it."""
  run = Run(tmp_path, tmp_path / "w", digits_dir, "--join_timeout=30", count=3, started=(0, 1))
  run.wait_for("process 1: waiting for process 2 to join", i=1, timeout=60)
  run.procs[1].send_signal(signal.SIGTERM)
  assert run.wait(timeout=130) == [1, 143], run.output(0)[-3000:]
  assert own_lines(run.output(1)) == [
    "python -m train: stopped by SIGTERM before joining the other processes"
  ]
  line = own_line(run.output(0))
  assert line.startswith("python -m train: processes 1 (stopped by SIGTERM), 2 never joined")


def test_a_bad_record_on_one_process_is_named_with_its_cause_on_both(digits_dir, tmp_path):
  """Each process reads its own copy of the data (the same relative data_dir); process 1's
  has damaged records, of the same size."""
  for i in range(2):
    shutil.copytree(digits_dir, tmp_path / f"host{i}" / "data")
  damage_train_records(tmp_path / "host1" / "data", first=20)
  cwd = [tmp_path / f"host{i}" for i in range(2)]
  run = Run(tmp_path, tmp_path / "w", "data", cwd=cwd, steps=20)
  assert run.wait(timeout=300) == [1, 1], run.output(0)[-3000:] + run.output(1)[-3000:]
  for i in range(2):
    line = last_line(run.output(i))
    assert re.match(
      r"python -m train: process 1 failed: train.array_record-00000-of-00001 record \d+: "
      "corrupt record",
      line,
    ), run.output(i)[-3000:]
    assert line.endswith("--config.input.on_error=skip skips bad records (counted)")
    assert "lost" not in run.output(i)
