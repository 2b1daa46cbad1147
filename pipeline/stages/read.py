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

import math
import time

import numpy as np

from pipeline.host import memory, parallelism
from pipeline.stages.ahead import Threads
from pipeline.stages.plan import Batch
from pipeline.storage import backend, blockstore, remote
from pipeline.storage.blockstore import SHM_DIR
from pipeline.storage.budget import ReadAhead, reads_in_flight
from pipeline.storage.cache import RecordCache, record_cache
from pipeline.storage.fetch import Fetcher, ReadStats
from pipeline.storage.source import ShardedSource

__all__ = ["ReadRecords", "ReadStats", "describe", "probe", "reads_in_flight", "requests", "stage"]

MAX_READ_THREADS = 512  # I/O threads per process (started as needed; they wait, not compute)
POLL_S = 1.0  # how often a batch waiting for its reads looks at storage's silence


class ReadRecords:
  """The read stage (an `AheadIterDataset` stage): fills `batch.records`, the reads of a batch
  started at once (one `fetcher.fetch` per shard of the batch, on the I/O threads) and
  finished in order, `ahead.depth()` batches ahead; `memory`: the host's memory split it was
  planned within (`pipeline.host.memory`). Picklable: threads, counters and the cache's RAM
  are made anew in each process."""

  def __init__(self, fetcher: Fetcher, ahead: ReadAhead, memory: memory.Split | None = None):
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
  spec, meta, source, pins, sampler, chosen, arena_bytes: int = 0, held_bytes: int = 0
) -> ReadRecords:
  """`spec`'s read stage: read-ahead for the latency measured now, the record cache first, both
  within the memory budget (`pipeline.host.memory`; `arena_bytes`: a decode thread's arena,
  `held_bytes`: the batches the host's processes hold); the choices printed once."""
  perf = spec.performance
  latency_s, record_bytes = probe(source, deadline_s=perf.read_deadline_s)
  cache = record_cache(meta, spec.split, perf, latency_s, record_bytes, chosen, sampler, pins)
  window_bytes = sampler.window_bytes(record_bytes)
  split = memory.fit(
    memory.budget(perf.memory_mb),
    workers=chosen.workers,
    read_ahead=int(perf.read_ahead_mb * 2**20),
    least_read_ahead=int(spec.batch_size * record_bytes),
    record_cache=cache.ram_bytes if cache is not None else 0,
    blocks=2 * window_bytes,
    batches=held_bytes,
    working=memory.working(chosen.threads, arena_bytes, spec.batch_size * record_bytes),
    worker_bytes=int(parallelism.worker_mb(perf.worker_jax) * memory.MB),
  )
  wanted = cache.ram_bytes if cache is not None else 0
  if cache is not None and cache.ram_bytes > split.per_process("record_cache"):
    cache.ram_bytes = split.per_process("record_cache")
    cache = cache if cache.ram_bytes or cache.directory else None
  ahead_bytes = split.per_process("read_ahead")
  store = None
  if sampler.shares_blocks(chosen.workers) and blockstore.available():
    # each worker publishes about 1/workers of the blocks: its share of two windows
    store = blockstore.BlockStore.new(ahead_bytes + 2 * window_bytes // chosen.workers)
  fetcher = Fetcher(
    source,
    (latency_s, record_bytes),
    cache=cache,
    block_records=sampler.block_pieces(chosen.workers, store is not None),
    kept_bytes=ahead_bytes + 2 * window_bytes,
    max_requests_per_s=perf.max_requests_per_s and perf.max_requests_per_s / max(1, chosen.workers),
    deadline_s=perf.read_deadline_s,
    epoch_requests=sampler.epoch_requests(chosen.workers, store is not None),
    store=store,
  )
  ahead = ReadAhead(
    fetcher,
    batch_size=spec.batch_size,
    rate_per_s=parallelism.project(parallelism.available_cores(), parallelism.COSTS, chosen)
    / max(1, chosen.workers),
    ahead_bytes=ahead_bytes,
    max_depth=perf.read_ahead,
  )
  read = ReadRecords(fetcher, ahead, split)
  parallelism.announce(chosen, describe(read, cache, wanted), split.describe())
  return read


def probe(
  source: ShardedSource, reads: int = 3, deadline_s: float | None = None
) -> tuple[float, float]:
  """(seconds, bytes) of one record read, the shard already open: the fastest of a few
  (a loaded machine's stalls are not storage latency). The read stage starts from it
  before it measures its own reads. On a mount each read waits at most `deadline_s`."""
  path, storage = source.paths[0], source.backends[0]  # a bucket's: with deadlines, retries
  read = lambda indices: storage.guard(lambda: source.read(indices), path, deadline_s)
  read([0])  # opens the first shard (its footer reads cost latency too)
  times, sizes = [], []
  for index in range(1, min(reads, len(source) - 1) + 1) or [0]:
    begin = time.perf_counter()
    sizes.append(len(read([index])[0]))
    times.append(time.perf_counter() - begin)
  return min(times), float(np.mean(sizes))


def describe(read: ReadRecords, cache: RecordCache | None, wanted: int = 0) -> str:
  """The read plan in one line, as make_dataset prints it; `wanted`: the record cache's RAM
  before the memory budget cut it."""
  s, depth = read.stats, read.depth()
  held = depth * read.batch_size * s.record_bytes / 2**20
  ceiling = read.bounds()[1]
  ram = cache.ram_bytes if cache is not None else 0
  cut = f" of the {wanted / 2**20:,.0f} MB it wanted: performance.memory_mb" if wanted > ram else ""
  if cache is None and cut:
    kept = f"record cache off: the memory budget left none{cut}"
  elif cache is None:
    kept = "record cache off (performance.record_cache_mb / record_cache_dir)"
  else:
    where = [f"{cache.ram_bytes / 2**20:,.0f} MB RAM"] if cache.ram_bytes else []
    where += [cache.directory] if cache.directory else []
    kept = "record cache " + " + ".join(where) + (f" ({cut.lstrip()})" if cut else "")
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
    if read.fetcher.epoch_requests:
      plan += f", about {read.fetcher.epoch_requests:,.0f} an epoch from this process's own blocks"
    if r.store is not None:
      kept = f"each read once for the host's worker processes, shared in {SHM_DIR}"
      plan += f" ({kept}, each keeping {r.store.budget_bytes / 2**20:,.0f} MB of them)"
    else:
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
