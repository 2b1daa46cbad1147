"""The block order: an epoch's shuffle that a bucket can serve in few, large requests.

A bucket rations requests, not bytes, and the global shuffle (`sampling.permute`) asks one
request per image. Here the records are cut into blocks of `block_records` consecutive
records (consecutive within a shard; a shard's last block may be shorter), and an epoch is:
a keyed permutation of all blocks, cut into windows of `window_blocks` blocks, each window's
records in a keyed permutation of their own. A window's records come from few requests (one
per block), and a batch drawn from a window's W x K records mixes like a global shuffle's
to within a factor of about sqrt(1 + batch / W) in the spread of its label mix
(`label_distance` measures it). As `permute`, it is a pure function of (key, position): every
record once per epoch, and a restart needs only the next position.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from pipeline.sampling import permute

BLOCK_RECORDS = 16  # records per block: images per request
WINDOW_BLOCKS = 512  # blocks per window: a batch of 128 mixes within 1.25x a global shuffle


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The block order over shards of `shard_records` records (in shard order)."""

  shard_records: tuple[int, ...]
  block_records: int = BLOCK_RECORDS
  window_blocks: int = WINDOW_BLOCKS

  def __post_init__(self):
    for name in ("block_records", "window_blocks"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

  @functools.cached_property
  def _blocks(self) -> tuple[np.ndarray, np.ndarray]:
    """(first record, records) of each block, in record order."""
    counts = np.asarray(self.shard_records, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    per_shard = -(-counts // self.block_records)  # ceil
    shard = np.repeat(np.arange(len(counts)), per_shard)
    k = np.arange(len(shard)) - np.repeat(np.cumsum(per_shard) - per_shard, per_shard)
    first = starts[shard] + k * self.block_records
    return first, np.minimum(self.block_records, starts[shard] + counts[shard] - first)

  def permute(self, positions: np.ndarray, key: int) -> np.ndarray:
    """The record at each of `positions` (in [0, total records)) of the epoch keyed `key`."""
    positions = np.asarray(positions, np.int64)
    first, ends, window_ends = _epoch(self, key)
    window = np.searchsorted(window_ends, positions, side="right")
    out = np.empty_like(positions)
    for w in np.unique(window).tolist():  # a batch spans one window, rarely two
      at = window == w
      lo = int(window_ends[w - 1]) if w else 0
      inner = permute(positions[at] - lo, int(window_ends[w]) - lo, window_key(key, w))
      p = lo + inner  # position in the epoch's blocks, laid end to end
      slot = np.searchsorted(ends, p, side="right")
      out[at] = first[slot] + p - np.where(slot > 0, ends[np.maximum(slot - 1, 0)], 0)
    return out


def window_key(key: int, window: int) -> int:
  """The key of one window's permutation within the epoch keyed `key`."""
  return key ^ ((window + 1) * 0x9E3779B97F4A7C15 % 2**64)  # permute mixes its key


@functools.lru_cache(maxsize=4)
def _epoch(blocks: Blocks, key: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The epoch's blocks in order: (first record of each, where each ends in the epoch's
  positions, where each window ends)."""
  first, sizes = blocks._blocks
  order = permute(np.arange(len(first)), len(first), key)
  ends = np.cumsum(sizes[order])
  window_ends = ends[blocks.window_blocks - 1 :: blocks.window_blocks]
  if len(window_ends) == 0 or window_ends[-1] != ends[-1]:
    window_ends = np.append(window_ends, ends[-1])
  return first[order], ends, window_ends


def label_distance(labels: np.ndarray, batch_size: int) -> float:
  """The mean over batches of the total-variation distance between a batch's label mix and
  the whole sequence's: how far batches are from a global shuffle's mixing (0: perfect).
  `labels` holds each position's label in stream order; the last partial batch is dropped."""
  labels = np.asarray(labels, np.int64)
  classes = int(labels.max()) + 1
  split = np.bincount(labels, minlength=classes) / len(labels)
  batches = labels[: len(labels) // batch_size * batch_size].reshape(-1, batch_size)
  counts = np.zeros((len(batches), classes))
  np.add.at(counts, (np.arange(len(batches))[:, None], batches), 1)
  return float(np.mean(0.5 * np.abs(counts / batch_size - split).sum(axis=1)))
