"""Batch memory for a process without worker processes: a batch's pages go to a later batch once
nothing holds the first.

Without it every batch (19 MB at 128 x 224 px) was a fresh allocation freed a few batches later:
glibc then raised its mmap threshold past a batch's size and kept batches in its arenas, where
they fragmented them (the loader held ~310 MB above its imports on 2 cores, ~245 MB with this;
docs/HISTORY.md, "The loader's memory and glibc's allocator"). Worker processes have their
rings of shared memory instead (`shm`).
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref

import numpy as np

SPARE = 2  # dropped batches' buffers kept for the next ones (1 kept little: measured in REPORT)
SPARE_BYTES = 64 * 2**20  # and no more bytes than this: glibc unmaps a batch over 32 MiB at once


def spare(batch_bytes: int, keep: int = SPARE) -> int:
  """How many dropped buffers of `batch_bytes` wait for the next batches."""
  return min(keep, SPARE_BYTES // max(1, batch_bytes))


class BatchPool:
  """`empty(shape, dtype)` as np.empty, from buffers that come back when their batch, and every
  view of it, is garbage; at most `spare(size, keep)` of them wait, the rest are unmapped.

  A buffer is an anonymous mmap, not an ndarray: numpy points every view at the first array
  over a foreign buffer (`whole`), which so outlives the batch and all its views, and its
  finalizer runs only once none is left."""

  def __init__(self, keep: int = SPARE):
    self.keep = keep
    self._spare: list[mmap.mmap] = []
    self._lock = threading.Lock()

  def __getstate__(self):
    return {"keep": self.keep}

  def __setstate__(self, state):
    self.__init__(state["keep"])

  def empty(self, shape: tuple, dtype) -> np.ndarray:
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    with self._lock:
      buffer = next((b for b in self._spare if len(b) == nbytes), None)
      if buffer is not None:
        self._spare.remove(buffer)
    if buffer is None:
      buffer = mmap.mmap(-1, max(1, nbytes))
    whole = np.frombuffer(buffer, np.uint8, nbytes)  # the base of the batch and its views
    weakref.finalize(whole, self._give_back, buffer)
    return whole.view(dtype).reshape(shape)

  def _give_back(self, buffer: mmap.mmap) -> None:
    with self._lock:
      if len(self._spare) < spare(len(buffer), self.keep):
        self._spare.append(buffer)
