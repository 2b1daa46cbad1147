"""The block order: an epoch's shuffle that a bucket can serve in few, large requests.

A bucket rations requests, not bytes, and the global shuffle (`shuffle.permute`) asks one
request per image. Here the records are cut into blocks of `block_records` consecutive
records (consecutive within a shard; a shard's last block may be shorter), and an epoch is a
keyed permutation of all blocks, dealt out to the processes in shares of about equal records
(the whole blocks in turn, the shorter ones each to the smallest share), and each process's
share cut into windows of its `window_blocks / processes` blocks (by default `WINDOW_BATCHES`
of its batches' worth). A window is served in rounds: each round takes one record from each
of its blocks, in one fixed order of the window's blocks (its lanes), and the process's
batches cut the rounds in turn. So a global batch holds one record of each of as many random
blocks (its label mix is that of as many random records: a global shuffle's;
`label_distance` measures it), WINDOW_BATCHES batches in a row hold distinct blocks, each
block of an epoch (each part of a block cut between shares) is read by one process only,
once, partial windows and splits smaller than a window included, and a block is done after
`block_records` rounds.

Each process takes the same share every epoch, drawn once from the seed, not the epoch, in
a new order each epoch: a host reads the same records every epoch, so its record cache, which
need hold only its share, serves every epoch after the first (a pod reads the split once, as
one host does). Where whole blocks make shares alike (`Blocks.cut_shares` false: each holds
records, none 5% more than another, so from about 20 blocks a process), a share is whole
blocks. Else (a few blocks a process)
the blocks, in the drawn order, are laid end to end and cut into `processes` runs of equal
records (within one): a block on a boundary is split into parts, each a short block of its
share, and a process reads only its part (`Blocks.cuts`, `pipeline.storage.ranges`), so every
record is still read by one process once an epoch and the shares' records differ by one;
at most `processes` - 1 blocks are cut. (Rotating whole shares with the epoch instead, as
before, let no cache serve a next epoch: 2 trainer hosts read 1.72x one host's bytes on the
built-in digits. Cutting every block into a part per process would mix better on splits of
a few blocks, but multiply the requests by the process count.) In
training ("drop") a process's epochs end where its own share does, so a record is taken at
most as much more often than another as the shares differ (ImageNet on 64 hosts, blocks of
256: 1.3%; cut shares: one record). Evaluation ("pad") pads each epoch to the largest share.
The order depends on the process count (`rest`: a state resumed on another).

Within a block, round r takes the record at the bit-reversal rank of r: a worker process
that takes one batch in w (w / gcd(w, WINDOW_BATCHES) a power of two, P) takes one aligned
run of block_records / P records of each of its blocks, and reads it in one request
(`pipeline.storage.ranges`); where /dev/shm serves, a host's workers of any count share each
block's one read instead (`pipeline.storage.blockstore`). As `permute`, the order is a pure
function of (key, position): every record once per epoch, and a restart needs only the next
position.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from pipeline.order.shuffle import PAD, epoch_key, permute

BLOCK_RECORDS = 16  # records per block at least: images per request from one process
BLOCK_BYTES = 2 * 2**20  # bytes per block at least, by default (a layer may cut at 1 MiB)
MAX_BLOCK_RECORDS = 256
WINDOW_BATCHES = 4  # global batches of blocks per window: batches in a row with no block shared
SHARES_EPOCH = 2**32 - 1  # the key that draws the processes' fixed shares: no epoch's
FIXED_SPREAD = 20  # fixed shares differ by 5% of a share at most


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The block order over shards of `shard_records` records (in shard order), read in
  windows of `window_blocks` blocks (each of the processes' shares in its part of them)."""

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

  @property
  def count(self) -> int:
    """Blocks in the split."""
    return len(self._blocks[0])

  def permute(self, positions: np.ndarray, key: int) -> np.ndarray:
    """The record at each of `positions` (in [0, total records)) of the epoch keyed `key`,
    one process taking every block."""
    return _serve(self, _epoch(self, key, 1, 0, key), np.asarray(positions, np.int64))

  def loads(self, hosts: int, shuffle: bool = True) -> np.ndarray:
    """The records of each of the `hosts` shares an epoch's blocks are dealt into."""
    return _loads(self, hosts, shuffle)

  def records(
    self, positions: np.ndarray, host: int, hosts: int, seed: int | None, pad: bool
  ) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, record or PAD) at each of `positions` of process `host`'s stream of `hosts`:
    share `host` of the blocks (`_parts`, drawn from `seed`) every epoch, in the epoch's
    order. Padded (`pad`), each epoch takes as many positions as the largest share, the rest
    PAD; else a process's epochs end where its own records do. `seed` None: each share a run
    of records in record order."""
    positions = np.asarray(positions, np.int64)
    loads = self.loads(hosts, seed is not None)
    epochs, offsets = np.divmod(positions, loads.max() if pad else loads[host])
    shares_key = _shares_key(seed)
    out = np.full_like(positions, PAD)
    for e in np.unique(epochs).tolist():  # a batch spans one epoch, rarely two
      at = (epochs == e) & (offsets < loads[host])
      if seed is None:
        out[at] = _first_record(self, hosts, host) + offsets[at]
      else:
        key = epoch_key(seed, e)
        out[at] = _serve(self, _epoch(self, key, hosts, host, shares_key), offsets[at])
    return epochs, out

  def epoch_start(self, epoch: int, host: int, hosts: int, shuffle: bool = True) -> int:
    """The position of process `host`'s training stream (of `hosts`) where `epoch` begins."""
    return epoch * int(self.loads(hosts, shuffle)[host])

  def rest(self, left: np.ndarray, key: int | None, host: int, hosts: int) -> np.ndarray:
    """Process `host`'s part (of `hosts`) of the records `left` (sorted) of an epoch keyed
    `key` (None: in record order), in its order: their blocks dealt out whole, the blocks with
    more records left first, each to the part then smallest, each part served as an epoch's
    share is, in rounds over windows (a block's records in the order of its rounds)."""
    first, sizes = self._blocks
    block = np.searchsorted(first, left, side="right") - 1
    counts = np.bincount(block, minlength=self.count)
    ids = np.flatnonzero(counts)
    counts = counts[ids]
    rank = np.empty(self.count, np.int64)
    rank[np.arange(self.count) if key is None else _shuffled(self, key)] = np.arange(self.count)
    by = np.lexsort((rank[ids], -counts))
    ids, counts = ids[by], counts[by]
    loads, share = np.zeros(hosts, np.int64), np.empty(len(ids), np.int64)
    for i, n in enumerate(counts.tolist()):
      share[i] = int(np.argmin(loads))
      loads[share[i]] += n
    bits = max(1, (self.largest - 1).bit_length())
    starts = np.searchsorted(block, ids)  # `left` is sorted: a block's records are a run
    lanes = []
    for b, start, n in zip(ids[share == host], starts[share == host], counts[share == host]):
      mine = left[start : start + n]
      rounds = np.argsort(_ranks(bits, int(sizes[b])))[mine - first[b]]
      lanes.append(mine[np.argsort(rounds)])
    out, width = [], lanes_per_host(self, hosts)
    for w in range(0, len(lanes), width):
      window = lanes[w : w + width]
      rounds = np.concatenate([np.arange(len(x)) for x in window])
      lane = np.concatenate([np.full(len(x), j) for j, x in enumerate(window)])
      out.append(np.concatenate(window)[np.lexsort((lane, rounds))])
    return np.concatenate(out) if out else np.zeros(0, np.int64)

  def cut_shares(self, hosts: int, shuffle: bool = True) -> bool:
    """Whether the shares of `hosts` processes are cut at records (`_parts`): where whole
    blocks leave a share empty or one more than 1 / FIXED_SPREAD of the smallest larger."""
    loads = _whole_loads(self, hosts, shuffle)
    low, high = int(loads.min()), int(loads.max())
    return hosts > 1 and not (low > 0 and (high - low) * FIXED_SPREAD <= low)

  def cuts(self, hosts: int, seed: int | None) -> np.ndarray:
    """The records where a part of a cut block begins (`_parts`; sorted): a process reads a
    cut block's records up to the next cut only."""
    first, _, block, _ = _parts(self, hosts, _shares_key(seed))
    return np.sort(first[first != self._blocks[0][block]])


