"""The parent of a trainer process in a multi-process run: says what happened to it.

When a process of the run dies, the JAX distributed service ends the others from one of
its own threads (a fatal log line and exit: nothing the trainer can catch). So with several
processes `python -m train` runs the trainer as its child: it passes the output and the
signals through, and when the service ends the child it prints one line instead of JAX's:
which process was lost, the last saved step and how to resume; unless the child said first,
in its own line, why it ends: that line is then the last. Imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading

ENV = "TRAIN_SUPERVISED"  # set in the child
FATAL = "JAX distributed service detected fatal errors"
OWN = "python -m train: "  # how the trainer's own one-line errors begin
EXIT_GRACE_S = 15  # after the service's verdict, for the child to exit before it is killed


def lost_process(text: str) -> str:
  """Which process the distributed service's error message says was lost."""
  unhealthy = re.search(r"unhealthy \(stopped sending heartbeats\):\s*([\d\s,]+)", text)
  if unhealthy:
    ids = re.findall(r"\d+", unhealthy.group(1))
    return f"process{'es' if len(ids) > 1 else ''} {', '.join(ids)}"
  tasks = sorted(set(re.findall(r"/task:(\d+)", text)))
  if tasks:
    return f"process{'es' if len(tasks) > 1 else ''} {', '.join(tasks)}"
  if "leader task" in text or "coordination service" in text:
    return "process 0 (the coordinator)"
  return "a process"


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


def _die_with_parent() -> None:
  """In the child: SIGKILL when the parent dies (Linux), as its host going down would."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


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


def run(argv: list[str]) -> int:
  """Runs `python -m train ARGV` as a child; returns the exit status to leave with."""
  child = subprocess.Popen(
    [sys.executable, "-m", "train", *argv],
    env={**os.environ, ENV: "1"},
    stderr=subprocess.PIPE,
    start_new_session=True,  # Ctrl-C reaches it once, through this process
    preexec_fn=_die_with_parent,
  )
  for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda signum, _: child.send_signal(signum))
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
  if verdict and said:  # the child named the cause, and then the service its end
    return code if code > 0 else 1
  if verdict:
    print(
      f"python -m train: lost {lost_process(''.join(verdict))} of the run; {where}; "
      "re-run the same command on every host to resume from it",
      file=sys.stderr,
      flush=True,
    )
    return 1
  if code < 0:
    print(
      f"python -m train: the trainer process died of {signal.Signals(-code).name}; {where}; "
      "re-run the same command on every host to resume from it",
      file=sys.stderr,
      flush=True,
    )
    return 128 - code
  return code
