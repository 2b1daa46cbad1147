"""Where shards live: one `Backend` per kind of path, found by `of(path)`, and the pins that
keep a reader on the shards it checked.

A local path is `LOCAL`, or `MOUNT` on a FUSE mount (gcsfuse, the rig's; found in
/proc/self/mountinfo), whose reads may never return; a URL is the backend of its scheme
(`SCHEMES`: gs:// is `pipeline.storage.gcs`; a new scheme is a module and a line there). The
shards themselves are opened and read by array_record (local paths and gs://); a backend says
how a read Python makes waits (`guard`), how a read stage's request does (`request`), a file's
size and pin from one stat or metadata request (`look`), and whether reads pay a bucket's
latency (`remote`). `pin` and `check_pinned` refuse a shard replaced after it was checked (a
`convert --overwrite`, an object written again); `cache_key` ties record cache entries to it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Protocol, TypeVar

from pipeline.storage import gcs, remote

T = TypeVar("T")
FILENAME = "manifest.json"  # what makes a folder a dataset: the file `check` probes
DEADLINE = "performance.read_deadline_s"  # the setting of a mount's wait


class Backend(Protocol):
  """How the files at one kind of path are reached (see the module's docstring)."""

  scheme: str | None  # None: a path of this host's file system
  remote: bool  # reads pay a bucket's latency: the block order by default

  def check(self, data_dir, probe: str | None) -> None:
    """Raises `remote.RemoteStorageError` (one line) if this host cannot read `data_dir`;
    `probe`: a file in it to stat once, so that missing access is said at once."""

  def guard(self, fn: Callable[[], T], path, deadline_s: float | None = None) -> T:
    """`fn()`, a read of `path` Python makes (a manifest, a stat, the first records)."""

  def request(self, fn: Callable[[], T], wait_s: float) -> T:
    """`fn()`, a shard read of the read stage, which waits for it at most `wait_s`."""

  def size(self, path, deadline_s: float | None = None) -> int | None:
    """The size of a regular file, None if `path` is something else; never opens it."""

  def look(self, path, deadline_s: float | None = None) -> tuple:
    """(size, pin, crc32c) from one stat or metadata request, never a read: size None if not
    a regular file; pin (`pin`) and crc32c (8 hex digits) None where not known."""


class Local:
  """A path of this host's file system: read as it is; pinned as (device, inode, size,
  mtime)."""

  scheme = None
  remote = False

  def check(self, data_dir, probe: str | None) -> None:
    return None

  def guard(self, fn: Callable[[], T], path, deadline_s: float | None = None) -> T:
    return fn()

  def request(self, fn: Callable[[], T], wait_s: float) -> T:
    return fn()  # a stalled syscall cannot be interrupted: the read stage watches its silence

  def size(self, path, deadline_s: float | None = None) -> int | None:
    st = self.guard(lambda: os.stat(path), path, deadline_s)
    return st.st_size if stat.S_ISREG(st.st_mode) else None

  def look(self, path, deadline_s: float | None = None) -> tuple:
    st = self.guard(lambda: os.stat(path), path, deadline_s)
    if not stat.S_ISREG(st.st_mode):
      return None, None, None
    return st.st_size, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), None


class Mount(Local):
  """A path on a FUSE mount: each read Python makes waits at most its deadline (None:
  `remote.ATTEMPT_S` x `remote.ATTEMPTS`), then `remote.no_answer` naming `DEADLINE`."""

  remote = True

  def guard(self, fn: Callable[[], T], path, deadline_s: float | None = None) -> T:
    deadline_s = deadline_s or remote.ATTEMPT_S * remote.ATTEMPTS
    try:
      return remote.within(fn, deadline_s)
    except remote.NoAnswer:
      raise remote.no_answer(path, deadline_s, DEADLINE) from None


LOCAL, MOUNT = Local(), Mount()
SCHEMES: dict[str, Backend] = {"gs": gcs.Gcs()}


