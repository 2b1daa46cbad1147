"""The parent of a trainer process in a multi-process run: says what happened to it.

When a process of the run dies, the JAX distributed service ends the others from one of
its own threads (a fatal log line and exit: nothing the trainer can catch). So with several
processes `python -m train` runs the trainer as its child: it passes the output and the
signals through, and when the service ends the child it prints one line instead of JAX's:
which process was lost, the last saved step and how to resume; unless the child said first,
in its own line, why it ends: that line is then the last. A process that was itself stopped
(SIGSTOP, a paused VM) long enough to miss the heartbeats names itself: the others lost it, and
the service's words would blame whoever it reaches first. A run the child says completed
(`completed`) leaves with 0 even if the child's exit then fails. Imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ENV = "TRAIN_SUPERVISED"  # set in the child
DONE = "TRAIN_DONE"  # in the child: the file it writes once the run has completed (`completed`)
FATAL = "JAX distributed service detected fatal errors"
OWN = "python -m train: "  # how the trainer's own one-line errors begin
EXIT_GRACE_S = 15  # after the service's verdict, for the child to exit before it is killed
TICK_S = 1.0  # how often `Stops` looks
HEARTBEAT_S = 60  # --heartbeat_timeout's default (train/__main__.py)


def lost_ids(text: str) -> list[str]:
  """The process ids the distributed service's error message names as lost (none: it names
  no id, as when the coordinator is gone)."""
  unhealthy = re.search(r"unhealthy \(stopped sending heartbeats\):\s*([\d\s,]+)", text)
  if unhealthy:
    return re.findall(r"\d+", unhealthy.group(1))
  return sorted(set(re.findall(r"/task:(\d+)", text)))


def lost_process(text: str) -> str:
  """Which process the distributed service's error message says was lost."""
  ids = lost_ids(text)
  if ids:
    return f"process{'es' if len(ids) > 1 else ''} {', '.join(ids)}"
  if "leader task" in text or "coordination service" in text:
    return "process 0 (the coordinator)"
  return "a process"


def verdict_line(verdict: str, me: str | None, stopped_s: float, heartbeat: int) -> str:
  """What the service's `verdict` ended this process (`me`, stopped `stopped_s` at longest) for:
  its own stop, if the verdict names it or the stop could miss the heartbeats (sent every
  `heartbeat`/2 s; it then wakes to the coordinator gone), else the process the verdict names."""
  ids = lost_ids(verdict)
  missed = stopped_s >= heartbeat / 2 - 2 * TICK_S
  if stopped_s >= heartbeat or me in ids or (not ids and missed):
    past = f"past --heartbeat_timeout={heartbeat}, so the run lost it"
    if stopped_s >= 2 * TICK_S:
      return f"this process ({me}) was stopped for {stopped_s:.0f} s: no heartbeat {past}"
    return f"the distributed service heard no heartbeat from this process ({me}) {past}"
  return f"lost {lost_process(verdict)} of the run"


def flag(argv: list[str], name: str) -> str | None:
  """The value of `--name VALUE` or `--name=VALUE` in `argv` (the last one, as absl takes)."""
  value = None
  for i, arg in enumerate(argv):
    if arg == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
  return value


def last_saved_step(workdir: str | None) -> str:
  if not workdir:
    return "no checkpoint"
  from etils import epath

  try:
    steps = [
      int(p.name) for p in (epath.Path(workdir) / "checkpoints").iterdir() if p.name.isdigit()
    ]
  except OSError:
    steps = []
  return f"the last checkpoint is step {max(steps)}" if steps else "no checkpoint was saved yet"