def _serve(blocks: Blocks, epoch: tuple, positions: np.ndarray) -> np.ndarray:
  """The records at `positions` of one process's epoch (`_epoch`): rounds over windows."""
  first, sizes, starts, window_ends = epoch
  window = np.searchsorted(window_ends, positions, side="right")
  out = np.empty_like(positions)
  bits = max(1, (blocks.largest - 1).bit_length())
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


@functools.lru_cache(maxsize=8)
def _shares(blocks: Blocks, hosts: int, shuffle: bool) -> np.ndarray:
  """The share each block of an epoch goes to. Shuffled, the places of `_epoch`'s order (the
  whole blocks, then the shorter ones longest first: the same sizes every epoch): the whole
  blocks in turn (the last turn's spread out, so that shares in a row add up evenly), each
  shorter one to the share then smallest. In order, the blocks in record order, cut into runs
  of about equal records."""
  _, sizes = blocks._blocks
  if not shuffle:
    return (np.cumsum(sizes) - sizes) * hosts // int(sizes.sum())
  sizes = np.sort(sizes)[::-1]
  whole = int((sizes == blocks.block_records).sum())
  shares = np.arange(len(sizes)) % hosts
  extra = whole % hosts  # the last turn's whole blocks, spread over the shares
  shares[whole - extra : whole] = np.arange(extra) * hosts // max(1, extra)
  loads = np.bincount(shares[:whole], minlength=hosts) * blocks.block_records
  for j in range(whole, len(sizes)):
    shares[j] = int(np.argmin(loads))
    loads[shares[j]] += sizes[j]
  return shares


