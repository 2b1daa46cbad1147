"""Stage 1, plan: batch `i` of a process's stream -> which records it holds.

`PlanBatches` is the first map of the chain (`MapDataset.range(n).map(PlanBatches(...))`):
the sampler's order is a pure function of (seed, position), so the plan of any batch is known
long before it is needed, which is what lets the read stage fetch ahead. A `Batch` then
travels through the stages, each filling its part: records (read), images and labels
(decode), and finally the batch dict (ops).

`Sizes` is how a process's stream is cut into batches, the one rule for the per-process
batch, the steps per epoch and the number of batches: `make_dataset` runs it, `pipeline.input`
reports it and the trainer splits its global batch by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from pipeline.host import guards
from pipeline.order.sampling import PAD, Sampler


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
  sources: np.ndarray | None = None  # plan, in a mixture: the source of each slot
  extras: dict | None = None  # decode, in a mixture: its sources' features (`pipeline.mixing`)
  rows: np.ndarray | None = None  # decode, a mixture's source: the row of `images` of each slot

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


def process_batch_size(global_batch_size: int, processes: int, name="global_batch_size") -> int:
  """Each process's share of a global batch (`name` is what the caller calls it)."""
  if not isinstance(global_batch_size, int) or global_batch_size < 1:
    raise ValueError(f"{name} must be a positive int, got {global_batch_size!r}")
  if global_batch_size % processes:
    raise ValueError(
      f"{name}={global_batch_size} does not divide over the {processes} processes that feed "
      f"the data axis: make it a multiple of {processes}"
    )
  return global_batch_size // processes


@dataclasses.dataclass(frozen=True)
class Sizes:
  """How a process's stream is cut into batches."""

  batch_size: int  # this process's
  steps_per_epoch: int  # batches per pass over this process's share (a partial one counts)
  num_batches: int  # in the whole stream (len(sampler) // batch_size when it repeats forever)

  @classmethod
  def of(cls, sampler: Sampler, batch_size: int, drop_remainder: bool, split: str) -> Sizes:
    """The sizes of `sampler`'s stream in batches of `batch_size`; refuses a batch larger than
    an epoch when partial batches are dropped (`split` names it)."""
    guards.check_batch_fits(
      batch_size, sampler.per_epoch, drop_remainder=drop_remainder, split=split
    )
    steps = _batches(sampler.per_epoch, batch_size, drop_remainder)
    forever = sampler.num_epochs is None
    return cls(batch_size, steps, _batches(len(sampler), batch_size, drop_remainder or forever))

  def up_to(self, num_batches: int | None) -> Sizes:
    """These sizes, the stream ending after `num_batches` at most (None: where it ends)."""
    if num_batches is None:
      return self
    return dataclasses.replace(self, num_batches=min(self.num_batches, num_batches))


def _batches(positions: int, batch_size: int, drop_remainder: bool) -> int:
  return positions // batch_size if drop_remainder else -(-positions // batch_size)
