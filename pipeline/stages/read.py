"""Stage 2, read: the records of the next batches, fetched ahead with many reads in flight.

On remote storage (a bucket through gcsfuse or `gs://`) each read waits 5-100 ms for its
first byte, so reads must overlap: by Little's law a process decoding R images/s from
storage of latency L needs R x L reads in flight. The plan of every future batch is known
(`pipeline.stages.plan`), so `ReadRecords` starts the reads of the next `depth()` batches all at
once on its I/O threads, one batched read per shard of a batch (through the rig at 20 ms:
1.8x the rate of one task per record, whose Python per read costs more than array_record's
own pool saves); decode threads never wait on storage. The depth is Little's law on the
latency measured at open and the rate records are taken (at least the one the host plan
projects); above it, `pipeline.storage.budget.Controller` adds batches only while the throughput
grows with them, within the bytes it may hold (behind a request cap, reads queue and their
measured latency grows: following it, more reads would only queue longer). A read that
storage answers with "slow down" (429, 503, ...) is read again after a backoff
(`pipeline.storage.remote.retry`) and halves the depth. The record cache (`pipeline.storage.cache`)
answers before storage. Read errors stay with their slot; the decode stage applies the error policy.
A batch waits for its reads at most a deadline (`performance.read_deadline_s`), then raises one line
naming the shard: a read blocked in its syscall on a stalled FUSE mount cannot be interrupted, but
the iterator need not wait for it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import numpy as np

from pipeline.stages.ahead import Threads
from pipeline.stages.plan import Batch
from pipeline.storage import remote
from pipeline.storage.budget import Controller, RequestBudget
from pipeline.storage.cache import RecordCache
from pipeline.storage.ranges import BlockReads
from pipeline.storage.source import CorruptRecordsError, ShardedSource

DEADLINE = "performance.read_deadline_s"
HEADROOM = 2.0  # reads in flight per Little's law, times this: latency and rate vary
MAX_READ_THREADS = 512  # I/O threads per process (started as needed; they wait, not compute)
EWMA = 0.2  # weight of the newest latency measurement
WINDOW = 4  # batches (at least the depth) per throughput measurement of the controller
GROWTH = 8  # the controller's depth: at most this times the floor


def reads_in_flight(rate_per_s: float, latency_s: float) -> int:
  """Reads to keep in flight for `rate_per_s` records/s at `latency_s` per read."""
  return max(1, math.ceil(HEADROOM * rate_per_s * latency_s))


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


class ReadRecords:
  """The read stage (an `AheadIterDataset` stage): fills `batch.records`.

  rate_per_s: the decode rate this process is planned for (records/s); latency_s: one read's
  latency measured at open; ahead_bytes: the most record bytes held by batches read ahead;
  block_records: records per block read (the block order); window_bytes: the bytes of the
  blocks a window of the block order holds in this process (blocks read whole are kept
  within ahead_bytes + two windows: `pipeline.storage.ranges`); epoch_requests: the block reads this
  process makes in an epoch (of its own blocks); deadline_s: the longest a batch waits for its
  reads (None: `remote.ATTEMPT_S` x `remote.ATTEMPTS`, gs:// reads' deadline).
  Picklable: threads, counters and the cache's RAM are made anew in each process.
  """

  def __init__(
    self,
    source: ShardedSource,
    *,
    batch_size: int,
    rate_per_s: float,
    latency_s: float,
    record_bytes: float,
    ahead_bytes: int,
    cache: RecordCache | None = None,
    max_depth: int | None = None,
    block_records: int | None = None,
    max_requests_per_s: float | None = None,
    window_bytes: int = 0,
    epoch_requests: float | None = None,
    deadline_s: float | None = None,
  ):
    self.source, self.batch_size, self.cache = source, batch_size, cache
    capped = max_requests_per_s and max_requests_per_s < math.inf
    self.budget = RequestBudget(max_requests_per_s) if capped else None
    self.ranges, self.epoch_requests = None, epoch_requests
    if block_records is not None:  # the block order: a block's records in one request
      counts = [b - a for a, b in zip(source.starts, source.starts[1:])]
      kept = ahead_bytes + 2 * window_bytes
      self.ranges = BlockReads(source.read_range, counts, block_records, kept)
    self.rate_per_s, self.ahead_bytes, self.max_depth = rate_per_s, ahead_bytes, max_depth
    self.deadline_s = deadline_s
    self._initial = (latency_s, record_bytes)
    self.threads = Threads(MAX_READ_THREADS, "pipeline-read")
    self._init_runtime()

  _RUNTIME = ("stats", "control", "_window", "_slowed", "_lock")

  def _init_runtime(self):
    self.stats = ReadStats(*self._initial)
    self._window = (None, 0)  # (when the controller's window began, batches in it)
    self.control = Controller(self.bounds()[0])
    self._slowed = 0  # retries the controller has been told of
    self._lock = threading.Lock()

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def bounds(self) -> tuple[int, int]:
    """(floor, ceiling) of the batches to keep reading: Little's law for the planned (or
    measured, when higher) rate at the latency measured at open; `GROWTH` times that, within
    the bytes allowed. Both within `performance.read_ahead`, and under a request budget
    within what the budget's rate needs at the latency measured at open."""
    s = self.stats
    rate = max(self.rate_per_s, s.rate_per_s)
    if self.budget is not None:
      per_request = self.ranges.block_records if self.ranges is not None else 1
      rate = min(rate, self.budget.per_s * per_request)
    floor = 1 + math.ceil(reads_in_flight(rate, self._initial[0]) / self.batch_size)
    ceiling = max(1, int(self.ahead_bytes // max(1.0, s.record_bytes * self.batch_size)))
    if self.budget is not None:
      ceiling = min(ceiling, floor)
    ceiling = min(ceiling, GROWTH * floor, self.max_depth or ceiling)
    return min(floor, ceiling), ceiling

  def depth(self) -> int:
    """Batches to keep reading: the controller's depth, within `bounds()`'s ceiling."""
    return min(self.control.depth, self.bounds()[1])

  def start(self, batch: Batch) -> tuple[Batch, list]:
    if self.stats.started_s is None:
      self.stats.started_s = time.perf_counter()
    n = len(batch.indices)
    batch.records, batch.where = [None] * n, self.source.where
    slots = np.flatnonzero(batch.real)
    wanted = batch.indices[slots]
    shards = self.source.shards_of(wanted)
    local = wanted - np.asarray(self.source.starts, np.int64)[shards]
    order = np.argsort(shards, kind="stable")  # one batched read per shard of the batch
    groups = np.split(order, np.flatnonzero(np.diff(shards[order])) + 1) if len(order) else []
    futures = []
    for at in groups:
      task = (int(shards[at[0]]), slots[at].tolist(), wanted[at].tolist(), local[at].tolist())
      futures.append((task[0], self.threads.submit(self._read, *task)))
    return batch, futures

  def _read(self, shard: int, slots: list, indices: list, local: list) -> tuple:
    """One shard's records of a batch, on an I/O thread: the cache's, then one batched
    read of the rest. Returns (slots, records, records read, seconds reading)."""
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
    return slots, got, len(todo), seconds - begin

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
    each time in the request budget's turn; from a bucket, within a deadline
    (`remote.NoAnswer`), as array_record's own client may wait on a stalled connection for
    many minutes; read again after a backoff while storage says "slow down"."""

    def attempt():
      if self.budget is not None:
        self.budget.take(requests)
      if remote.scheme(self.source.paths[shard]) is None:
        return read()
      return remote.within(read, self._deadline_s())

    return remote.retry(attempt, self.source.paths[shard], self._retried)

  def _deadline_s(self) -> float:
    return self.deadline_s or remote.ATTEMPT_S * remote.ATTEMPTS

  def _retried(self) -> None:
    with self._lock:
      self.stats.retries += 1

  def finish(self, started: tuple[Batch, list]) -> Batch:
    batch, futures = started
    s = self.stats
    deadline_s = self._deadline_s()
    if self.budget is not None:  # the budget's turns are no stall
      deadline_s += len(batch.indices) / self.budget.per_s
    end = time.monotonic() + deadline_s
    for shard, future in futures:
      try:
        slots, got, read, seconds = future.result(max(0.0, end - time.monotonic()))
      except TimeoutError as e:  # a gs:// read's `remote.NoAnswer`, or no result in time
        if future.done() and not isinstance(e, remote.NoAnswer):  # the read's own error
          raise
        raise remote.no_answer(self.source.paths[shard], self._deadline_s(), DEADLINE) from None
      for slot, rec in zip(slots, got):
        batch.records[slot] = rec
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
    if self.ranges is not None:
      r = self.ranges
      s.requests, s.request_bytes, s.request_records = r.requests, r.bytes, r.taken
    self._control(time.perf_counter(), len(batch.indices))
    return batch

  def _control(self, now: float, records: int) -> None:
    """Feeds the controller: a "slow down" at once, the throughput (records/s finished) once
    a window of batches is done."""
    begin, done = self._window
    if self.stats.retries > self._slowed:
      self._slowed = self.stats.retries
      self.control.slowed()
      self._window = (now, 0)
    elif begin is None:
      self._window = (now, 0)  # from the first batch on: its reads started all at once
    elif done + 1 >= max(WINDOW, self.control.depth) and now > begin:
      self.stats.rate_per_s = (done + 1) * records / (now - begin)
      self.control.update(self.stats.rate_per_s, *self.bounds())
      self._window = (now, 0)
    else:
      self._window = (begin, done + 1)


def probe(
  source: ShardedSource, reads: int = 3, deadline_s: float | None = None
) -> tuple[float, float]:
  """(seconds, bytes) of one record read, the shard already open: the fastest of a few
  (a loaded machine's stalls are not storage latency). The read stage starts from it
  before it measures its own reads. On a mount each read waits at most `deadline_s`."""
  path = source.paths[0] if source.paths else ""
  if remote.scheme(path) is not None:  # with deadlines, retries
    read = lambda indices: remote.call(lambda: source.read(indices), path)
  else:
    read = lambda indices: remote.on_mount(lambda: source.read(indices), path, deadline_s, DEADLINE)
  read([0])  # opens the first shard (its footer reads cost latency too)
  times, sizes = [], []
  for index in range(1, min(reads, len(source) - 1) + 1) or [0]:
    begin = time.perf_counter()
    sizes.append(len(read([index])[0]))
    times.append(time.perf_counter() - begin)
  return min(times), float(np.mean(sizes))


def describe(read: ReadRecords, cache: RecordCache | None) -> str:
  """The read plan in one line, as make_dataset prints it."""
  s, depth = read.stats, read.depth()
  held = depth * read.batch_size * s.record_bytes / 2**20
  ceiling = read.bounds()[1]
  if cache is None:
    kept = "record cache off (performance.record_cache_mb / record_cache_dir)"
  else:
    where = [f"{cache.ram_bytes / 2**20:,.0f} MB RAM"] if cache.ram_bytes else []
    where += [cache.directory] if cache.directory else []
    kept = "record cache " + " + ".join(where)
  return (
    f"reads: {s.latency_s * 1e3:.1f} ms per read at open -> {depth} batches read ahead "
    f"(up to {depth * read.batch_size} reads in flight, ~{held:.0f} MB; up to {ceiling} "
    f"batches while throughput grows with them; performance.read_ahead overrides); {kept}; "
    f"{requests(read)}"
  )


def requests(read: ReadRecords) -> str:
  """The storage requests: how they are planned and, once made, the counts."""
  s = read.stats
  if read.ranges is None:
    plan = "requests: one per record (order='global')"
  else:
    r = read.ranges
    plan = f"requests: one per block of {r.block_records} records"
    if read.epoch_requests:
      plan += f", about {read.epoch_requests:,.0f} an epoch from this process's own blocks"
    plan += f" (order='blocks'; blocks kept within {r.budget_bytes / 2**20:,.0f} MB)"
  if read.budget is not None:
    plan += f", at most {read.budget.per_s:,.6g}/s (performance.max_requests_per_s)"
  if not s.requests:
    return plan
  elapsed = time.perf_counter() - s.started_s
  said = (
    f"{plan}, {s.requests:,} made ({s.requests / max(1e-9, elapsed):,.0f}/s), "
    f"{s.request_bytes / s.requests / 1e3:,.0f} KB and "
    f"{s.request_records / s.requests:.1f} images per request; {read.depth()} batches read "
    f"ahead (controller: {read.control.state})"
  )
  return said + (f", {s.retries:,} read again after a slow-down" if s.retries else "")