@functools.lru_cache(maxsize=8)
def _whole_loads(blocks: Blocks, hosts: int, shuffle: bool) -> np.ndarray:
  """The records of each share of whole blocks (`_shares`)."""
  _, sizes = blocks._blocks
  if shuffle:
    sizes = np.sort(sizes)[::-1]  # an epoch's blocks, as `_epoch` orders them
  return np.bincount(_shares(blocks, hosts, shuffle), sizes, minlength=hosts).astype(np.int64)


@functools.lru_cache(maxsize=8)
def _loads(blocks: Blocks, hosts: int, shuffle: bool) -> np.ndarray:
  """The records of each share: of whole blocks, or cut at records (`_parts`)."""
  if not blocks.cut_shares(hosts, shuffle):
    return _whole_loads(blocks, hosts, shuffle)
  return np.diff(_cut_at(blocks, hosts))


def _cut_at(blocks: Blocks, hosts: int) -> np.ndarray:
  """Where each of `hosts` shares cut at records begins in the blocks laid end to end, and
  the end: `hosts` runs of equal records (within one)."""
  total = sum(blocks.shard_records)
  return np.arange(hosts + 1, dtype=np.int64) * total // hosts


def _shares_key(seed: int | None) -> int | None:
  """The key that draws the shares (None: unshuffled, in record order)."""
  return None if seed is None else epoch_key(seed, SHARES_EPOCH)


