"""Index sampling: per-epoch global shuffle, then repeat, then this process's slice.

The global stream is the concatenation of the epochs, each a permutation of all the records
drawn fresh for the epoch (a keyed Feistel bijection with cycle walking: O(1) memory, no
shuffle buffer, no stall at epoch start, computed for a whole batch of positions in a few
numpy operations): global position `g` is epoch `g // num_records`, permutation position
`g % num_records`. For training ("drop") the stream is dealt out in blocks of `block` (the
batch size b): position i of process p of n is global position `(i // b) * n * b + p * b +
i % b`, so batch k of processes 0..n-1, in process order, is global positions [k*G, (k+1)*G)
with G = n * b, whatever n is: the same global batch array on any process count (a batch
may span an epoch boundary), and a state is a global position any process count continues
from (`pipeline.order.elastic`). The order is a pure function of (seed, position). With
`blocks`, each process instead takes its own share of each epoch's blocks, in the block order
(`pipeline.order.blocks`: few, large storage requests, each block read by one process only).

With `shard_records` (the records of each shard) a process instead owns whole shards, the
same ones every epoch (shard k goes to process k % shard_count), and shuffles its own records
each epoch: a host then reads, and can cache, only 1/shard_count of the dataset, at the price
of a shuffle that never mixes records across processes' shards (the global shuffle, the
default, does) and of an order that depends on the process count. Every process takes the
same number of positions per epoch (the smallest share under "drop", the largest under "pad").

Remainder policy:
- "drop": for training. Global sharding drops nothing (epochs run on into each other); a
  finite stream on several processes ends after its last whole global batch. `per_epoch` is
  then a process's average share of an epoch.
- "pad": each epoch is dealt out alone: each process takes `ceil(num_records / shard_count)`
  positions, `j * shard_count + shard_index` (in the block order: as many as the largest
  share of the blocks, its own share first); missing places are padding (index -1, masked
  out). Every record is seen exactly once per epoch. For evaluation.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np

from pipeline.order import blocks as blocks_lib
from pipeline.order import elastic
from pipeline.order.blocks import Blocks
from pipeline.order.shuffle import PAD, epoch_key, permute


@dataclasses.dataclass(frozen=True)
class Sampler:
  num_records: int
  seed: int = 0
  shuffle: bool = True
  num_epochs: int | None = None  # None: repeat forever
  shard_index: int = 0
  shard_count: int = 1
  remainder: str = "drop"
  shard_records: tuple[int, ...] | None = None  # set: this process owns whole shards
  block: int = 1  # global order: positions a process takes in a row (its batch size)
  blocks: Blocks | None = None  # set: the block order (`pipeline.order.blocks`) instead of permute
  resumed: tuple[tuple[int, ...], ...] = ()  # the block order resumed on this count: the
  # (processes, batch, batches[, window_blocks]) it was read in before (`elastic.resumed`)

  def __post_init__(self):
    if self.shard_records is not None and len(self.shard_records) < self.shard_count:
      raise ValueError(
        f"{len(self.shard_records)} shards cannot be owned by {self.shard_count} processes: "
        "use sharding='records' or convert to more shards"
      )
    if not 0 <= self.shard_index < self.shard_count:
      raise ValueError(f"shard_index {self.shard_index} not in [0, {self.shard_count})")
    if self.block < 1:
      raise ValueError(f"block must be positive, got {self.block}")
    if self.remainder not in ("drop", "pad"):
      raise ValueError(f"remainder must be 'drop' or 'pad', not {self.remainder!r}")
    if self.per_epoch == 0:
      raise ValueError(f"{self.num_records} records cannot feed {self.shard_count} processes")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
    if self.resumed and (self.blocks is None or not self.global_order):
      raise ValueError("only a training stream in the block order resumes on another count")

  @property
  def dealt_to(self) -> int:
    """The processes the blocks are dealt out to (each process that owns shards has its own)."""
    return self.shard_count if self.shard_records is None else 1

  def shares_blocks(self, workers: int) -> bool:
    """Whether a block's records fall to more than one of `workers` worker processes (Grain
    deals the batches out in turn): in the block order, unless the workers divide a round's
    batches."""
    if self.blocks is None:
      return False
    return blocks_lib.workers_per_block(self.blocks, self.block * self.dealt_to, workers) > 1

  def block_pieces(self, workers: int, shared: bool) -> int | None:
    """Records per block read in each process: blocks whole when the workers share them (in
    a `BlockStore`), else a worker process reads its part of a block."""
    if self.blocks is None:
      return None
    if shared:
      return self.blocks.block_records
    return blocks_lib.pieces(self.blocks, self.block * self.dealt_to, workers)

  def epoch_requests(self, workers: int, shared: bool) -> float | None:
    """The block reads this process makes in an epoch, on average: its share of the blocks,
    each in block_records / pieces requests (shared by the workers: a worker reads 1 in
    workers)."""
    if self.blocks is None:
      return None
    b = self.blocks
    if shared:
      return b.count / self.shard_count / workers
    return b.count / self.shard_count * (b.block_records // self.block_pieces(workers, False))

  def window_bytes(self, record_bytes: float) -> int:
    """The bytes of the blocks one window of the block order holds in this process (at most
    the split's)."""
    if self.blocks is None:
      return 0
    lanes = blocks_lib.lanes_per_host(self.blocks, self.dealt_to)
    return int(min(lanes * self.blocks.largest, self.num_records) * record_bytes)

  @property
  def kept_fraction(self) -> float:
    """The part of the split this process reads over all its epochs, what its record cache
    need hold: 1 / shard_count of it when it owns shards, its share of the blocks (the same
    every epoch) in the block order, else all of it."""
    if self.shard_records is not None:
      return 1 / self.shard_count
    if self.blocks is not None:
      return int(self.blocks.loads(self.shard_count, self.shuffle).max()) / self.num_records
    return 1.0

  @property
  def cuts(self) -> tuple[int, ...]:
    """The records where this order's reads stop inside a block: where a share of the blocks
    cut at records begins (`Blocks.cuts`), so that each process reads only its part."""
    if self.blocks is None or self.shard_records is not None:
      return ()
    seed = self.seed if self.shuffle else None
    return tuple(self.blocks.cuts(self.shard_count, seed).tolist())

  def _owned(self, process: int) -> np.ndarray:
    """The shard numbers process `process` owns (sharding by shards)."""
    return np.arange(process, len(self.shard_records), self.shard_count)

  @property
  def per_epoch(self) -> int:
    """Positions per epoch for this process (the same for every process)."""
    if self.shard_records is not None:
      counts = np.asarray(self.shard_records, np.int64)
      shares = [int(counts[self._owned(p)].sum()) for p in range(self.shard_count)]
      return min(shares) if self.remainder == "drop" else max(shares)
    if self.remainder == "drop":
      return self.num_records // self.shard_count
    if self.blocks is not None:  # the largest share of the blocks
      return int(self.blocks.loads(self.shard_count, self.shuffle).max())
    return math.ceil(self.num_records / self.shard_count)

  @property
  def global_order(self) -> bool:
    """Whether this process takes blocks of the global stream (the same on any count)."""
    return self.shard_records is None and self.remainder == "drop"

  def __len__(self) -> int:
    if self.num_epochs is None:
      return sys.maxsize
    if self.global_order and self.shard_count > 1:  # all end after the last whole global batch
      return self.num_records * self.num_epochs // (self.shard_count * self.block) * self.block
    if self.global_order:
      return self.num_records * self.num_epochs
    return self.per_epoch * self.num_epochs

  def records(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, global record index or PAD) of each position of this process's stream."""
    if self.shard_records is not None:
      return self._owned_records(positions)
    if self.resumed:
      return self._resumed_records(np.asarray(positions, np.int64))
    if self.blocks is not None:
      seed = self.seed if self.shuffle else None
      pad = self.remainder == "pad"
      return self.blocks.records(positions, self.shard_index, self.shard_count, seed, pad)
    positions = np.asarray(positions, np.int64)
    if self.global_order:
      block, rest = np.divmod(positions, self.block)
      g = (block * self.shard_count + self.shard_index) * self.block + rest
      epochs, g = np.divmod(g, self.num_records)
    else:
      epochs, j = np.divmod(positions, self.per_epoch)
      g = j * self.shard_count + self.shard_index
    pad = g >= self.num_records
    if self.shuffle:
      for epoch in range(int(epochs[0]), int(epochs[-1]) + 1) if len(epochs) else ():
        at = (epochs == epoch) & ~pad  # a batch spans one epoch, rarely two
        g[at] = permute(g[at], self.num_records, epoch_key(self.seed, epoch))
    g[pad] = PAD
    return epochs, g

  def epoch_start(self, epoch: int) -> int:
    """The position where `epoch` begins in this process's training stream in the block order
    (0 for the epochs before the one it resumed in)."""
    if not self.resumed:
      return self.blocks.epoch_start(epoch, self.shard_index, self.shard_count, self.shuffle)
    first, rest = elastic.rest_of_epoch(self)
    if epoch <= first:
      return 0
    fresh = dataclasses.replace(self, resumed=())
    return len(rest) + fresh.epoch_start(epoch) - fresh.epoch_start(first + 1)

  def _resumed_records(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`records` of a block order resumed on this count: first this process's part of the
    interrupted epoch's records that were not read (`elastic.rest_of_epoch`), then the next
    epochs as a fresh run on this count reads them."""
    epoch, rest = elastic.rest_of_epoch(self)
    fresh = dataclasses.replace(self, resumed=())
    inside = positions < len(rest)
    later = positions[~inside] - len(rest) + fresh.epoch_start(epoch + 1)
    epochs, records = np.full_like(positions, epoch), np.empty_like(positions)
    records[inside] = rest[positions[inside]]
    epochs[~inside], records[~inside] = fresh.records(later)
    return epochs, records

  def _owned_records(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`records` when this process owns whole shards: its records, shuffled per epoch."""
    epochs, j = np.divmod(np.asarray(positions, np.int64), self.per_epoch)
    counts = np.asarray(self.shard_records, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    owned = self._owned(self.shard_index)
    total = int(counts[owned].sum())
    pad = j >= total
    local = j.copy()
    if self.shuffle:
      for epoch in range(int(epochs[0]), int(epochs[-1]) + 1) if len(epochs) else ():
        at = (epochs == epoch) & ~pad
        local[at] = self._permute(local[at], total, epoch_key(self.seed, epoch), owned)
    ends = np.cumsum(counts[owned])
    k = np.searchsorted(ends, np.minimum(local, total - 1), side="right")
    g = starts[owned][k] + local - (ends[k] - counts[owned][k])
    g[pad] = PAD
    return epochs, g

  def _permute(self, x: np.ndarray, n: int, key: int, owned: np.ndarray) -> np.ndarray:
    """The epoch's order of the `owned` shards' records: `permute`, or the block order."""
    if self.blocks is None:
      return permute(x, n, key)
    counts = tuple(np.asarray(self.blocks.shard_records)[owned].tolist())
    return dataclasses.replace(self.blocks, shard_records=counts).permute(x, key)

  def record_index(self, position: int) -> int:
    """The global record index at `position` of this process's stream, or PAD."""
    return int(self.records(np.array([position]))[1][0])
