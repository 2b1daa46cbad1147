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
measured latency grows: following it, more reads would only queue longer): the read-ahead
policy, `pipeline.storage.budget.ReadAhead`. Each read is a `pipeline.storage.fetch.Fetcher`'s:
the record cache (`pipeline.storage.cache`) answers before storage; a read that storage
answers with "slow down" (429, 503, ...) is read again after a backoff
(`pipeline.storage.remote.retry`) and halves the depth. Read errors stay with their slot; the
decode stage applies the error policy. A batch waits for its reads as long as storage answers
this process's requests; once storage has answered none in flight for a deadline
(`performance.read_deadline_s`; time queued behind the request cap or other requests is not
counted) it raises one line naming the shard: a read blocked in its syscall on a stalled FUSE
mount cannot be interrupted, but the iterator need not wait for it.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from pipeline.host.memory import Split
from pipeline.stages.ahead import Threads
from pipeline.stages.plan import Batch
from pipeline.storage import backend, blockstore, remote
from pipeline.storage.blockstore import SHM_DIR
from pipeline.storage.budget import ReadAhead, reads_in_flight
from pipeline.storage.cache import RecordCache
from pipeline.storage.fetch import Fetcher, ReadStats
from pipeline.storage.source import ShardedSource

__all__ = ["ReadPlan", "ReadRecords", "ReadStats", "reads_in_flight", "requests", "stage"]

MAX_READ_THREADS = 512  # I/O threads per process (started as needed; they wait, not compute)
POLL_S = 1.0  # how often a batch waiting for its reads looks at storage's silence


@dataclasses.dataclass(frozen=True)
class ReadPlan:
  """The read stage's numbers for one process, as the host plan (`pipeline.planner`) decided
  them: a read measured at open, the read-ahead, the record cache and the storage requests."""

  latency_s: float  # one record read at open (`pipeline.storage.fetch.probe`)
  record_bytes: float  # and its size
  batch_size: int
  rate_per_s: float  # the records/s this process is planned to decode
  ahead_bytes: int  # the most record bytes of batches read ahead
  depth: tuple[int, int]  # (floor, ceiling) of the batches read ahead at open (`ReadAhead`)
  max_depth: int | None = None  # performance.read_ahead
  cache_bytes: int = 0  # the record cache's RAM
  cache_wanted: int = 0  # and what it wanted before the memory budget cut it
  cache_dir: str | None = None  # performance.record_cache_dir
  block_records: int | None = None  # records a block read brings (None: one read per shard)
  kept_bytes: int = 0  # the most record bytes block reads keep
  store_bytes: int | None = None  # each worker's part of the host's shared blocks (None: none)
  cuts: tuple[int, ...] = ()  # records where block reads stop: shares cut at records
  epoch_requests: float | None = None  # the block reads of this process in an epoch
  max_requests_per_s: float | None = None  # this process's request budget
  deadline_s: float | None = None  # performance.read_deadline_s

  def describe(self) -> str:
    """The read plan in one line, as make_dataset prints it."""
    depth, ceiling = self.depth
    held = depth * self.batch_size * self.record_bytes / 2**20
    wanted, ram = self.cache_wanted, self.cache_bytes
    cut = f" of the {wanted / 2**20:,.0f} MB it wanted: performance.memory_mb" * (wanted > ram)
    if not (ram or self.cache_dir) and cut:
      kept = f"record cache off: the memory budget left none{cut}"
    elif not (ram or self.cache_dir):
      kept = "record cache off (performance.record_cache_mb / record_cache_dir)"
    else:
      where = [f"{ram / 2**20:,.0f} MB RAM"] if ram else []
      where += [self.cache_dir] if self.cache_dir else []
      kept = "record cache " + " + ".join(where) + (f" ({cut.lstrip()})" if cut else "")
    per_s = self.max_requests_per_s
    planned = _requests(
      self.block_records,
      self.epoch_requests,
      self.store_bytes,
      self.kept_bytes,
      per_s if per_s and per_s < math.inf else None,
    )
    return (
      f"reads: {self.latency_s * 1e3:.1f} ms per read at open -> {depth} batches read ahead "
      f"(up to {depth * self.batch_size} reads in flight, ~{held:.0f} MB; up to {ceiling} "
      f"batches while throughput grows with them; performance.read_ahead overrides); {kept}; "
      f"{planned}"
    )


