"""The multi-host checks in this process, as the trainer's processes run them: the start check
compares what each process sent (settings that change no batch named per host, any other
difference refused naming the field), a taken coordinator port is found before JAX would
crash on it, and the distributed service's verdicts name the lost process. The trainer's
processes doing so end to end: test_train_multihost.py (`make test-slow`)."""

import pathlib
import signal
import socket
import sys

import pytest

from configs import default
from tests.conftest import free_port
from train import UsageError, agreement, hosts, train


def start_fields(digits_dir, workdir, **changes) -> dict:
  """What a process of a two-process run sends to the start check (`hosts.agree`), from
  `train.prepare` in this process with `changes` ("input.data_dir": path) to the config."""
  config = default.get_config()
  config.input.data_dir, config.batch_size = str(digits_dir), 32
  for name, value in changes.items():
    group, _, field = name.rpartition(".")
    setattr(config[group] if group else config, field, value)
  setup = train.prepare(config)
  fields = agreement.start_fields(
    config, (setup.train, setup.eval), setup.plan, setup.mesh, workdir, token="t"
  )
  return {"error": None, "fields": list(fields.items()), "own": agreement.host_settings(config)}


@pytest.fixture(scope="module")
def process_0(digits_dir, tmp_path_factory) -> dict:
  return start_fields(digits_dir, tmp_path_factory.mktemp("w"))


def test_settings_that_change_no_batch_are_named_per_host_by_the_start_check(
  digits_dir, tmp_path, process_0
):
  threads = "input.performance.num_threads"
  sent = [process_0, start_fields(digits_dir, tmp_path, **{threads: 1})]
  assert hosts.compare(sent) == [f"config.{threads} differs per host: process 0 None, process 1 1"]


@pytest.mark.parametrize(
  "changes",
  [
    {"seed": 1},
    {"batch_size": 64},
    {"input.image_size": 24},
    {"optimizer": "sgd"},
    {"input.data_dir": "photos"},
  ],
  ids=["seed", "batch_size", "image_size", "optimizer", "data_dir"],
)
def test_processes_that_disagree_are_refused_naming_the_field(
  digits_dir, photos_dir, tmp_path, process_0, changes
):
  """In this process (the start check's comparison of what each process sent); the two
  processes' refusal, each in one line before saving: test_train_multihost.py."""
  changes = {k: str(photos_dir) if v == "photos" else v for k, v in changes.items()}
  sent = [process_0, start_fields(digits_dir, tmp_path, **changes)]
  (name,) = changes
  with pytest.raises(UsageError) as refused:
    hosts.compare(sent)
  assert f"processes disagree on config.{name}: process 0 has" in str(refused.value)
  assert "process 1 " in str(refused.value)


def busy_port() -> socket.socket:
  """A socket listening on a free port, as another service holding it."""
  held = socket.socket()
  held.bind(("127.0.0.1", free_port()))
  held.listen()
  return held


def test_a_taken_coordinator_port_is_found_before_jax_would_crash_on_it():
  with busy_port() as held:
    port = held.getsockname()[1]
    assert hosts.port_in_use(f"127.0.0.1:{port}") == (
      f"the coordinator's port {port} is in use on process 0's host (127.0.0.1), so JAX's "
      "service cannot listen there: stop what holds it, or give every host another port in "
      "--coordinator_address"
    )
  assert hosts.port_in_use(f"127.0.0.1:{port}") is None  # free again


# The texts jax 0.10.2 printed here when process 1, then process 0, was SIGKILLed.
WORKER_LOST = (
  "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n"
  "The tasks have crashed. Check the task logs for an earlier error"
)
LEADER_LOST = (
  "absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader "
  "task was preempted/died/restarted unexpectedly or this task is experiencing network issues."
)


def test_the_distributed_services_verdicts_name_the_lost_process():
  from train import supervise

  assert supervise.lost_process(WORKER_LOST) == "process 1"
  assert supervise.lost_process(LEADER_LOST) == "process 0 (the coordinator)"
  assert supervise.flag(["--workdir", "a", "--workdir=b"], "workdir") == "b"  # as absl reads it
  assert supervise.wanted(["--num_processes=2"]) and not supervise.wanted(["--num_processes=1"])


