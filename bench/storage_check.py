"""The doctor's storage check: how fast DATA_DIR answers reads, one at a time and many at once.

Reads single records of the split at random on 1, 16 and 128 threads (one ArrayRecord reader
per shard, opened first and timed apart) and reports per level the latency of a read
(median, p90), records/s and MB/s, and the concurrency where throughput stops growing. From
the latency and a decode rate it derives, by Little's law (reads in flight = rate x
latency), what the pipeline will keep in flight, what a host of N cores needs, and the GET
rate and GET cost of an epoch on a bucket (one GET per record read, ~2 per shard opened;
the price per 1,000 GETs is a flag: GCS class B operations, $0.0004 in 2025), and in the
block order (`pipeline.order.blocks`). When throughput stops growing while the latency of more
reads in flight grows, requests queue at a rate cap: the report names the request budget.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading
import time

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from pipeline.catalog import manifest as manifest_lib
from pipeline.order import blocks
from pipeline.stages.read import reads_in_flight
from pipeline.storage.source import READER_OPTIONS

LEVELS = (1, 16, 128)
GET_PRICE_PER_1000 = 0.0004  # USD; GCS class B (object reads), standard storage
READS_PER_OPEN = 2  # an ArrayRecord reader's open reads its footer and index: 2 requests
# (126 KB) on a 1.2 MB shard through bench/rig.py with the pipeline's reader options
SATURATED = 0.9  # a level within this share of the best throughput counts as saturated
QUEUED = 2.0  # latency this many times a lower level's, at more in flight: a queue
FLAT = 1.25  # throughput growing less than this from one level to the next: flat
LITTLE = 0.5  # a queue at a rate cap: latency at least this share of in flight / throughput
UNDER = 0.95  # performance.max_requests_per_s advised: this share of the requests/s ceiling
IDLE = 0.5  # CPU cores busy below this while reads wait: the process is not what stops them


@dataclasses.dataclass
class Level:
  """Reads at one concurrency: latency of each read, and the throughput of all together."""

  concurrency: int
  reads: int
  median_ms: float
  p90_ms: float
  records_per_s: float
  mb_per_s: float
  cpu_cores: float  # CPU seconds of this process per second: near the core count = CPU-bound


@dataclasses.dataclass
class StorageCheck:
  data_dir: str
  records: int
  shards: int
  record_kb: float  # mean size of the records read
  open_ms: float  # median time to open one shard's reader (its footer and index reads)
  levels: list[Level]

  @property
  def latency_s(self) -> float:
    """One read's latency when alone (the median at concurrency 1)."""
    return self.levels[0].median_ms / 1e3

  @property
  def saturates_at(self) -> int:
    """The lowest measured concurrency within 90% of the best throughput."""
    best = max(x.records_per_s for x in self.levels)
    return next(x.concurrency for x in self.levels if x.records_per_s >= SATURATED * best)

  def request_budget_per_s(self, cores: int) -> float | None:
    """The requests/s storage answers however many are in flight, when that binds: between
    two levels throughput stays flat (grows < FLAT x) while the latency grows (>= QUEUED x)
    as requests queuing at a rate cap make it (Little's law: at least LITTLE x in flight /
    throughput), and the CPU issuing them is not what stops it. None otherwise: reads that
    wait for a CPU (a loaded machine) are flat with a latency far under Little's."""
    for a, b in zip(self.levels, self.levels[1:]):
      flat = b.records_per_s < FLAT * a.records_per_s
      idle = b.cpu_cores < min(IDLE, 0.75 * cores)
      little = b.median_ms >= LITTLE * 1e3 * b.concurrency / max(b.records_per_s, 1e-9)
      if flat and b.median_ms >= QUEUED * a.median_ms and little and idle:
        return max(x.records_per_s for x in self.levels)
    return None


def _open(paths: list[str]) -> tuple[list[ArrayRecordReader], float]:
  """One reader per shard, opened on 16 threads; the median seconds an open took."""
  took = [0.0] * len(paths)

  def open_one(i):
    start = time.perf_counter()
    reader = ArrayRecordReader(paths[i], READER_OPTIONS)
    took[i] = time.perf_counter() - start
    return reader

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    readers = list(pool.map(open_one, range(len(paths))))
  return readers, float(np.median(took))


def _level(tasks: list[tuple[ArrayRecordReader, int]], threads: int) -> tuple[Level, list[int]]:
  """Runs the (reader, index) reads on `threads` threads, each taking the next one."""
  latencies, nbytes = [0.0] * len(tasks), [0] * len(tasks)
  todo, lock = iter(range(len(tasks))), threading.Lock()

  def work():
    while True:
      with lock:
        i = next(todo, None)
      if i is None:
        return
      reader, index = tasks[i]
      begin = time.perf_counter()
      nbytes[i] = len(reader.read([index])[0])
      latencies[i] = time.perf_counter() - begin

  workers = [threading.Thread(target=work) for _ in range(threads)]
  begin, cpu = time.perf_counter(), time.process_time()
  for t in workers:
    t.start()
  for t in workers:
    t.join()
  seconds, cpu = time.perf_counter() - begin, time.process_time() - cpu
  ms = np.asarray(latencies) * 1e3
  level = Level(
    threads,
    len(tasks),
    round(float(np.median(ms)), 3),
    round(float(np.percentile(ms, 90)), 3),
    round(len(tasks) / seconds, 1),
    round(sum(nbytes) / seconds / 1e6, 1),
    round(cpu / seconds, 2),
  )
  return level, nbytes