def _on_fuse(path) -> bool:
  """Whether local `path` is on a FUSE mount, per /proc/self/mountinfo (absent off Linux:
  then never)."""
  try:
    with open("/proc/self/mountinfo") as f:
      mounts = [line.split(" - ") for line in f]
  except OSError:
    return False

  def fuse(path: str) -> bool:
    best, fstype = "", ""
    for head, tail in (m for m in mounts if len(m) == 2):
      point = head.split()[4].replace("\\040", " ")
      inside = path == point or path.startswith(point.rstrip("/") + "/")
      if inside and len(point) >= len(best):
        best, fstype = point, tail.split()[0]
    return fstype.startswith("fuse")

  return fuse(os.path.abspath(path)) or _lands_on(os.path.abspath(path), fuse)


def _lands_on(path: str, fuse: Callable[[str], bool]) -> bool:
  """Whether absolute `path`, its links followed (as `os.path.realpath`), lands where `fuse`
  holds; a name is looked up only outside such a mount, which may not answer (a stalled
  mount holds every lookup and stat without a deadline)."""
  todo, real, links = path.split("/")[::-1], "/", 0
  while todo:
    name = todo.pop()
    if name in ("", "."):
      continue
    if name == "..":
      real = os.path.dirname(real)
      continue
    step = os.path.join(real, name)
    if fuse(step):
      return True
    try:
      st = os.lstat(step)
    except OSError:  # missing or unreadable: the rest as written
      return fuse(os.path.normpath(os.path.join(step, *todo[::-1])))
    if not stat.S_ISLNK(st.st_mode):
      real = step
      continue
    links += 1
    if links > 40:  # a loop: not a path to read
      return False
    target = os.readlink(step)
    real = "/" if target.startswith("/") else real
    todo += target.split("/")[::-1]
  return fuse(real)


def of(path) -> Backend:
  """The backend of `path`; a scheme without one is `remote.RemoteStorageError`, one line."""
  kind = remote.scheme(path)
  if kind is None:
    return MOUNT if _on_fuse(path) else LOCAL
  if kind not in SCHEMES:
    raise remote.RemoteStorageError(
      f"cannot read {path}: shards are read by array_record, which opens local paths "
      f"and gs:// only; mount the {kind}:// storage and pass the mount path"
    )
  return SCHEMES[kind]


def check(data_dir, probe: bool = True) -> None:
  """Raises `remote.RemoteStorageError` (one line) if this host cannot read `data_dir` as it
  is set up (a local path passes without a look); `probe`: stat its manifest.json once, so
  that missing credentials or network are named here (a missing manifest is left to
  `pipeline.catalog.manifest.load`, which says how to make one)."""
  of(data_dir).check(data_dir, FILENAME if probe else None)


def look(path, deadline_s: float | None = None) -> tuple:
  """`Backend.look` of `path`'s backend: (size, pin, crc32c)."""
  return of(path).look(path, deadline_s)


class ShardReplacedError(OSError):
  """A shard that is not the file its reader pinned when the dataset was opened."""


def pin(path) -> tuple | None:
  """What identifies the shard at `path` now, without reading it: local files (device, inode,
  size, mtime), one stat; gs:// objects ("gs", generation, size), one metadata request; None
  where neither is known (gs:// without gcsfs)."""
  return look(path)[1]


def cache_key(pinned: tuple | None) -> str:
  """The part of a pin that names the shard's content across restarts and remounts (not the
  inode, which gcsfuse numbers anew per mount): what record cache entries are tied to. An
  object's pin starts with its scheme and its generation."""
  if pinned is None:
    return "unpinned"
  return f"{pinned[0]}:{pinned[1]}" if isinstance(pinned[0], str) else f"{pinned[2]}:{pinned[3]}"


def check_pinned(path, pinned: tuple | None) -> None:
  """Refuses a shard that is no longer the file pinned when the dataset was opened.

  Call it just after opening the shard: files are replaced by rename (objects by a new
  generation), so if the path is still the pinned one then, the reader opened the pinned file.
  Raises `ShardReplacedError` (an OSError, as readers report a file that went away).
  """
  if pinned is None:
    return
  try:
    now = pin(path)
  except FileNotFoundError:
    now = None
  if now != tuple(pinned):
    raise ShardReplacedError(
      f"shard {path} was replaced after this dataset was opened (a conversion with "
      "--overwrite, an object written again?): open the dataset again to read the new one"
    )
