"""The storage side of the read stage: a shard's records of one batch, fetched and counted.

`Fetcher.fetch` runs on one of the read stage's I/O threads (`pipeline.stages.read`): the record
cache (`pipeline.storage.cache`) answers first; the rest come in one batched read, or in the
block order block by block (`pipeline.storage.ranges`). Each storage request waits for the
request budget's turn (`pipeline.storage.budget.RequestBudget`); from a bucket it runs within
a deadline, as array_record's own client may wait on a stalled connection for many minutes,
and a request that storage answers with "slow down" (429, 503, ...) is read again after a
backoff (`pipeline.storage.remote.retry`). A batch waits for its reads while storage answers
requests (`silence`): time queued behind the budget or the requests in flight is no
deadline's. A corrupt batched or block read is read again
record by record, so each bad record is named and the good ones kept; errors stay with their
slot. `Fetcher.count` adds a finished task to `ReadStats`, in batch order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time

import numpy as np

from pipeline.storage import remote, stalled
from pipeline.storage.blockstore import BlockStore
from pipeline.storage.budget import RequestBudget
from pipeline.storage.cache import RecordCache
from pipeline.storage.ranges import BlockReads
from pipeline.storage.source import CorruptRecordsError, ShardedSource

EWMA = 0.2  # weight of the newest latency measurement


@dataclasses.dataclass
class ReadStats:
  """What the read stage did in this process (for the plan note, benchmarks and tests)."""

  latency_s: float  # moving average of one read task's duration
  record_bytes: float  # moving average of a record's size
  rate_per_s: float = 0.0  # records/s taken from this stage over the controller's last window
  reads: int = 0  # records read from storage
  tasks: int = 0  # read calls (one per shard of a batch)
  cached: int = 0  # records the cache answered
  requests: int = 0  # storage requests: one per record, or per block read whole
  request_bytes: int = 0  # record bytes those requests brought
  request_records: int = 0  # records they served (to batches read ahead too)
  retries: int = 0  # requests read again after storage said "slow down" (429, 503, ...)
  started_s: float | None = None  # perf_counter of the first batch started


class Fetcher:
  """Records of `source` by (shard, index within the shard).

  opened: (seconds, bytes) of one read measured at open (`probe`);
  block_records: records per block read (the block order; None: one batched read per shard
  of a batch); kept_bytes: the most record bytes the block reads keep; max_requests_per_s:
  the request budget (None or inf: none); deadline_s: the longest a request from a bucket
  waits (None: `remote.ATTEMPT_S` x `remote.ATTEMPTS`); epoch_requests: the block reads this
  process makes in an epoch (its own blocks; said in the plan note); store: the host's
  shared blocks (`pipeline.storage.blockstore`), when several workers share a block; cuts:
  the records (of the whole source) where the block reads stop inside a block (`BlockReads`).
  Picklable: counters and the cache's RAM are made anew in each process.
  """

  def __init__(
    self,
    source: ShardedSource,
    opened: tuple[float, float],
    *,
    cache: RecordCache | None = None,
    block_records: int | None = None,
    kept_bytes: int = 0,
    max_requests_per_s: float | None = None,
    deadline_s: float | None = None,
    epoch_requests: float | None = None,
    store: BlockStore | None = None,
    cuts: tuple[int, ...] = (),
  ):
    self.source, self.opened, self.cache = source, opened, cache
    capped = max_requests_per_s and max_requests_per_s < math.inf
    self.budget = RequestBudget(max_requests_per_s) if capped else None
    self.ranges, self.epoch_requests = None, epoch_requests
    if block_records is not None:  # the block order: a block's records in one request
      counts = [b - a for a, b in zip(source.starts, source.starts[1:])]
      self.ranges = BlockReads(
        source.read_range, counts, block_records, kept_bytes, store, _by_shard(source, cuts)
      )
    self.deadline_s = deadline_s
    self._init_runtime()

  def _init_runtime(self):
    self.stats = ReadStats(*self.opened)
    self._lock = threading.Lock()
    self._flight: dict[int, tuple[float, int]] = {}  # request -> (when it began, shard)
    self._answered = 0.0  # when storage last answered a request (time.monotonic)

  def __getstate__(self):
    runtime = ("stats", "_lock", "_flight", "_answered")
    return {k: v for k, v in self.__dict__.items() if k not in runtime}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def wait_s(self, records: int = 0) -> float:
    """The longest a request from a bucket waits (None given: `remote.ATTEMPT_S` x
    `remote.ATTEMPTS`), and a batch of `records` for its reads: plus the budget's turns."""
    wait_s = self.deadline_s or remote.ATTEMPT_S * remote.ATTEMPTS
    return wait_s + (records / self.budget.per_s if self.budget is not None else 0.0)

  def records_per_s(self) -> float | None:
    """The most records a second the request budget lets through (None: no budget)."""
    if self.budget is None:
      return None
    return self.budget.per_s * (self.ranges.block_records if self.ranges is not None else 1)

  def fetch(self, shard: int, indices: list, local: list) -> tuple[list, int, float]:
    """The records `local` of `shard` (`indices`: the same, in the whole source): the
    cache's, then one read of the rest. Returns (records, records read, seconds reading)."""
    with stalled.reading():
      return self._fetch(shard, indices, local)

  def _fetch(self, shard: int, indices: list, local: list) -> tuple[list, int, float]:
    got: list = [None] * len(local)
    todo, waits = [], []
    for k, (index, i) in enumerate(zip(indices, local)):
      found = self.cache.lookup(index, shard, i) if self.cache is not None else None
      if found is None:
        todo.append(k)
      elif isinstance(found, bytes):
        got[k] = found
      else:
        waits.append((k, found))  # another task reads it now
    begin = seconds = time.perf_counter()
    try:
      if todo:
        fresh = self._read_shard(shard, [local[k] for k in todo])
        seconds = time.perf_counter()
        for k, rec in zip(todo, fresh):
          got[k] = rec
          if self.cache is not None and isinstance(rec, bytes):
            self.cache.put(indices[k], shard, local[k], rec)
    finally:
      if self.cache is not None:
        for k in todo:
          self.cache.reading.release(indices[k])
    for k, other in waits:
      other.wait()
      got[k] = self.cache.get(indices[k], shard, local[k])
      if got[k] is None:  # not kept (budget full, or it failed): read it here
        got[k] = self._read_shard(shard, [local[k]])[0]
        todo.append(k)
    return got, len(todo), seconds - begin

  def _read_shard(self, shard: int, local: list) -> list:
    """The records, or for each that is corrupt its error (read one by one after a corrupt
    batched or block read, so each bad one is named and the good ones kept)."""
    try:
      return self._read_storage(shard, local, self.ranges)
    except CorruptRecordsError:
      out = []
      for i in local:
        try:
          out.append(self._read_storage(shard, [i])[0])
        except CorruptRecordsError as e:
          out.append(e)
      return out

  def _read_storage(self, shard: int, local: list, ranges: BlockReads | None = None) -> list:
    """One batched read, or the blocks' reads (each a `_request`)."""
    if ranges is not None:
      return ranges.read(shard, local, self._request)
    return self._request(shard, lambda: self.source.read_shard(shard, local), len(local))

  def _request(self, shard: int, read, requests: int = 1) -> list:
    """`read()` of `shard`, `requests` storage requests (array_record: one per record):
    each time in the request budget's turn; from a bucket, within the deadline
    (`remote.NoAnswer`); read again after a backoff while storage says "slow down"."""

    def attempt():
      if self.budget is not None:
        self.budget.take(requests)
      with self._in_flight(shard):
        return self.source.backends[shard].request(read, self.wait_s())

    return remote.retry(attempt, self.source.paths[shard], self._retried)

  @contextlib.contextmanager
  def _in_flight(self, shard: int):
    """A storage request of `shard` while it runs (`silence` watches it)."""
    key = object()
    with self._lock:
      self._flight[id(key)] = (time.monotonic(), shard)
    try:
      yield
    finally:
      with self._lock:
        del self._flight[id(key)]
        self._answered = time.monotonic()

  def silence(self) -> tuple[float, int] | None:
    """(seconds, shard): how long storage has answered none of this process's requests in
    flight (since the last answer, or since the oldest began) and that request's shard; None
    with none in flight. Time a request waits for the budget's turn, or in the read pool's
    queue, is not silence."""
    with self._lock:
      if not self._flight:
        return None
      began, shard = min(self._flight.values())
      return time.monotonic() - max(began, self._answered), shard

  def _retried(self) -> None:
    with self._lock:
      self.stats.retries += 1

  def count(self, got: list, read: int, seconds: float) -> None:
    """Adds a finished `fetch` (its records, records read, seconds) to the stats."""
    s = self.stats
    s.cached += len(got) - read
    if read:
      size = sum(len(r) for r in got if isinstance(r, bytes)) / len(got)
      s.latency_s += EWMA * (seconds - s.latency_s)
      s.record_bytes += EWMA * (size - s.record_bytes)
      s.reads += read
      s.tasks += 1
      if self.ranges is None:
        s.requests += read
        s.request_records += read
        s.request_bytes += int(size * len(got))

  def counted(self) -> None:
    """The block reads' requests into the stats (once a batch's tasks are counted)."""
    if self.ranges is not None:
      r, s = self.ranges, self.stats
      s.requests, s.request_bytes, s.request_records = r.requests, r.bytes, r.taken


