"""What a process that ended on a fault must not leave behind: processes it started, files
held open on a mount (which keep the mount busy: it is then only detached, not unmounted).
For the fault tests (tests/faults/, the stalled mounts): each checks what applies where it
ends its process. (Shared memory is not checked here: its names are random, so a segment
another test running beside it (xdist) orphaned cannot be told from this test's.)"""

from __future__ import annotations

import contextlib
import os
import pathlib
import time
from collections.abc import Iterator

SETTLE_S = 30


def descendants(pid: int) -> list[int]:
  """Processes started by `pid`, which was started in a session of its own (left alive after
  it, their parent is init: found by the session they share with it)."""
  out = []
  for entry in pathlib.Path("/proc").iterdir():
    try:
      if entry.name.isdigit() and int(entry.name) != pid and os.getsid(int(entry.name)) == pid:
        out.append(int(entry.name))
    except (OSError, ValueError):
      pass
  return out


def outlived(pid: int) -> list[int]:
  """`descendants(pid)` still alive after it ended, given `SETTLE_S` to go (helpers that end
  with it on their own: a forkserver, a resource tracker)."""
  deadline = time.monotonic() + SETTLE_S
  while (left := descendants(pid)) and time.monotonic() < deadline:
    time.sleep(0.1)
  return left


@contextlib.contextmanager
def clean_mount(mounting) -> Iterator:
  """The rig's mount `mounting` (`storage_rig.mount(...)`), entered for the `with` block;
  then checks what the block's processes left: no file held open on the mount (it unmounts,
  not only detaches) once reads abandoned on it while it stalled got their answer (within
  `SETTLE_S`)."""
  with mounting as m:
    yield m
    deadline = time.monotonic() + SETTLE_S  # a hang detector, not a speed target
    while (held := holders(m.path)) and time.monotonic() < deadline:
      time.sleep(0.1)
  assert held == [], f"files on the mount still open {SETTLE_S} s after it answered: {held[:10]}"
  assert not mounted(m.path)


def holders(path: pathlib.Path) -> list[str]:
  """'PID: FILE' for each file a process holds open (or works in) under `path`: /proc's
  links, read without a request to the filesystem (safe on a stalled mount)."""
  inside, out = os.path.realpath(path) + os.sep, []
  for proc in pathlib.Path("/proc").iterdir():
    if not proc.name.isdigit():
      continue
    links = [proc / "cwd"]
    with contextlib.suppress(OSError):
      links += list((proc / "fd").iterdir())
    for link in links:
      with contextlib.suppress(OSError):
        target = os.readlink(link)
        if target.startswith(inside):
          out.append(f"{proc.name}: {target}")
  return out


def mounted(path: pathlib.Path) -> bool:
  """Whether `path` is a mount point now."""
  real = os.path.realpath(path)
  with open("/proc/mounts") as f:
    return any(line.split()[1] == real for line in f)
