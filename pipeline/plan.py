"""Stage 1, plan: batch `i` of a process's stream -> which records it holds.

`PlanBatches` is the first map of the chain (`MapDataset.range(n).map(PlanBatches(...))`):
the sampler's order is a pure function of (seed, position), so the plan of any batch is known
long before it is needed, which is what lets the read stage fetch ahead. A `Batch` then
travels through the stages, each filling its part: records (read), images and labels
(decode), and finally the batch dict (ops).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from pipeline.sampling import PAD, Sampler


@dataclasses.dataclass
class Batch:
  """One batch on its way through the stages (a plain object: it never leaves its process)."""

  index: int  # the batch's position in this process's stream
  epochs: np.ndarray  # int64[n]: the epoch of each slot
  indices: np.ndarray  # int64[n]: the global record index of each slot, PAD for padding
  records: list | None = None  # read: bytes, None (padding) or the slot's read error
  images: np.ndarray | None = None  # decode: uint8[n, S, S, 3]
  labels: np.ndarray | None = None  # decode: int64[n]
  bad: np.ndarray | None = None  # decode and ops: bool[n], slots whose record failed
  where: Callable[[int], str] = str  # read: names a record index for errors (shard, record)

  @property
  def real(self) -> np.ndarray:
    return self.indices != PAD


@dataclasses.dataclass(frozen=True)
class PlanBatches:
  """Batch index -> `Batch` with the (epoch, record index) of each of its slots."""

  sampler: Sampler
  batch_size: int

  def __call__(self, batch_index: int) -> Batch:
    first = batch_index * self.batch_size
    positions = np.arange(first, min(first + self.batch_size, len(self.sampler)))
    epochs, indices = self.sampler.records(positions)
    return Batch(int(batch_index), epochs, indices)
