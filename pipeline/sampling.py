"""Index sampling: per-epoch global shuffle, then repeat, then this process's slice.

Position `i` of a process's stream is epoch `i // per_epoch`, and within that epoch the
global position `j * shard_count + shard_index` of a permutation drawn fresh for the epoch
(Grain's index shuffle: O(1) memory, no shuffle buffer, no stall at epoch start). So the
processes' slices are disjoint, together cover every record each epoch, and the order is a
pure function of (seed, position): resuming needs nothing but the next position.

Remainder policy when `num_records` does not divide by `shard_count`:
- "drop": each process takes `num_records // shard_count` per epoch; the few records left
  over differ each epoch (they are the tail of that epoch's permutation). For training.
- "pad":  each process takes `ceil(num_records / shard_count)`; missing places are padding
  (index -1, masked out). Every record is seen exactly once per epoch. For evaluation.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from grain.experimental import index_shuffle

PAD = -1


@dataclasses.dataclass(frozen=True)
class Sampler:
  num_records: int
  seed: int = 0
  shuffle: bool = True
  num_epochs: int | None = None  # None: repeat forever
  shard_index: int = 0
  shard_count: int = 1
  remainder: str = "drop"

  def __post_init__(self):
    if not 0 <= self.shard_index < self.shard_count:
      raise ValueError(f"shard_index {self.shard_index} not in [0, {self.shard_count})")
    if self.remainder not in ("drop", "pad"):
      raise ValueError(f"remainder must be 'drop' or 'pad', not {self.remainder!r}")
    if self.per_epoch == 0:
      raise ValueError(f"{self.num_records} records cannot feed {self.shard_count} processes")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")

  @property
  def per_epoch(self) -> int:
    """Positions per epoch for this process (the same for every process)."""
    if self.remainder == "drop":
      return self.num_records // self.shard_count
    return math.ceil(self.num_records / self.shard_count)

  def __len__(self) -> int:
    return sys.maxsize if self.num_epochs is None else self.per_epoch * self.num_epochs

  def epoch(self, position: int) -> int:
    return position // self.per_epoch

  def record_index(self, position: int) -> int:
    """The global record index at `position` of this process's stream, or PAD."""
    epoch, j = divmod(position, self.per_epoch)
    g = j * self.shard_count + self.shard_index
    if g >= self.num_records:
      return PAD
    if not self.shuffle or self.num_records == 1:
      return g
    return index_shuffle(g, max_index=self.num_records - 1,
                         seed=(self.seed + epoch) % 2**32, rounds=4)