class ReadRecords:
  """The read stage (an `AheadIterDataset` stage): fills `batch.records`, the reads of a batch
  started at once (one `fetcher.fetch` per shard of the batch, on the I/O threads) and
  finished in order, `ahead.depth()` batches ahead; `memory`: the host's memory split it was
  planned within (`pipeline.host.memory`). Picklable: threads, counters and the cache's RAM
  are made anew in each process."""

  def __init__(self, fetcher: Fetcher, ahead: ReadAhead, memory: Split | None = None):
    self.fetcher, self.ahead, self.memory = fetcher, ahead, memory
    self.threads = Threads(MAX_READ_THREADS, "pipeline-read")

  source = property(lambda self: self.fetcher.source)
  cache = property(lambda self: self.fetcher.cache)
  ranges = property(lambda self: self.fetcher.ranges)
  budget = property(lambda self: self.fetcher.budget)
  stats = property(lambda self: self.fetcher.stats)
  control = property(lambda self: self.ahead.control)
  batch_size = property(lambda self: self.ahead.batch_size)

  def bounds(self) -> tuple[int, int]:
    """(floor, ceiling) of the batches to keep reading (`ReadAhead.bounds`)."""
    return self.ahead.bounds()

  def depth(self) -> int:
    """Batches to keep reading (`ReadAhead.depth`)."""
    return self.ahead.depth()

  def start(self, batch: Batch) -> tuple[Batch, list]:
    if self.stats.started_s is None:
      self.stats.started_s = time.perf_counter()
    source = self.source
    batch.records, batch.where = [None] * len(batch.indices), source.where
    slots = np.flatnonzero(batch.real)
    wanted = batch.indices[slots]
    shards = source.shards_of(wanted)
    local = wanted - np.asarray(source.starts, np.int64)[shards]
    order = np.argsort(shards, kind="stable")  # one batched read per shard of the batch
    groups = np.split(order, np.flatnonzero(np.diff(shards[order])) + 1) if len(order) else []
    futures = []
    for at in groups:
      shard = int(shards[at[0]])
      read = self.threads.submit(self.fetcher.fetch, shard, wanted[at].tolist(), local[at].tolist())
      futures.append((shard, slots[at].tolist(), read))
    return batch, futures

  def finish(self, started: tuple[Batch, list]) -> Batch:
    batch, futures = started
    for shard, slots, future in futures:
      got, read, seconds = self._result(future, shard)
      for slot, rec in zip(slots, got):
        batch.records[slot] = rec
      self.fetcher.count(got, read, seconds)
    self.fetcher.counted()
    self.ahead.finished(time.perf_counter(), len(batch.indices))
    return batch

  def _result(self, future, shard: int) -> tuple:
    """`future`'s (records, read, seconds), waiting as long as storage answers this process's
    requests; `remote.no_answer` once it has answered none in flight for the deadline."""
    while True:
      try:
        return future.result(POLL_S)
      except TimeoutError as e:  # a gs:// read's `remote.NoAnswer`, or no result yet
        if future.done():
          if not isinstance(e, remote.NoAnswer):  # the read's own error
            raise
          silent = (math.inf, shard)  # a gs:// read past its deadline
        else:
          silent = self.fetcher.silence() or (0.0, shard)
        if silent[0] >= self.fetcher.wait_s():
          path = self.source.paths[silent[1]]
          raise remote.no_answer(path, self.fetcher.wait_s(), backend.DEADLINE) from None


def stage(
  source: ShardedSource,
  plan: ReadPlan,
  split: Split | None = None,
  cache: RecordCache | None = None,
) -> ReadRecords:
  """The read stage of `plan` over `source` (`split`: the memory split it was planned within,
  `cache`: its record cache): the host's shared blocks where the plan shares them."""
  store = None if plan.store_bytes is None else blockstore.BlockStore.new(plan.store_bytes)
  fetcher = Fetcher(
    source,
    (plan.latency_s, plan.record_bytes),
    cache=cache,
    block_records=plan.block_records,
    kept_bytes=plan.kept_bytes,
    max_requests_per_s=plan.max_requests_per_s,
    deadline_s=plan.deadline_s,
    epoch_requests=plan.epoch_requests,
    store=store,
    cuts=plan.cuts,
  )
  ahead = ReadAhead(
    fetcher,
    batch_size=plan.batch_size,
    rate_per_s=plan.rate_per_s,
    ahead_bytes=plan.ahead_bytes,
    max_depth=plan.max_depth,
  )
  return ReadRecords(fetcher, ahead, split)


def requests(read: ReadRecords) -> str:
  """The storage requests: how they are planned and, once made, the counts."""
  s, r, budget = read.stats, read.ranges, read.budget
  plan = _requests(
    None if r is None else r.block_records,
    read.fetcher.epoch_requests,
    None if r is None or r.store is None else r.store.budget_bytes,
    None if r is None else r.budget_bytes,
    None if budget is None else budget.per_s,
  )
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


def _requests(block_records, epoch_requests, store_bytes, kept_bytes, per_s) -> str:
  """The storage requests as planned: per record, or per block (shared by the host's workers
  in `store_bytes` each, or kept within `kept_bytes`), within `per_s` a second."""
  if block_records is None:
    plan = "requests: one per record (order='global')"
  else:
    plan = f"requests: one per block of {block_records} records"
    if epoch_requests:
      plan += f", about {epoch_requests:,.0f} an epoch from this process's own blocks"
    if store_bytes is not None:
      kept = f"each read once for the host's worker processes, shared in {SHM_DIR}"
      plan += f" ({kept}, each keeping {store_bytes / 2**20:,.0f} MB of them)"
    else:
      plan += f" (order='blocks'; blocks kept within {kept_bytes / 2**20:,.0f} MB)"
  if per_s:
    plan += f", at most {per_s:,.6g}/s (performance.max_requests_per_s)"
  return plan