def _by_shard(source: ShardedSource, cuts: tuple[int, ...]) -> dict[int, list[int]]:
  """{shard: its records (indices within it, sorted) among `cuts`}, a shard's first left out."""
  out: dict[int, list[int]] = {}
  starts = np.asarray(source.starts, np.int64)
  for cut in sorted(cuts):
    shard = int(np.searchsorted(starts, cut, side="right")) - 1
    if cut > starts[shard]:
      out.setdefault(shard, []).append(cut - int(starts[shard]))
  return out


def probe(
  source: ShardedSource, reads: int = 3, deadline_s: float | None = None
) -> tuple[float, float]:
  """(seconds, bytes) of one record read, the shard already open: the fastest of a few
  (a loaded machine's stalls are not storage latency). The host plan (`pipeline.planner`)
  starts from it before the read stage measures its own reads. On a mount each read waits at
  most `deadline_s`."""
  path, storage = source.paths[0], source.backends[0]  # a bucket's: with deadlines, retries
  read = lambda indices: storage.guard(lambda: source.read(indices), path, deadline_s)
  read([0])  # opens the first shard (its footer reads cost latency too)
  times, sizes = [], []
  for index in range(1, min(reads, len(source) - 1) + 1) or [0]:
    begin = time.perf_counter()
    sizes.append(len(read([index])[0]))
    times.append(time.perf_counter() - begin)
  return min(times), float(np.mean(sizes))
