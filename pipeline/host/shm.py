"""Shared memory as files in /dev/shm for batches that cross from worker processes: a worker's
`Ring` of reused blocks, the main process's `Reader` of them, and sweeps of blocks left behind.

A block's header holds its state (FREE -> TAKEN by the worker -> SENT -> FREE when the main
process drops it) and a generation the main process checks against the sender's. Nothing is
left in /dev/shm: a name is unlinked as soon as the main process maps it; blocks never received
are unlinked by their worker at exit, by the main process when its iterator closes (for workers
that are gone) and at exit, and after a crash by the next process that makes a ring. Names hold
random tokens, not process ids, and a block's worker holds a lock on it (flock) while it lives:
so a sweep, even from another PID namespace sharing /dev/shm (containers), removes only blocks
whose worker is gone. A block's memory is allocated when it is made (fallocate): a full
/dev/shm is an error naming the fix, never a SIGBUS later; `check` says at start when /dev/shm
is too small for the rings at all. Kept apart from the stage that uses it (`stages.handoff`),
as Grain keeps its `shared_memory_array` apart from its prefetch node.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import fcntl
import glob
import mmap
import os
import secrets
import threading

import numpy as np

SHM_DIR = "/dev/shm"
PREFIX = "pipeline-ring"
HEADER = 64  # bytes before a block's data: state and generation (uint32 each)
ROUND = 1 << 20  # block capacities are whole MiB, so a slightly larger batch reuses them
FREE, TAKEN, SENT = 0, 1, 2


class HandoffError(RuntimeError):
  """A batch's shared memory was not what its sender said, or could not be had."""