@functools.lru_cache(maxsize=8)
def _parts(
  blocks: Blocks, hosts: int, key: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(first record, records, block, share) of each part of the blocks dealt to `hosts` shares
  drawn with `key` (None: unshuffled): whole blocks (`_shares`) unless `cut_shares`; else the
  blocks in the drawn order (`_shuffled`; unshuffled: record order) laid end to end and cut
  into `hosts` runs of equal records (`_cut_at`), a block across a cut in parts."""
  first, sizes = blocks._blocks
  if not blocks.cut_shares(hosts, key is not None):
    share = _shares(blocks, hosts, False) if key is None else _share_of(blocks, hosts, key)
    return first, sizes, np.arange(blocks.count), share
  order = np.arange(blocks.count) if key is None else _shuffled(blocks, key)
  ends = np.cumsum(sizes[order])
  cut = _cut_at(blocks, hosts)
  bounds = np.union1d(np.concatenate([[0], ends]), cut)
  lo, hi = bounds[:-1], bounds[1:]
  k = np.searchsorted(ends, lo, side="right")  # each part's place in `order`
  block = order[k]
  part_first = first[block] + lo - (ends[k] - sizes[block])
  return part_first, hi - lo, block, np.searchsorted(cut[1:-1], lo, side="right")


@functools.lru_cache(maxsize=8)
def _first_record(blocks: Blocks, hosts: int, share: int) -> int:
  """The first record of a share of blocks in record order."""
  first, _, _, owner = _parts(blocks, hosts, None)
  mine = first[owner == share]
  return int(mine[0]) if len(mine) else 0


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


def _shuffled(blocks: Blocks, key: int) -> np.ndarray:
  """The blocks in the order keyed `key`: shuffled, the whole ones first, then the shorter
  ones (each shard's last), longest first."""
  first, sizes = blocks._blocks
  order = permute(np.arange(len(first)), len(first), key)
  short = sizes[order] < blocks.block_records
  return np.concatenate(
    [order[~short], order[short][np.argsort(-sizes[order][short], kind="stable")]]
  )


@functools.lru_cache(maxsize=8)
def _share_of(blocks: Blocks, hosts: int, key: int) -> np.ndarray:
  """[block]: the share it belongs to: `_shares`' places in the order keyed `key`."""
  share = np.empty(blocks.count, np.int64)
  share[_shuffled(blocks, key)] = _shares(blocks, hosts, True)
  return share


@functools.lru_cache(maxsize=8)
def _epoch(
  blocks: Blocks, key: int, hosts: int, share: int, shares_key: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """A share's blocks (its parts of the shares keyed `shares_key`: `_parts`) in the epoch
  keyed `key`, in order: (first record of each, its records, the block each window of the
  share's lanes starts at and where it ends in the share's positions). The whole blocks come
  first, so every round of a whole window holds as many records as lanes and a process's part
  of the batches keeps its lanes from round to round; then the shorter ones (a shard's last
  block, a cut block's part), longest first, so the blocks a round takes are always a
  window's first lanes."""
  first, sizes, block, owner = _parts(blocks, hosts, shares_key)
  rank = np.empty(blocks.count, np.int64)
  rank[_shuffled(blocks, key)] = np.arange(blocks.count)
  mine = np.flatnonzero(owner == share)
  order = mine[np.lexsort((rank[block[mine]], -sizes[mine]))]
  first, sizes = first[order], sizes[order]
  full, lanes = int((sizes == blocks.block_records).sum()), lanes_per_host(blocks, hosts)
  starts = [*range(0, full, lanes), *range(full, len(order), lanes)]
  starts = np.asarray([*starts, len(order)], np.int64)
  position = np.concatenate([[0], np.cumsum(sizes)])
  return first, sizes, starts, position[starts[1:]]


def lanes_per_host(blocks: Blocks, hosts: int) -> int:
  """The blocks a window holds in each of `hosts` processes (each its own)."""
  return max(1, blocks.window_blocks // hosts)


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


def workers_per_block(blocks: Blocks, batch_size: int, workers: int) -> int:
  """The worker processes (of `workers` taking one batch of `batch_size` in turn) that the
  records of one block fall to."""
  batches = max(1, blocks.window_blocks // batch_size)  # batches per round
  return max(1, workers) // math.gcd(max(1, workers), batches)


def pieces(blocks: Blocks, batch_size: int, workers: int) -> int:
  """Records per read of a worker process (of `workers` taking one batch of `batch_size` in
  turn): the aligned run of its blocks' records it takes, when it takes one round in a power
  of two (see the module docstring); else a block whole (fewer requests, more bytes)."""
  share = workers_per_block(blocks, batch_size, workers)  # this one takes 1 round in share
  if share & (share - 1):
    return blocks.block_records
  return max(1, blocks.block_records // share)