class Stops:
  """The longest time this process or its child `pid` was stopped (SIGSTOP, a paused VM): a
  tick that comes late, or that finds the child stopped, counts."""

  def __init__(self, pid: int):
    self.pid, self._longest, self._last = pid, 0.0, time.monotonic()
    threading.Thread(target=self._watch, daemon=True, name="train-stops").start()

  @property
  def longest(self) -> float:
    """Seconds; a stop this process just woke from counts before the next tick."""
    return max(self._longest, time.monotonic() - self._last)

  def _watch(self) -> None:
    begun = None  # when the child's current stop began
    while True:
      time.sleep(TICK_S)
      now = time.monotonic()
      if now - self._last > 2 * TICK_S:  # this process was stopped between the ticks
        self._longest = max(self._longest, now - self._last)
      self._last = now
      if self._child_stopped():
        begun = begun or now - TICK_S
        self._longest = max(self._longest, now - begun)
      else:
        begun = None

  def _child_stopped(self) -> bool:
    try:
      with open(f"/proc/{self.pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
      return False


def _die_with_parent() -> None:
  """In the child: SIGKILL when the parent dies (Linux), as its host going down would."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def completed() -> None:
  """In the child: tells the parent that the run completed (summary and final checkpoint
  written), so an exit that fails after it (JAX's shutdown aborting) loses nothing."""
  if os.environ.get(DONE):
    with open(os.environ[DONE], "w") as f:
      f.write("done")


def end_line(code: int, done: bool, where: str) -> tuple[int, str | None]:
  """The exit status and last line for a child that ended with `code` (no verdict of the
  service): a run that `done` leaves with 0 whatever its exit, a signal otherwise is named."""
  died = f"died of {signal.Signals(-code).name}" if code < 0 else f"failed with status {code}"
  if done and code != 0:
    return 0, (
      f"python -m train: the run completed ({where}); the trainer process then {died} while "
      "exiting, which loses nothing"
    )
  if done or code >= 0:
    return code, None
  return 128 - code, (
    f"python -m train: the trainer process {died}; {where}; re-run the same command on every "
    "host to resume from it"
  )


def wanted(argv: list[str]) -> bool:
  """Whether `python -m train ARGV` runs as one of several processes (and not as the child)."""
  if os.environ.get(ENV):
    return False
  multihost = flag(argv, "multihost")
  if "--multihost" in argv or (multihost or "").lower() in ("true", "1"):
    return True
  if "--nomultihost" in argv or (multihost or "").lower() in ("false", "0"):
    return False
  count = flag(argv, "num_processes")
  return (
    (count.isdigit() and int(count) > 1)
    if count
    else "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
  )


def run(argv: list[str], command: list[str] | None = None) -> int:
  """Runs `python -m train ARGV` (or `command`) as a child; returns the exit status to leave
  with."""
  done = tempfile.NamedTemporaryFile(prefix="train-done-", delete=False)
  done.close()
  try:
    return _supervise(argv, command or [sys.executable, "-m", "train", *argv], done.name)
  finally:
    os.unlink(done.name)


def _supervise(argv: list[str], command: list[str], done: str) -> int:
  child = subprocess.Popen(
    command,
    env={**os.environ, ENV: "1", DONE: done},
    stderr=subprocess.PIPE,
    start_new_session=True,  # Ctrl-C reaches it once, through this process
    preexec_fn=_die_with_parent,
  )
  for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda signum, _: child.send_signal(signum))
  stops = Stops(child.pid)
  verdict, said = [], False  # said: the trainer's own last line was passed through
  for raw in child.stderr:
    line = raw.decode(errors="replace")
    if FATAL in line or verdict:  # the service's verdict and what follows it: one line below
      if not verdict:
        timer = threading.Timer(EXIT_GRACE_S, child.kill)
        timer.daemon = True
        timer.start()
      verdict.append(line)
      continue
    if said:  # what JAX logs about the end the trainer has already explained
      continue
    said = line.startswith(OWN)
    sys.stderr.write(line)
    sys.stderr.flush()
  code = child.wait()
  where = last_saved_step(flag(argv, "workdir"))
  finished = os.path.getsize(done) > 0
  if verdict and said and not finished:  # the child named the cause, and then the service its end
    return code if code > 0 else 1
  heartbeat = int(flag(argv, "heartbeat_timeout") or HEARTBEAT_S)
  if verdict and not finished:
    line = verdict_line("".join(verdict), flag(argv, "process_id"), stops.longest, heartbeat)
    print(
      f"python -m train: {line}; {where}; re-run the same command on every host to resume from it",
      file=sys.stderr,
      flush=True,
    )
    return 1
  status, line = end_line(code, finished, where)
  if line:
    print(line, file=sys.stderr, flush=True)
  return status
