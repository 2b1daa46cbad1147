"""The mixture's order: which source fills each position of a process's stream, and which of
its records, as a pure function of the position (`pipeline.mixture` builds the stream).

`Schedule`: Sainte-Lague's divisor sequence: source s's k-th place at time (k + 1/2) / w_s,
all sources' places merged in time order. A source's count over any prefix stays within one
position of weight x prefix (measured: 0.5 for two or three sources, < 0.98 for 35; the
tests check < 1), for ever: no cycle, no drift. The place at any position is found from a
span of time around it (a batch's positions plus K of each source), so a batch costs
O(batch + sources), whatever its position.

`MixSampler`: position i of a source s is that source's `count`-th use, and each source has
its own `Sampler` (its own epochs, shuffle and process slice): the record at that count of
its own order, shifted into the mixture's merged index space (each source's records after
the previous sources'). A resume with other weights starts a new segment at the position it
resumes from (`resume`): each source's uses continue from its count there.

In the block order (`local`) the schedule runs over each process's own positions instead:
every process's batch k holds the same sources in the same slots (the global batch's shares
are the schedule's), so all processes are at the same count of each source, and each
source's own `Sampler` is its block order for this process of the n (`Blocks.records`): its
own share of the source's blocks, each read by this process only, once an epoch.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import numpy as np

from pipeline.order.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Sources 0..K-1 at positions 0, 1, ... in proportions `weights` (normalized here)."""

  weights: tuple[float, ...]

  def __post_init__(self):
    w = np.asarray(self.weights, np.float64)
    if not len(w) or not np.all(np.isfinite(w)) or np.any(w <= 0):
      raise ValueError(f"mixture weights must be positive numbers, got {list(self.weights)}")
    object.__setattr__(self, "weights", tuple((w / w.sum()).tolist()))

  def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, that source's places before it) of each position (from 0)."""
    positions = np.asarray(positions, np.int64)
    if not len(positions):
      return positions.copy(), positions.copy()
    first, sources, uses = self._window(int(positions.min()), int(positions.max()) + 1)
    return sources[positions - first], uses[positions - first]

  def counts(self, position: int) -> np.ndarray:
    """int64[K]: each source's places in [0, position)."""
    first, sources, uses = self._window(position, position + 1)
    counts = np.zeros(len(self.weights), np.int64)
    for s in range(len(counts)):  # s's first place at rank >= position: its count before
      mine = np.flatnonzero((sources == s) & (np.arange(len(sources)) >= position - first))
      counts[s] = uses[mine[0]] if len(mine) else _before(self.weights[s], self._end(position))
    return counts

  def _end(self, position: int) -> float:
    return position + len(self.weights) / 2 + 2  # N(t) >= t - K/2: past rank `position`

  def _window(self, lo: int, hi: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(the rank of the first place listed, then each place's source and its count of that
    source's places before it) for at least the ranks [lo, hi): every place in a span of
    time that holds them, in (time, source) order."""
    t0 = max(0.0, lo - len(self.weights) / 2 - 1)  # N(t) <= t + K/2: before rank lo
    t1 = self._end(hi)
    sources, uses, times = [], [], []
    for s, w in enumerate(self.weights):
      k = np.arange(_before(w, t0), _before(w, t1), dtype=np.int64)
      sources.append(np.full(len(k), s, np.int64))
      uses.append(k)
      times.append((k + 0.5) / w)
    sources, uses, times = map(np.concatenate, (sources, uses, times))
    order = np.lexsort((sources, times))
    first = sum(_before(w, t0) for w in self.weights)
    return first, sources[order], uses[order]


def _before(weight: float, t: float) -> int:
  """A source's places (k + 1/2) / weight before time `t`, as the float times compare."""
  k = max(0, int(np.ceil(weight * t - 0.5)))
  while k > 0 and (k - 1 + 0.5) / weight >= t:
    k -= 1
  while (k + 0.5) / weight < t:
    k += 1
  return k


class MixSampler:
  """A process's stream over several sources: `records` and `sources` of its positions.

  The schedule and each source's uses run over the GLOBAL stream, dealt out to the processes
  as the global order deals one dataset (`pipeline.order.sampling`: process p of n takes
  global positions (i // block * n + p) * block + i % block): the global batches, and a
  state's uses, are the same on any process count. `samplers`: each source's own order over
  the whole stream (one process's, of one); `offsets`: where each source's records start in
  the merged index space. Holds a segment (`resume`): from global position `start` on,
  source s's uses continue from `base[s]`. `local`: the block order (the module's
  docstring): the schedule over this process's positions, `samplers` this process's."""

  blocks = None  # the block order is each source's own (`samplers`), none of the mixture's
  shard_records = None
  num_epochs = None  # each source repeats on its own
  kept_fraction = 1.0  # every process reads all of each source over its epochs

  def __init__(
    self,
    schedule: Schedule,
    samplers: Sequence[Sampler],
    offsets: Sequence[int],
    shard_index: int = 0,
    shard_count: int = 1,
    block: int = 1,
    local: bool = False,
  ):
    self.schedule, self.samplers = schedule, list(samplers)
    self.offsets = np.asarray(offsets, np.int64)
    self.shard_index, self.shard_count, self.block = shard_index, shard_count, block
    self.local = local
    self.seed = self.samplers[0].seed
    self.num_records = sum(s.num_records for s in self.samplers)
    self.resume(0, np.zeros(len(self.samplers), np.int64))

  def resume(self, start: int, base: Sequence[int], samplers: Sequence | None = None) -> None:
    """From position `start` on, source s's uses continue from its count `base[s]` (of its
    order in `samplers[s]`, where given: a block order resumed after other layouts)."""
    self.samplers = list(samplers or self.samplers)
    self.start, self.base = int(start), np.asarray(base, np.int64)
    self._shift = self.base - self.schedule.counts(self._scheduled(self.start))

  def used(self, position: int) -> np.ndarray:
    """int64[K]: each source's uses before global `position` (at or after the segment's
    start): over all processes, or in the block order this process's."""
    return self.schedule.counts(self._scheduled(position)) + self._shift

  def _scheduled(self, position: int) -> int:
    """The schedule's position at a state's global position (a whole global batch's)."""
    return position // self.shard_count if self.local else position

  def _places(self, positions: np.ndarray) -> np.ndarray:
    """The schedule's positions of this process's `positions`."""
    return np.asarray(positions, np.int64) if self.local else self.global_positions(positions)

  @property
  def per_epoch(self) -> int:
    """Positions of this process per pass over as many records as all sources hold."""
    return max(1, self.num_records // self.shard_count)

  def __len__(self) -> int:
    return sys.maxsize

  def global_positions(self, positions: np.ndarray) -> np.ndarray:
    """This process's positions as positions of the global stream."""
    block, rest = np.divmod(np.asarray(positions, np.int64), self.block)
    return (block * self.shard_count + self.shard_index) * self.block + rest

  def sources(self, positions: np.ndarray) -> np.ndarray:
    return self.schedule.at(self._places(positions))[0]

  def records(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(epoch of its source, merged record index) of each of this process's positions (at or
    after the segment's start)."""
    return self.planned(positions)[:2]

  def planned(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`records` and `sources` of `positions` from one look-up of the schedule (a batch's)."""
    source, uses = self.schedule.at(self._places(positions))
    uses = uses + self._shift[source]
    epochs, indices = np.zeros_like(uses), np.zeros_like(uses)
    for s in np.unique(source).tolist():
      at = source == s
      epochs[at], local = self.samplers[s].records(uses[at])
      indices[at] = local + self.offsets[s]
    return epochs, indices, source

  @property
  def _blocks(self) -> list:
    """Each source's `Blocks` in the block order, else []."""
    return [s.blocks for s in self.samplers] if self.local else []

  def shares_blocks(self, workers: int) -> bool:
    """In the block order, a block's records fall to every worker process: a source's rounds
    do not follow the batches, whose slots the schedule deals out."""
    return bool(self._blocks) and workers > 1

  def block_pieces(self, workers: int, shared: bool) -> int | None:
    """Every source's blocks read whole (all of one size: `pipeline.mixture`)."""
    return self._blocks[0].block_records if self._blocks else None

  def epoch_requests(self, workers: int, shared: bool) -> float | None:
    """The block reads of this process (of one worker, where the workers share them) an
    epoch of every source."""
    if not self._blocks:
      return None
    return sum(b.count for b in self._blocks) / self.shard_count / (workers if shared else 1)

  @property
  def cuts(self) -> tuple[int, ...]:
    """Every source's `Sampler.cuts`, in the merged index space."""
    if not self.local:
      return ()
    return tuple(c + int(o) for s, o in zip(self.samplers, self.offsets) for c in s.cuts)

  def window_bytes(self, record_bytes: float) -> int:
    """What every source's window holds in this process, together."""
    return sum(s.window_bytes(record_bytes) for s in self.samplers) if self.local else 0
