"""Several processes (the hosts of a pod slice) running one training job.

`initialize` joins them (`jax.distributed`, each saying whom it waits for: `train.join`);
`agree` checks, before the first step, that every process is about to train the same thing,
and refuses on every host in one line naming the first field that differs (settings that
change no batch may differ: it lists them); `shared_workdir` checks that all of them see one
workdir. Both talk through the distributed service's key-value store, not through device
collectives, so a process that failed to set up is reported by the others instead of leaving
them blocked in a collective, and so does `report_failure`, which names a process's error to
all. A lost process is reported by `train.supervise`.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time

import jax
from etils import epath
from jax._src import clusters, distributed

from train import UsageError, join

START_TIMEOUT_S = 60  # for every process to reach the start check
TOGETHER_TIMEOUT_S = 900  # for every process to reach a `together` point (a stuck one is lost)
POLL_S = 1.0  # how often a process checks whether another reported an error
REPORT_S = 10  # for the others to read a failing process's cause before it exits
JOIN_GRACE_S = 10  # JAX's own join timeout is this much later: `train.join` names who is missing
TOKEN = "processes.token"  # written by process 0 into the workdir, read by the others
ORDER_FIX = (  # an input order (global or blocks) that differs with the same config
  "config.input.order unset, each host chose it from its own storage (global on a local "
  "disk, blocks on a mount or bucket): set --config.input.order=blocks (or global) on every host"
)
_heartbeat_s = 0  # as given to `initialize`


def initialize(
  coordinator: str | None,
  num_processes: int | None,
  process_id: int | None,
  heartbeat_s: int,
  join_timeout_s: int,
) -> None:
  """`jax.distributed.initialize`: with a coordinator, count and id when given (any cluster,
  or processes on one machine), else JAX's own detection (TPU pod slice, Slurm, ...). A
  process that stops sending heartbeats for `heartbeat_s` is declared lost.

  While joining, says whom it waits for, and names those that never joined within
  `join_timeout_s`, or a SIGTERM (`train.join`). Then watches for other processes' errors
  (`report_failure`)."""
  global _heartbeat_s
  _heartbeat_s = heartbeat_s
  devices = None
  if None in (coordinator, num_processes, process_id):
    coordinator, num_processes, process_id, devices = (
      clusters.ClusterEnv.auto_detect_unset_distributed_params(
        coordinator, num_processes, process_id, None, None, join_timeout_s
      )
    )
  if None in (coordinator, num_processes, process_id):
    raise ValueError("JAX detected no cluster here")
  busy = port_in_use(coordinator) if process_id == 0 else None
  roll = join.RollCall(coordinator, num_processes, process_id)
  if busy is not None:  # told to the others through the roll call, then refused here
    try:
      join.refuse(roll, busy, join_timeout_s)
    finally:
      roll.close()
    raise UsageError(busy)
  preemption = distributed._ENABLE_PREEMPTION_SERVICE.value
  jax.config.update("jax_enable_preemption_service", False)  # it takes SIGTERM: once joined
  previous = signal.signal(signal.SIGTERM, lambda signum, _: roll.stopped(signum))
  try:
    join.wait(
      lambda: jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        devices,
        initialization_timeout=join_timeout_s + JOIN_GRACE_S,
        heartbeat_timeout_seconds=heartbeat_s,
        shutdown_timeout_seconds=heartbeat_s,
      ),
      roll,
      join_timeout_s,
    )
  finally:
    roll.close()
    signal.signal(signal.SIGTERM, previous)
    jax.config.update("jax_enable_preemption_service", preemption)
  distributed.global_state.initialize_preemption_sync_manager()
  watcher = threading.Thread(target=_watch_failures, daemon=True, name="train-failures")
  watcher.start()
  atexit.register(_stop_watching, watcher)  # runs before JAX's own exit handler (registered first)


def _stop_watching(watcher: threading.Thread) -> None:
  """Ends `_watch_failures` before the process exits: a thread inside a call of JAX's client
  as the interpreter finalizes aborts the process (SIGABRT, after a completed run)."""
  _stopping.set()
  watcher.join(timeout=2 * POLL_S)


def port_in_use(coordinator: str) -> str | None:
  """Why process 0 cannot serve at `coordinator` (HOST:PORT), or None: a port something
  already listens on, where JAX's service would fail to bind and crash the process (SIGSEGV).
  Tried as JAX binds it, on every address ([::], else 0.0.0.0)."""
  host, _, port = coordinator.rpartition(":")
  for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
    try:
      probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 here
      continue
    with probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not fooled by TIME_WAIT
      try:
        probe.bind((address, int(port)))
      except OSError as e:
        if e.errno != errno.EADDRINUSE:
          continue
        return (
          f"the coordinator's port {port} is in use on process 0's host ({host}), so JAX's "
          "service cannot listen there: stop what holds it, or give every host another port "
          "in --coordinator_address"
        )
      return None
  return None


def leave_together() -> None:
  """Ends the distributed service now, with every process (they all just refused the same
  usage error): its shutdown barrier then meets them at the same point, before any tears its
  pipeline down. Left to exit, one was aborted after its line in a loaded CI run (SIGABRT;
  read as the service gone with process 0 first, not confirmed)."""
  if distributed.global_state.client is not None:
    try:
      jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - a process already gone: exit as before
      pass


def _say(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _client():
  return distributed.global_state.client


def together(name: str) -> None:
  """Waits, through the distributed service, until every process has reached `name`: the
  first collective after it sets up Gloo, which gives up on a process 30 s late (JAX 0.10
  sets no longer), as a busy host compiling the model's init can be. A process that reports
  its error ends this one meanwhile (`_watch_failures`)."""
  if jax.process_count() > 1:
    _client().wait_at_barrier(f"train/{name}", TOGETHER_TIMEOUT_S * 1000)


def _gather(name: str, value: str) -> list[str]:
  """Every process's `value` for `name`, in process order (process 0 first)."""
  _client().key_value_set(f"train/{name}/{jax.process_index()}", value)
  return [_wait_for(f"train/{name}/{i}", i) for i in range(jax.process_count())]