def measure(
  data_dir: str, split: str = "train", levels=LEVELS, reads_per_level: int = 256, seed: int = 0
) -> StorageCheck:
  """Times `reads_per_level` random single-record reads (at least 2 per thread) at each
  concurrency in `levels`, each read a fresh record of the split where it has enough."""
  meta = manifest_lib.load(data_dir)
  paths = [os.fspath(p) for p in meta.shard_paths(data_dir, split)]
  counts = [s.num_records for s in meta.splits[split].shards]
  readers, open_s = _open(paths)
  starts = np.cumsum([0, *counts])
  rng = np.random.default_rng(seed)
  results, sizes = [], []
  try:
    for level in levels:
      n = max(reads_per_level, 2 * level)
      order = rng.permutation(max(starts[-1], n))[:n] % starts[-1]  # fresh records first
      where = np.searchsorted(starts, order, side="right") - 1
      tasks = [(readers[s], int(i - starts[s])) for s, i in zip(where, order, strict=True)]
      result, nbytes = _level(tasks, level)
      results.append(result)
      sizes += nbytes
  finally:
    for r in readers:
      r.close()
  return StorageCheck(
    os.fspath(data_dir),
    int(starts[-1]),
    len(paths),
    round(float(np.mean(sizes)) / 1e3, 1),
    round(open_s * 1e3, 2),
    results,
  )


@dataclasses.dataclass
class Advice:
  """What the check means for a decode rate (images/s of this process, and of a host)."""

  rate_per_s: float  # this process, as measured or modelled
  keep_in_flight: int  # what the pipeline's read stage keeps for that rate
  host_cores: int
  host_rate_per_s: float
  host_needs_in_flight: int  # Little's law for the host's rate, no headroom
  gets_per_s: float  # the host's
  gets_per_epoch: int
  cost_per_epoch: float  # USD, at price_per_1000
  price_per_1000: float


def advise(
  check: StorageCheck,
  rate_per_s: float,
  host_cores: int,
  host_rate_per_s: float,
  price_per_1000: float = GET_PRICE_PER_1000,
  processes: int = 1,
) -> Advice:
  """Little's law on the measured latency; GETs: one per record, READS_PER_OPEN per shard
  opened by each of `processes` processes."""
  gets = check.records + READS_PER_OPEN * check.shards * processes
  return Advice(
    rate_per_s,
    reads_in_flight(rate_per_s, check.latency_s),
    host_cores,
    host_rate_per_s,
    max(1, math.ceil(host_rate_per_s * check.latency_s)),
    host_rate_per_s,
    gets,
    gets * price_per_1000 / 1000,
    price_per_1000,
  )


def report(
  check: StorageCheck, advice: Advice | None = None, block_records: int | None = None
) -> str:
  """The check as a table and, with advice, what it means, in a few lines; the block order's
  figures at `block_records` (default: the pipeline's for records of this size)."""
  k = block_records or blocks.block_records(check.record_kb * 1e3)
  lines = [
    f"Storage: {check.records} records in {check.shards} shards ({check.record_kb:.0f} KB "
    f"per record read); opening a shard's reader takes {check.open_ms:.1f} ms (median)",
    "",
    "| reads in flight | latency median (ms) | p90 (ms) | records/s | MB/s | CPU cores busy |",
    "|---:|---:|---:|---:|---:|---:|",
  ]
  lines += [
    f"| {x.concurrency} | {x.median_ms:.2f} | {x.p90_ms:.2f} | {x.records_per_s:,.0f} | "
    f"{x.mb_per_s:,.1f} | {x.cpu_cores:.2f} |"
    for x in check.levels
  ]
  tried = ", ".join(str(x.concurrency) for x in check.levels)
  top = next(x for x in check.levels if x.concurrency == check.saturates_at)
  cores = len(os.sched_getaffinity(0))
  bound = (
    f"; this machine's CPU binds there ({top.cpu_cores:.1f} of {cores} cores busy issuing "
    "reads), so the storage itself may go further"
    if top.concurrency > 1 and top.cpu_cores >= 0.75 * cores
    else ""
  )
  lines.append(
    f"\nThroughput saturates at {check.saturates_at} read(s) in flight (of {tried} tried){bound}."
  )
  budget = check.request_budget_per_s(cores)
  if budget:
    lines.append(
      f"The request budget binds: storage answers ~{budget:,.0f} reads/s however many are in "
      f"flight (latency grows to {check.levels[-1].median_ms:,.0f} ms instead). One request "
      f"per image caps a run near {budget:,.0f} images/s; the block order (order='blocks', "
      f"the default for a bucket) reads {k} records a request: up to "
      f"~{budget * k:,.0f} images/s. Set performance.max_requests_per_s="
      f"{math.floor(UNDER * budget)} so reads ahead wait their turn in the pipeline, not at "
      "storage."
    )
  if advice:
    a = advice
    lines += [
      f"At {a.rate_per_s:,.0f} images/s (what the cores decode when no read waits) this "
      f"process keeps ~{a.keep_in_flight} reads in flight ({check.latency_s * 1e3:.1f} ms x "
      "rate, with headroom).",
      f"A host of {a.host_cores} cores at {a.host_rate_per_s:,.0f} images/s needs "
      f"{a.host_needs_in_flight:,} reads in flight (Little's law: rate x latency); from a "
      f"bucket that is {a.gets_per_s:,.0f} GET/s.",
      f"An epoch is {a.gets_per_epoch:,} GETs ({check.records:,} records, "
      f"{a.gets_per_epoch - check.records:,} for opening shards: {READS_PER_OPEN} per shard "
      f"and process): ${a.cost_per_epoch:,.4f} at "
      f"${a.price_per_1000:g} per 1,000 (--get-price; GCS class B). In the block order "
      f"(order='blocks', {k} records a request) about 1/{k} of that: "
      f"~{a.gets_per_s / k:,.0f} GET/s for the host.",
    ]
  return "\n".join(lines)
