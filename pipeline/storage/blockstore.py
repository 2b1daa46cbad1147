"""A host's blocks in shared memory: each block read once for all its worker processes.

In the block order (`pipeline.blocks`) a worker process takes one batch in w, so unless w
divides a window's batches a block's records fall to several workers. `BlockStore` lets
them share one read: the first worker that wants a block claims it (creates NAME.part
exclusively and holds a lock on it), reads it whole in one storage request and publishes it
(renames it to NAME); the others wait for that lock, then take their records from the file
(one pread each: no copy of the block kept in any process). A read that fails is not read
again by those waiting for it: the claimant writes its error into the claimed file before
it lets go, and they raise it (a later take reads the block again). A worker unlinks the blocks it
published, oldest first, past `budget_bytes`; a block wanted after it went is read again
(one more request, the same records). Names hold the dataset's token (`new`, in the main
process, which holds a lock on TOKEN.lock while the store lives): the main process unlinks
the token's files when its store is dropped or at exit, a worker its own blocks at its exit,
and `new` the files of tokens whose main process is gone.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import glob
import multiprocessing.util
import os
import secrets
import struct
import threading
import weakref
from collections.abc import Callable

from pipeline.storage import remote, stalled

SHM_DIR = "/dev/shm"
PREFIX = "pipeline-blocks"
HEAD = 4096  # bytes read first: the header of a block of up to 510 records
IOV = 512  # records per write
FAILED = b"pipeline-blocks failed\n"  # a claimed file's first bytes where its read failed

_STORES: weakref.WeakSet[BlockStore] = weakref.WeakSet()  # those that published blocks here
_MADE: list[weakref.finalize] = []  # each removes a store this process made (`new`)


def available() -> bool:
  """Whether this host has POSIX shared memory as files (Linux)."""
  return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class BlockStore:
  """Blocks keyed (shard, first record), shared by the processes that unpickle it."""

  def __init__(self, token: str, budget_bytes: int):
    self.token, self.budget_bytes = token, budget_bytes
    self._init_runtime()

  @classmethod
  def new(cls, budget_bytes: int) -> BlockStore:
    """A store under a fresh token, whose files this process removes when the store is
    dropped (its dataset with it) or at its exit."""
    sweep_orphaned()
    token = secrets.token_hex(16)
    store = cls(token, budget_bytes)
    _MADE[:] = [made for made in _MADE if made.alive]
    _MADE.append(weakref.finalize(store, _release, token, _claim(_lock_path(token))))
    return store

  def _init_runtime(self):
    self._lock = threading.Lock()
    self._published: collections.OrderedDict[str, int] = collections.OrderedDict()
    self._bytes = 0
    self.published = self.reread = 0  # blocks this process read for all; read again here

  def __getstate__(self):
    return {"token": self.token, "budget_bytes": self.budget_bytes}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def take(self, block: tuple[int, int], wanted: list[int], read: Callable[[], list]) -> list:
    """Records `wanted` (numbers within the block) of `block`: from the store, else from
    `read()` (the block's records, one request), which this process then publishes."""
    name = os.path.join(SHM_DIR, f"{PREFIX}-{self.token}-{block[0]}-{block[1]}")
    got = _pread(name, wanted)
    if got is not None:
      return got
    claim = _claim(name + ".part")
    if claim is None:  # another worker (or thread) reads it: wait for its lock
      failed = _wait(name + ".part")
      got = _pread(name, wanted)
      if got is not None:
        return got
      if failed is not None:
        raise failed
      records = read()  # the block went already
      self.reread += 1
      return [records[i] for i in wanted]
    try:
      got = _pread(name, wanted)  # published between the first look and the claim
      if got is not None:
        _unlink(name + ".part")
        return got
      records = read()
      self._publish(claim, name, records)
    except BaseException as e:
      if isinstance(e, Exception):  # not an interrupt: the read's own error
        _failed(claim, e)
      _unlink(name + ".part")
      raise
    finally:
      os.close(claim)  # releases the lock: the waiting find the block published
    return [records[i] for i in wanted]

  def _publish(self, fd: int, name: str, records: list) -> None:
    offsets = [0]
    for rec in records:
      offsets.append(offsets[-1] + len(rec))
    # the record count, the offsets of the records and of their end, then the records
    header = struct.pack(f"<{len(records) + 2}q", len(records), *offsets)
    try:
      os.pwrite(fd, header, 0)
      for k in range(0, len(records), IOV):
        os.pwritev(fd, records[k : k + IOV], len(header) + offsets[k])
    except OSError:  # /dev/shm full: the records serve this process only
      _unlink(name + ".part")
      return
    os.rename(name + ".part", name)
    with self._lock:
      if self not in _STORES:
        _STORES.add(self)
        _at_worker_exit()
      self._published[name] = offsets[-1]
      self._bytes += offsets[-1]
      self.published += 1
      while self._bytes > self.budget_bytes and len(self._published) > 1:
        old, size = self._published.popitem(last=False)
        self._bytes -= size
        _unlink(old)

  def close(self) -> None:
    """Unlinks the blocks this process published."""
    with self._lock:
      for name in self._published:
        _unlink(name)
      self._published.clear()
      self._bytes = 0


def _pread(name: str, wanted: list[int]) -> list | None:
  """The records `wanted` of a published block, or None if it is not there."""
  try:
    fd = os.open(name, os.O_RDONLY)
  except FileNotFoundError:
    return None
  try:
    head = os.pread(fd, HEAD, 0)
    count = struct.unpack_from("<q", head)[0]
    size = 8 * (count + 2)
    if size > len(head):
      head = os.pread(fd, size, 0)
    offsets = struct.unpack_from(f"<{count + 1}q", head, 8)
    return [os.pread(fd, offsets[i + 1] - offsets[i], size + offsets[i]) for i in wanted]
  finally:
    os.close(fd)


def _claim(path: str) -> int | None:
  """An fd holding the lock on the new file `path`, or None if it exists: made and locked
  under another name, then linked, so no one sees it unlocked."""
  made = f"{path}.{secrets.token_hex(8)}"
  fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.link(made, path)
  except FileExistsError:
    os.close(fd)
    return None
  finally:
    _unlink(made)
  return fd


def _wait(path: str) -> BaseException | None:
  """Until the process that claimed a block (holding the lock on `path`) is done with it;
  the error its read raised, if it failed (`_failed`)."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:  # published (renamed) already
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_SH)
    said = os.pread(fd, HEAD, 0)
  finally:
    os.close(fd)
  if not said.startswith(FAILED):
    return None
  kind, _, message = said[len(FAILED) :].decode(errors="replace").partition("\n")
  if kind == "":
    return OSError(message)
  error = remote.RemoteStorageError(message)
  if kind == "stalled":  # as the claimant's: its read may wait on, and so may this process's
    error.stalled = True
    stalled.mark()
  return error


def _failed(fd: int, error: BaseException) -> None:
  """Writes `error`, in one line, where the claimed file `fd` would hold the block: for those
  waiting on its lock to raise (`_wait`) instead of reading the block again."""
  stall = isinstance(error, remote.RemoteStorageError) and error.stalled
  kind = "stalled" if stall else "remote" if isinstance(error, remote.RemoteStorageError) else ""
  line = (str(error).splitlines() or [type(error).__name__])[0]
  with contextlib.suppress(OSError):
    os.pwrite(fd, FAILED + f"{kind}\n{line}".encode()[: HEAD - len(FAILED)], 0)


def _lock_path(token: str) -> str:
  return os.path.join(SHM_DIR, f"{PREFIX}-{token}.lock")


def _unlink(path: str) -> None:
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass


def remove(token: str) -> None:
  """Unlinks every file of `token`'s store (its lock file last)."""
  for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}-{token}-*")):
    _unlink(path)
  _unlink(_lock_path(token))


def sweep_orphaned() -> None:
  """Removes the stores whose main process is gone (no process holds their lock file)."""
  for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}-*.lock")):
    try:
      fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      continue
    finally:
      os.close(fd)
    remove(os.path.basename(path)[len(PREFIX) + 1 : -len(".lock")])


def close_stores() -> None:
  """Unlinks the blocks this process published (a worker at its exit)."""
  for store in list(_STORES):
    store.close()


def remove_own() -> None:
  """Removes every store this process made (as when they are dropped, or at its exit)."""
  for made in _MADE:
    made()


def _release(token: str, lock: int) -> None:
  remove(token)
  os.close(lock)


atexit.register(close_stores)
stalled.on_leave(close_stores)  # the blocks a worker published
stalled.on_leave(remove_own)  # the stores it made, all their blocks


_finalized = []


def _at_worker_exit() -> None:
  """In a worker process (which may exit through multiprocessing, skipping atexit): unlink
  its blocks at its exit."""
  if not _finalized and multiprocessing.parent_process() is not None:
    _finalized.append(multiprocessing.util.Finalize(None, close_stores, exitpriority=100))