def _wait_for(key: str, process: int) -> str:
  try:
    return _client().blocking_key_value_get(key, START_TIMEOUT_S * 1000)
  except Exception as e:  # noqa: BLE001 - jaxlib's error type for a timeout is not public
    raise UsageError(
      f"process {process} did not reach the start check within {START_TIMEOUT_S} s; start "
      f"the same command on every host ({' '.join(str(e).split())[:120]})"
    ) from None


def shared_workdir(workdir: epath.Path) -> str:
  """A token process 0 writes into `workdir`, as this process reads it back ('' when it
  cannot): equal on every process exactly when they share the folder."""
  path = workdir / TOKEN
  if jax.process_index() == 0:
    try:
      path.write_text(secrets.token_hex(16))
    finally:  # the others wait for this, written or not (process 0 reports its own error)
      _client().key_value_set("train/token_written", "1")
  else:
    _wait_for("train/token_written", 0)
  try:
    return path.read_text().strip()
  except OSError:
    return ""


def _kind(order: str) -> str:
  """The kind of an input order field, global or blocks (`train.agreement.input_order`)."""
  return order.split(";")[0].split()[0]


def _show(value: str) -> str:
  return value if len(value) <= 60 else value[:57] + "..."


def agree(fields: dict[str, str], error: str | None, own: dict[str, str]) -> list[str]:
  """Raises `UsageError` on every process unless all set up (`error` is None everywhere)
  and all have the same `fields` (name -> value, in the order to check them). `own` (name ->
  value) may differ per process: returns a line for each that does, with every value."""
  if jax.process_count() == 1:
    if error:
      raise UsageError(error)
    return []
  mine = json.dumps({"error": error, "fields": list(fields.items()), "own": own})
  everyone = [json.loads(s) for s in _gather("start", mine)]
  if error:
    raise UsageError(error)
  return compare(everyone)


