"""What a process that ended on a fault must not leave behind: processes it started, shared
memory of its pipeline in /dev/shm, files held open on a mount (which keep the mount busy:
it is then only detached, not unmounted). For the fault tests (tests/faults/, the stalled
mounts): each checks what applies where it ends its process."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import time
from collections.abc import Iterator

from pipeline.host import shm
from pipeline.storage import blockstore

PREFIXES = (shm.PREFIX, blockstore.PREFIX)  # the names of the pipeline's shared memory
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


def shared_memory() -> set[str]:
  """The pipeline's files in /dev/shm now, every process's (other tests' too)."""
  return {name for name in os.listdir(shm.SHM_DIR) if name.startswith(PREFIXES)}


def _unowned(path: str) -> bool:
  """Whether no process holds the lock that keeps `path` alive (a ring block's own, a block
  store's TOKEN.lock): its owner is gone and nothing will unlink it. A ring block still being
  made (empty, before its lock) is owned."""
  name = os.path.basename(path)
  ring = name.startswith(shm.PREFIX)
  if not os.path.exists(path):  # unlinked meanwhile
    return False
  if not ring:
    token = name[len(blockstore.PREFIX) + 1 :].split("-")[0].removesuffix(".lock")
    path = os.path.join(shm.SHM_DIR, f"{blockstore.PREFIX}-{token}.lock")
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return not ring  # a store without its lock is left; a ring block unlinked meanwhile is gone
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released as it closes
  except BlockingIOError:
    return False
  else:
    return not ring or os.fstat(fd).st_size > 0
  finally:
    os.close(fd)


@contextlib.contextmanager
def clean_mount(mounting) -> Iterator:
  """The rig's mount `mounting` (`storage_rig.mount(...)`), entered for the `with` block;
  then checks what the block's processes left: no file held open on the mount (it unmounts,
  not only detaches) once reads abandoned on it while it stalled got their answer (within
  `SETTLE_S`), and no shared memory of the pipeline whose owner is gone."""
  before = shared_memory()
  with mounting as m:
    yield m
    deadline = time.monotonic() + SETTLE_S  # a hang detector, not a speed target
    while (held := holders(m.path)) and time.monotonic() < deadline:
      time.sleep(0.1)
  assert held == [], f"files on the mount still open {SETTLE_S} s after it answered: {held[:10]}"
  assert not mounted(m.path)
  assert shared_memory_left(before) == []


def shared_memory_left(before: set[str]) -> list[str]:
  """The pipeline's files in /dev/shm made since `before` (`shared_memory()`) whose owner is
  gone (those of other tests still running hold their locks)."""
  new = sorted(shared_memory() - before)
  return [name for name in new if _unowned(os.path.join(shm.SHM_DIR, name))]


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
