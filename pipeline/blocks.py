"""The block order: an epoch's shuffle that a bucket can serve in few, large requests.

A bucket rations requests, not bytes, and the global shuffle (`sampling.permute`) asks one
request per image. Here the records are cut into blocks of `block_records` consecutive
records (consecutive within a shard; a shard's last block may be shorter), and an epoch is a
keyed permutation of all blocks, cut into windows of `window_blocks` blocks (by default
`WINDOW_BATCHES` global batches' worth). A window is served in rounds: each round takes one
record from each of its blocks, in one fixed order of the window's blocks (its lanes), and
global batches cut the rounds in turn. So a batch holds one record of each of as many random
blocks (its label mix is that of as many random records: a global shuffle's; `label_distance`
measures it), WINDOW_BATCHES batches in a row hold distinct blocks, a process's part of a
batch takes the same lanes in every round of a window (a host reads only its own blocks,
each once, and holds only them), and a block is done after `block_records` rounds.

Within a block, round r takes the record at the bit-reversal rank of r: a worker process
that takes one batch in w (w / gcd(w, WINDOW_BATCHES) a power of two, P) takes one aligned
run of block_records / P records of each of its blocks, and reads it in one request
(`pipeline.ranges`). As `permute`, the order is a pure function of (key, position): every
record once per epoch, and a restart needs only the next position.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from pipeline.sampling import permute

BLOCK_RECORDS = 16  # records per block at least: images per request from one process
BLOCK_BYTES = 2 * 2**20  # bytes per block at least, by default (a layer may cut at 1 MiB)
MAX_BLOCK_RECORDS = 256
WINDOW_BATCHES = 4  # global batches of blocks per window: batches in a row with no block shared


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The block order over shards of `shard_records` records (in shard order), read in
  windows of `window_blocks` blocks."""

  shard_records: tuple[int, ...]
  block_records: int = BLOCK_RECORDS
  window_blocks: int = WINDOW_BATCHES * 128

  def __post_init__(self):
    for name in ("block_records", "window_blocks"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

  @functools.cached_property
  def largest(self) -> int:
    """Records in the largest block: a block larger than every shard is its shard."""
    return min(self.block_records, max(self.shard_records, default=1))

  @functools.cached_property
  def _blocks(self) -> tuple[np.ndarray, np.ndarray]:
    """(first record, records) of each block, in record order."""
    counts = np.asarray(self.shard_records, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    per_shard = -(-counts // self.largest)  # ceil
    shard = np.repeat(np.arange(len(counts)), per_shard)
    k = np.arange(len(shard)) - np.repeat(np.cumsum(per_shard) - per_shard, per_shard)
    first = starts[shard] + k * self.largest
    return first, np.minimum(self.largest, starts[shard] + counts[shard] - first)

  def permute(self, positions: np.ndarray, key: int) -> np.ndarray:
    """The record at each of `positions` (in [0, total records)) of the epoch keyed `key`."""
    positions = np.asarray(positions, np.int64)
    first, sizes, starts, window_ends = _epoch(self, key)
    window = np.searchsorted(window_ends, positions, side="right")
    out = np.empty_like(positions)
    bits = max(1, (self.largest - 1).bit_length())
    for w in np.unique(window).tolist():  # a batch spans one window, rarely two
      at = window == w
      lo = int(window_ends[w - 1]) if w else 0
      lane_first, lane_sizes = first[starts[w] : starts[w + 1]], sizes[starts[w] : starts[w + 1]]
      longest_first = -np.sort(-lane_sizes)
      active = np.searchsorted(-longest_first, -np.arange(longest_first[0]), side="left")
      round_ends = np.cumsum(active)
      p = positions[at] - lo
      r = np.searchsorted(round_ends, p, side="right")
      lane = p - (round_ends[r] - active[r])
      size = lane_sizes[lane]
      for n in np.unique(size).tolist():  # one size, or a window's few shorter blocks
        of = size == n
        out[np.flatnonzero(at)[of]] = lane_first[lane[of]] + _ranks(bits, n)[r[of]]
    return out


@functools.lru_cache(maxsize=64)
def _ranks(bits: int, size: int) -> np.ndarray:
  """[round]: the record of a block of `size` records that each round takes: the records
  in the order of their `bits`-bit reversed numbers (the rounds r = c mod 2^a take one
  aligned run of records), a shorter block's the same order less the records it lacks."""
  i = np.arange(size, dtype=np.int64)
  rev = np.zeros(size, np.int64)
  for k in range(bits):
    rev |= ((i >> k) & 1) << (bits - 1 - k)
  return np.argsort(rev, kind="stable")


@functools.lru_cache(maxsize=4)
def _epoch(blocks: Blocks, key: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The epoch's blocks in order: (first record of each, its records, the block each window
  starts at and where it ends in the epoch's positions). The full blocks come first, in
  windows of their own, so every round of a full window holds window_blocks records and a
  process's part of the global batches keeps its lanes from round to round; then the
  shorter ones (each shard's last), longest first in each window, so the blocks a round
  takes are always a window's first lanes."""
  first, sizes = blocks._blocks
  order = permute(np.arange(len(first)), len(first), key)
  short = sizes[order] < blocks.block_records
  order = np.concatenate(
    [order[~short], order[short][np.argsort(-sizes[order][short], kind="stable")]]
  )
  first, sizes = first[order], sizes[order]
  full = int((~short).sum())
  starts = [*range(0, full, blocks.window_blocks), *range(full, len(order), blocks.window_blocks)]
  starts = np.asarray([*starts, len(order)], np.int64)
  position = np.concatenate([[0], np.cumsum(sizes)])
  return first, sizes, starts, position[starts[1:]]


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


def block_records(record_bytes: float | None) -> int:
  """The default records per block for records of `record_bytes` on average (None: not
  known): a power of two from BLOCK_RECORDS up, until a block holds BLOCK_BYTES."""
  k = BLOCK_RECORDS
  while record_bytes and k * record_bytes < BLOCK_BYTES and k < MAX_BLOCK_RECORDS:
    k *= 2
  return k


def pieces(blocks: Blocks, batch_size: int, workers: int) -> int:
  """Records per read of a worker process (of `workers` taking one batch of `batch_size` in
  turn): the aligned run of its blocks' records it takes, when it takes one round in a power
  of two (see the module docstring); else a block whole (fewer requests, more bytes)."""
  batches = max(1, blocks.window_blocks // batch_size)  # batches per round
  share = max(1, workers) // math.gcd(max(1, workers), batches)  # this one takes 1 round in share
  if share & (share - 1):
    return blocks.block_records
  return max(1, blocks.block_records // share)