def available() -> bool:
  """Whether this host has POSIX shared memory as files (Linux)."""
  return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def needed(workers: int, batch_bytes: int, prefetch: int, held: int) -> int:
  """Bytes of /dev/shm the rings of `workers` take: each holds its prefetch and `held`
  batches more (parallelism.WORKER_BATCHES), in blocks of whole MiB."""
  block = HEADER + max(ROUND, -(-batch_bytes // ROUND) * ROUND)
  return workers * (prefetch + held) * block


def check(workers: int, needed: int) -> str | None:
  """Why /dev/shm cannot hold `needed` bytes for `workers` (words naming the fix), or None."""
  st = os.statvfs(SHM_DIR)
  free = st.f_bavail * st.f_frsize
  if free >= needed:
    return None
  return (
    f"{SHM_DIR} has {free / 2**20:,.0f} MiB free, {workers} worker processes' batches need "
    f"~{needed / 2**20:,.0f} MiB; docker run --shm-size=1g to use them"
  )


class _Block:
  """One shared-memory file, mapped once: a header and `capacity` bytes of data. The worker
  that makes it holds a lock on it until it unlinks it or exits (see `sweep_crashed`)."""

  def __init__(self, name: str, capacity: int = 0):
    path = os.path.join(SHM_DIR, name)
    create = capacity > 0
    self.fd = None
    try:
      fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    except FileNotFoundError:
      raise HandoffError(
        f"shared-memory block {path} is gone before this process read it: something else "
        f"deleted it (a cleanup of {SHM_DIR}, or an older version of this library in "
        "another container sharing it); the batch is lost"
      ) from None
    try:
      if create:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
          os.posix_fallocate(fd, 0, HEADER + capacity)
        except OSError as e:
          os.unlink(path)
          if e.errno != errno.ENOSPC:
            raise
          raise HandoffError(
            f"{SHM_DIR} is full: no room for a {capacity / 2**20:.0f} MiB batch of a worker "
            "process; give it more (docker run --shm-size=1g) or use fewer workers "
            "(performance.num_workers)"
          ) from None
      self.map = mmap.mmap(fd, os.fstat(fd).st_size)
    except BaseException:
      os.close(fd)
      raise
    if create:
      self.fd = fd  # the lock lives as long as the fd
    else:
      os.close(fd)
    self.name, self.path = name, path
    self.words = np.frombuffer(self.map, np.uint32, 2)  # state, generation
    self.data = np.frombuffer(self.map, np.uint8, offset=HEADER)
    self.capacity = len(self.data)
    self.address = self.data.ctypes.data

  def unlink(self) -> None:
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    if self.fd is not None:
      os.close(self.fd)
      self.fd = None


# ---------------------------------------------------------------- worker side


class _WorkerLease:
  """Owns a TAKEN block's data in the worker; a block dropped before it was sent (work
  discarded on set_state) goes back to the ring."""

  def __init__(self, ring: Ring, block: _Block, nbytes: int):
    self.ring, self.block = ring, block
    self.__array_interface__ = {
      "shape": (nbytes,),
      "typestr": "|u1",
      "data": (block.address, False),
      "version": 3,
    }

  def __del__(self):
    self.ring.release_unsent(self.block)


class Ring:
  """One worker process's blocks for one dataset (`Writer`); made on first use."""

  def __init__(self, token: str):
    self.prefix = f"{PREFIX}-{token}-{secrets.token_hex(8)}-"
    self.blocks: list[_Block] = []
    self.created = 0
    self._lock = threading.Lock()
    atexit.register(self.close)

  def empty(self, shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array in a block of its own, taken from the ring."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    block = self._take(nbytes)
    base = np.asarray(_WorkerLease(self, block, nbytes))
    return base.view(dtype).reshape(shape)

  def _take(self, nbytes: int) -> _Block:
    with self._lock:
      for block in self.blocks:
        if block.words[0] == FREE and block.capacity >= nbytes:
          break
      else:
        capacity = max(ROUND, -(-nbytes // ROUND) * ROUND)
        block = _Block(f"{self.prefix}{self.created}", capacity)
        self.created += 1
        self.blocks.append(block)
      block.words[1] += 1
      block.words[0] = TAKEN
      return block

  def release_unsent(self, block: _Block) -> None:
    with self._lock:
      if block.words[0] == TAKEN:
        block.words[0] = FREE

  def find(self, array: np.ndarray) -> _Block | None:
    """The TAKEN block holding `array` whole, if any."""
    base = array
    while base is not None and not isinstance(base, _WorkerLease):
      base = getattr(base, "base", None)
    return base.block if base is not None and array.flags.c_contiguous else None

  def send(self, array: np.ndarray) -> tuple[str, int, int]:
    """(block name, generation, offset) of `array` in a block now SENT; an array made outside
    the ring (your ops' output) is copied into one first: the one copy."""
    block = self.find(array)
    if block is None:
      copy = self.empty(array.shape, array.dtype)
      copy[...] = array
      array, block = copy, self.find(copy)
    generation = int(block.words[1])
    block.words[0] = SENT
    return block.name, generation, array.ctypes.data - block.address

  def abandon_sent(self) -> None:
    """After set_state: batches sent but not received are discarded by Grain unread, so
    their blocks would stay SENT forever; drop them from the ring (the main process keeps
    its own mapping of any it did receive)."""
    with self._lock:
      sent = [b for b in self.blocks if b.words[0] == SENT]
      self.blocks = [b for b in self.blocks if b.words[0] != SENT]
    for block in sent:
      block.unlink()

  def close(self) -> None:
    """Unlinks every block of the ring, one being made meanwhile included (the lock)."""
    with self._lock:
      for block in self.blocks:
        block.unlink()
      for path in glob.glob(os.path.join(SHM_DIR, glob.escape(self.prefix) + "*")):
        _unlink(path)


_RINGS: dict[str, Ring] = {}
_RINGS_LOCK = threading.Lock()
_TOKENS: set[str] = set()  # of the writers this process made (swept at its exit)


@dataclasses.dataclass(frozen=True)
class Writer:
  """Picklable handle of the rings of one dataset: each worker process makes its own. The
  token (128 random bits) names its blocks: no other process can guess or reuse them."""

  token: str

  @classmethod
  def new(cls) -> Writer:
    sweep_crashed()
    writer = cls(secrets.token_hex(16))
    _TOKENS.add(writer.token)
    return writer

  def ring(self) -> Ring:
    ring = _RINGS.get(self.token)
    if ring is None:
      with _RINGS_LOCK:
        ring = _RINGS.setdefault(self.token, Ring(self.token))
    return ring

  def empty(self, shape: tuple, dtype) -> np.ndarray:
    return self.ring().empty(shape, dtype)


# ---------------------------------------------------------------- main process side


class _Lease:
  """Owns a received block's data in the main process: every array of the batch in that
  block is a view of it, and the block is FREE for its worker once the last one is gone."""

  def __init__(self, block: _Block):
    self.block = block
    self.__array_interface__ = {
      "shape": (block.capacity,),
      "typestr": "|u1",
      "data": (block.address, False),
      "version": 3,
    }

  def __del__(self, free=FREE):  # bound now: a batch held to exit outlives the module's globals
    self.block.words[0] = free


class Reader:
  """The main process's blocks: each mapped once, its name unlinked at once."""

  def __init__(self):
    self.blocks: dict[str, _Block] = {}

  def lease(self, name: str, generation: int) -> _Lease:
    """The data of block `name`, which must hold `generation`, SENT."""
    block = self.blocks.get(name)
    if block is None:
      block = self.blocks[name] = _Block(name)
      block.unlink()  # mapped: the name is no longer needed, so it can never leak
    state, current = (int(w) for w in block.words)
    if state != SENT or current != generation:
      raise HandoffError(
        f"shared-memory block {name} holds generation {current} (state {state}), the batch "
        f"expected generation {generation} sent: a batch's memory was reused before it was "
        "read; please report this"
      )
    return _Lease(block)


# ---------------------------------------------------------------- sweeps


def _names(token: str = "*") -> list[str]:
  """Paths of the ring blocks of `token` (default: of every writer) in /dev/shm."""
  return glob.glob(os.path.join(SHM_DIR, f"{PREFIX}-{token}-*"))


def _orphaned(path: str) -> bool:
  """Whether no process holds the block's lock: its worker is gone (whatever its PID
  namespace). A block still being made (size 0, before its lock) is left alone."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    return False
  else:
    return os.fstat(fd).st_size > 0
  finally:
    os.close(fd)  # releases the lock taken, if any


def _unlink(path: str) -> int:
  try:
    os.unlink(path)
    return 1
  except FileNotFoundError:
    return 0


def sweep_writers() -> int:
  """Unlinks the blocks of this process's writers whose worker process is gone; returns how
  many (as the main process's iterator closes)."""
  return sum(_unlink(path) for token in _TOKENS for path in _names(token) if _orphaned(path))


def sweep_crashed() -> int:
  """Unlinks blocks whose worker process is gone (a crash left them)."""
  return sum(_unlink(path) for path in _names() if _orphaned(path))


def close_rings() -> None:
  """Unlinks this process's own blocks (a worker whose main process died)."""
  for ring in list(_RINGS.values()):
    ring.close()


@atexit.register
def sweep_own() -> None:
  """Unlinks the blocks of every writer this process made (its workers' rings): at exit."""
  for token in _TOKENS:
    for path in _names(token):
      _unlink(path)