def compare(everyone: list[dict]) -> list[str]:
  """`agree` on what every process sent (process order): each a dict of "error", "fields"
  (a list of name, value pairs) and "own"."""
  failed = [(i, p["error"]) for i, p in enumerate(everyone) if p["error"]]
  if failed:
    raise UsageError(f"process {failed[0][0]} cannot start: {failed[0][1]}")
  reference = dict(everyone[0]["fields"])
  for name, value in everyone[0]["fields"]:
    differ = [i for i, p in enumerate(everyone) if dict(p["fields"]).get(name) != value]
    if not differ:
      continue
    who = f"process{'es' if len(differ) > 1 else ''} {', '.join(map(str, differ))}"
    if name == "workdir":
      raise UsageError(
        f"the workdir is not shared: {who} cannot read the {TOKEN} process 0 "
        "wrote into it; put --workdir on a bucket (gs://...) or a disk every host mounts"
      )
    theirs = dict(everyone[differ[0]]["fields"]).get(name, "(missing)")
    fix = "start every host with the same command, config and data"
    if (name == "order" or name.startswith("eval order")) and _kind(theirs) != _kind(value):
      fix = ORDER_FIX
    raise UsageError(
      f"processes disagree on {name}: process 0 has {_show(reference[name])}, {who} "
      f"{_show(theirs)}; {fix}"
    )
  extra = {n for p in everyone for n, _ in p["fields"]} - set(reference)
  if extra:
    raise UsageError(f"processes disagree on {sorted(extra)[0]}: process 0 lacks it")
  return [
    f"{name} differs per host: "
    + ", ".join(f"process {i} {p['own'].get(name)}" for i, p in enumerate(everyone))
    for name in everyone[0]["own"]
    if len({p["own"].get(name) for p in everyone}) > 1
  ]


def lost_peer(error: BaseException) -> bool:
  """Whether `error` may be a collective that failed because another process died (not
  this process's own error, such as running out of device memory)."""
  return (
    jax.process_count() > 1
    and (isinstance(error, jax.errors.JaxRuntimeError) or "Gloo" in str(error))
    and not str(error).startswith("RESOURCE_EXHAUSTED")
  )


def await_verdict(error: BaseException) -> None:
  """Waits for the distributed service to declare which process was lost (it then ends
  this one, and `train.supervise` says so), or for a process to report its error (then
  `_watch_failures` ends this one); re-raises `error` if neither comes."""
  _say(
    f"process {jax.process_index()}: a collective failed ({' '.join(str(error).split())[:160]}); "
    f"waiting up to {_heartbeat_s} s for the distributed service to name the lost process"
  )
  time.sleep(_heartbeat_s + 30)
  raise error


_stopping = threading.Event()  # set as the process exits: `_watch_failures` returns
_failing = False  # this process reported its own error: it no longer ends for others'


def report_failure(line: str) -> None:
  """Tells the other processes this process's error (`line`, which they print), and waits
  up to `REPORT_S` for them to have read it (or to have failed too): when process 0 exits,
  the service goes with it."""
  global _failing
  _failing = True
  client, me = _client(), jax.process_index()
  waiting = set(range(jax.process_count())) - {me}
  deadline = time.monotonic() + REPORT_S
  try:
    client.key_value_set(f"train/failed/{me}", line)
    while waiting and time.monotonic() < deadline:
      time.sleep(0.1)
      answers = client.key_value_dir_get(f"train/read/{me}/")
      for key, _ in answers + client.key_value_dir_get("train/failed/"):
        waiting.discard(int(key.rsplit("/", 1)[1]))
  except Exception:  # noqa: BLE001 - gone or late: their supervisor names this process
    pass


def _watch_failures() -> None:
  """Ends this process with the line another process reported as its error."""
  client, me, read = _client(), jax.process_index(), set()
  while not _stopping.wait(POLL_S):
    try:
      reports = client.key_value_dir_get("train/failed/")
    except Exception:  # noqa: BLE001 - the service is gone: the supervisor says so
      return
    for key, line in reports:
      process = int(key.rsplit("/", 1)[1])
      if process == me or process in read:
        continue
      read.add(process)
      if not _failing:  # one that failed itself says its own error last
        _say(line)
      try:
        client.key_value_set(f"train/read/{process}/{me}", "1")
      except Exception:  # noqa: BLE001 - the service is gone with that process
        pass
      if not _failing:
        os._exit(1)