def test_a_process_the_service_lost_for_its_own_stop_names_itself():
  """Heartbeats go every timeout/2 s, so a stop shorter than the timeout can lose a process:
  woken, it may read the verdict naming it, or find the coordinator gone; either is its own
  stop. Unstopped, it names whom the verdict names."""
  from train.supervise import verdict_line

  stopped = "this process (1) was stopped for 24 s: no heartbeat past --heartbeat_timeout=30, so "
  assert verdict_line(WORKER_LOST, "1", 23.6, 30) == stopped + "the run lost it"
  assert verdict_line(LEADER_LOST, "1", 23.6, 30) == stopped + "the run lost it"
  assert verdict_line(LEADER_LOST, "1", 14.6, 30).startswith(
    "this process (1) was stopped for 15 s"
  )
  assert verdict_line(WORKER_LOST, "1", 0.4, 30) == (
    "the distributed service heard no heartbeat from this process (1) past "
    "--heartbeat_timeout=30, so the run lost it"
  )
  assert verdict_line(WORKER_LOST, "0", 0.4, 30) == "lost process 1 of the run"
  assert verdict_line(LEADER_LOST, "1", 3.0, 30) == "lost process 0 (the coordinator) of the run"
  assert verdict_line(WORKER_LOST.replace("\n1\n", "\n2\n"), "1", 31.0, 30).startswith(
    "this process (1) was stopped for 31 s"
  )


def supervised(workdir, child: str) -> int:
  """`train.supervise.run` of a real child process running `child` (Python) for a run in
  `workdir`; this process's signal handlers (which it passes to the child) left as they were."""
  from train import supervise

  root = str(pathlib.Path(__file__).parents[2])
  command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); {child}"]
  handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return supervise.run(["--workdir", str(workdir)], command)
  finally:
    for s, handler in handlers.items():
      signal.signal(s, handler)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's, in this process only
def test_a_completed_run_whose_trainer_aborts_while_exiting_exits_0_saying_so(tmp_path, capfd):
  """JAX's exit can abort a process after the run completed (summary and final checkpoint
  written): the parent says so and exits 0; a child that aborts before completing is a death."""
  (tmp_path / "checkpoints" / "60").mkdir(parents=True)
  aborts = "import os; os.abort()"
  assert supervised(tmp_path, f"from train import supervise; supervise.completed(); {aborts}") == 0
  assert capfd.readouterr().err.splitlines()[-1] == (
    "python -m train: the run completed (the last checkpoint is step 60); the trainer process "
    "then died of SIGABRT while exiting, which loses nothing"
  )
  assert supervised(tmp_path, aborts) == 128 + signal.SIGABRT
  assert capfd.readouterr().err.splitlines()[-1] == (
    "python -m train: the trainer process died of SIGABRT; the last checkpoint is step 60; "
    "re-run the same command on every host to resume from it"
  )
  assert supervised(tmp_path, "from train import supervise; supervise.completed()") == 0
  assert capfd.readouterr().err == ""


@pytest.mark.slow  # two processes joining three times: about 40 s
def test_processes_exit_0_however_busy_their_failure_watcher_is(tmp_path):
  """A thread inside a call of JAX's client as the interpreter ends aborts the process
  (SIGABRT after a completed run): the trainer's failure watcher stops before JAX's exit.
  Polling every millisecond, a process aborted in 3 of 4 such runs before that."""
  from tests.cluster import run_processes

  for run in range(3):
    run_processes("multihost_exit_worker.py", 2, 120, out=tmp_path / f"{run}-{{i}}")
    assert [(tmp_path / f"{run}-{i}").read_text() for i in (0, 1)] == ["done", "done"]


@pytest.mark.slow  # one process 40 s late: about 60 s
def test_a_process_40_s_late_to_the_first_collective_is_waited_for(tmp_path):
  """Gloo's set-up, at the first collective across processes, gives up on a process 30 s
  late (as a busy host compiling the model's init was, in 5 of 5 two-process trainer runs
  that failed at load 12); `hosts.together` before it lets the collective start together."""
  from tests.cluster import run_processes

  run_processes("multihost_late_worker.py", 2, 240, out=tmp_path / "{i}")
  assert [(tmp_path / f"{i}").read_text() for i in (0, 1)] == ["0 1", "0 1"]


def test_hosts_whose_storage_chose_different_input_orders_are_told_to_set_the_order(
  digits_dir, storage_rig, tmp_path, monkeypatch
):
  """The same command on a host reading its local disk (the global order) and on one reading
  through a mount (the block order), data at the same path: the refusal names the setting
  that makes them agree, not the command they already share (in this process)."""
  local, mounted = tmp_path / "local", tmp_path / "mounted"
  local.mkdir()
  (local / "data").symlink_to(digits_dir)
  sent = []
  with storage_rig.mount(digits_dir, latency_ms=1, mountpoint=mounted / "data"):
    for host in (local, mounted):
      monkeypatch.chdir(host)
      sent.append(start_fields(digits_dir, tmp_path / "w", **{"input.data_dir": "data"}))
  with pytest.raises(UsageError) as refused:
    hosts.compare(sent)
  line = str(refused.value)
  assert line.startswith("processes disagree on order: process 0 has global;"), line
  assert ", process 1 blocks of " in line and line.endswith(
    "set --config.input.order=blocks (or global) on every host"
  )
