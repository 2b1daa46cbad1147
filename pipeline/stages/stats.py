"""What each stage of a stream did, in every process that runs it: `iterator.stats()`.

A `Recorder` belongs to one stream and travels with its stages into Grain's worker processes,
where it starts again from zero (counters are per process). Each stage adds what it did:
elements handed on, the seconds its threads were busy (and their CPU seconds) and each task's
duration (a log2 histogram, for p50/p99), the seconds its consumer waited for it and how many
elements it had started then (queue occupancy). Storage counters come from the read stage's
`ReadStats`. A process's counters ride on every batch it makes (STATS_KEY, a small float64
array, as the skip count does), so the main process sees every worker's latest figures without
a channel of its own; `Stats` turns them into rows over the interval since the previous
`stats()` call, in images per second, names the slowest stage and makes a table, with each
process's memory (RSS), how long it took to start (a worker: interpreter, imports, its stages
unpickled) and whether it loaded JAX (`pipeline.host.light`: workers do not). In a process that
has imported jax, each task is also a profiler trace annotation named `pipeline.STAGE`, with
the `_ipl_stage_*` metadata Grain gives its own stages, so a `jax.profiler` trace shows the
stages beside the steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
import time

import numpy as np

STATS_KEY = "_stats"
STAGES = ("plan", "read", "decode", "finish", "handoff")
_ROW = {stage: row for row, stage in enumerate(STAGES)}
_CATEGORIES = {"read": "read", "handoff": "prefetch"}  # Grain's; the rest "preprocessing"
BINS = 40  # task durations in log2 bins of microseconds: 1 us .. ~6 days
_COUNTS = ("items", "busy_s", "tasks", "wait_s", "waits", "started", "queues", "cpu_s")  # BINS
STORAGE = ("requests", "request_bytes", "request_records", "retries", "reads", "cached")
_HEAD = 2  # the first row: pid, seconds since the recorder's start, RSS, start-up, JAX loaded;
# the second: the storage counters


class Recorder:
  """One stream's counters in this process (thread-safe; made anew when unpickled). It holds
  no stage: stages hold it, and a cycle would keep their thread pools alive until a GC."""

  def __init__(self):
    self._reset()

  def _reset(self):
    self._lock = threading.Lock()
    self._counts = [[0.0] * (len(_COUNTS) + BINS) for _ in STAGES]
    self._start = time.perf_counter()
    self._started_s = process_age()

  def __getstate__(self):
    return {}

  def __setstate__(self, state):
    self._reset()

  def task(self, stage: str, seconds: float, items: int = 0, cpu_s: float = 0.0) -> None:
    """A task of `stage` ran `seconds` on one of its threads, `cpu_s` of them on a CPU
    (`items`: elements it finished)."""
    b = len(_COUNTS) + min(int(math.log2(max(seconds * 1e6, 1.0))), BINS - 1)
    c = self._counts[_ROW[stage]]
    with self._lock:
      c[0] += items
      c[1] += seconds
      c[2] += 1
      c[7] += cpu_s
      c[b] += 1

  def handed(self, stage: str, waited_s: float, started: int | None = None) -> None:
    """`stage` handed on an element after its consumer waited `waited_s`, with `started`
    elements in its queue (None: a queue it does not see)."""
    c = self._counts[_ROW[stage]]
    with self._lock:
      c[0] += 1
      c[3] += waited_s
      c[4] += 1
      if started is not None:
        c[5] += started
        c[6] += 1

  def snapshot(self, read=None) -> np.ndarray:
    """This process's counters as one array (STATS_KEY's value), with the storage counters
    of `read` (the read stage, `pipeline.stages.read.ReadRecords`) when given."""
    out = np.zeros((_HEAD + len(STAGES), len(_COUNTS) + BINS))
    out[0, :5] = (
      os.getpid(),
      time.perf_counter() - self._start,
      rss_bytes(),
      self._started_s,
      "jax" in sys.modules,
    )
    if read is not None:
      s = read.stats
      out[1, : len(STORAGE)] = [getattr(s, name) for name in STORAGE]
    with self._lock:
      out[_HEAD:] = self._counts
    return out


def process_age() -> float:
  """Seconds since this process started (from /proc; NaN where there is none)."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    with open("/proc/uptime") as f:
      return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return math.nan


def rss_bytes() -> int:
  """This process's resident memory (from /proc; 0 where there is none)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0


def annotation(stage: str):
  """A profiler trace annotation for a task of `stage` (none where jax is not imported: a
  worker process, which the profiler does not trace)."""
  jax = sys.modules.get("jax")
  if jax is None:
    return contextlib.nullcontext()
  return jax.profiler.TraceAnnotation(
    f"pipeline.{stage}",
    _ipl_stage_name=stage,
    _ipl_stage_cat=_CATEGORIES.get(stage, "preprocessing"),
  )


class Timed:
  """A map step (`fn`) timed as `stage`; with `read` (the read stage), its output carries
  this process's snapshot."""

  def __init__(self, fn, recorder: Recorder, stage: str, read=None):
    self.fn, self.recorder, self.stage, self.read = fn, recorder, stage, read

  def __call__(self, element):
    t, cpu = time.perf_counter(), time.thread_time()
    with annotation(self.stage):
      out = self.fn(element)
    self.recorder.task(self.stage, time.perf_counter() - t, 1, time.thread_time() - cpu)
    if self.read is not None:
      out[STATS_KEY] = self.recorder.snapshot(self.read)
    return out


@dataclasses.dataclass(frozen=True)
class Row:
  """One stage in one process over the interval (`collect`). `items`: batches it handed on;
  `busy`: its threads' busy seconds per second (threads kept busy), `cpu` their CPU seconds per
  second; `wait_share`: of the interval's seconds, those its consumer waited for it; `queued`:
  elements it had started, on average, when one was asked for (None: not seen)."""

  process: str
  stage: str
  items: int
  images_per_s: float
  busy: float
  wait_share: float
  queued: float | None
  p50_ms: float
  p99_ms: float
  cpu: float = 0.0


@dataclasses.dataclass(frozen=True)
class Process:
  """One process of the stream: its resident memory at its latest batch, the seconds from
  its start to its stages being ready (a worker's start-up), and whether it loaded JAX."""

  process: str
  rss_mb: float
  started_s: float
  jax: bool


@dataclasses.dataclass(frozen=True)
class Storage:
  """Storage requests of every process together."""

  requests: int
  request_bytes: int
  request_records: int
  requests_per_s: float
  kb_per_request: float
  images_per_request: float
  retries: int
  reads: int
  cached: int


@dataclasses.dataclass(frozen=True)
class Stats:
  """`iterator.stats()`: a row per stage and process (the main process first) over the last
  interval, storage, each process's memory and start-up, and the slowest stage: the one that
  held the batches up longest (its consumer waited for it, or it ran in its consumer's
  thread), with the share of the interval it did (of each process that runs the stages), and
  all the stages together did."""

  rows: tuple[Row, ...]
  storage: Storage
  processes: tuple[Process, ...] = ()
  seconds: float = 0.0  # the interval's
  slowest: str | None = None
  slowest_share: float = 0.0
  stages_share: float = 0.0

  def __str__(self) -> str:
    return self.table()

  def table(self) -> str:
    """The rows as a fixed-width table, then the slowest stage and storage (`print(stats)`)."""
    lines = [
      f"{'process':<20}{'stage':<9}{'batches':>8}{'images/s':>9}{'busy':>6}{'wait':>7}"
      f"{'queued':>7}{'p50 ms':>8}{'p99 ms':>8}"
    ]
    for r in self.rows:
      lines.append(
        f"{r.process:<20}{r.stage:<9}{r.items:>8}{r.images_per_s:>9.1f}{r.busy:>6.2f}"
        f"{r.wait_share:>6.0%} {'-' if r.queued is None else f'{r.queued:.1f}':>6}"
        f"{r.p50_ms:>8.2f}{r.p99_ms:>8.2f}"
      )
    lines += [
      f"{p.process}: {p.rss_mb:,.0f} MB resident, "
      + ("" if p.process.startswith("main") else f"started in {p.started_s:.1f} s, ")
      + ("JAX loaded" if p.jax else "no JAX")
      for p in self.processes
    ]
    if self.slowest is not None:
      lines.append(
        f"slowest stage: {self.slowest}, holding the batches up {self.slowest_share:.0%} of the "
        f"last {self.seconds:.1f} s (all stages {self.stages_share:.0%}; the rest: hand-off "
        "and consumer)"
      )
    s = self.storage
    lines.append(
      f"storage: {s.requests} requests ({s.requests_per_s:.0f}/s), {s.kb_per_request:.0f} KB "
      f"and {s.images_per_request:.1f} images each, {s.retries} retries; {s.reads} records "
      f"read, {s.cached} from the record cache"
    )
    return "\n".join(lines)


def collect(
  snapshots: dict[int, np.ndarray],
  main_pid: int,
  batch_size: int = 1,
  since: dict[int, np.ndarray] | None = None,
) -> Stats:
  """`Stats` of the latest snapshot of each process (keyed by pid) over the interval since
  `since` (the snapshots of the previous call; None: since the start), in images of batches
  of `batch_size`."""
  rows, processes, storage = [], [], np.zeros(len(STORAGE))
  seconds = staged = 0.0  # the interval; its seconds in each process that runs the stages
  held = dict.fromkeys(STAGES[:-1], 0.0)  # seconds each stage held its consumer up
  order = sorted(snapshots, key=lambda pid: (pid != main_pid, pid))
  for n, pid in enumerate(order):
    snap = snapshots[pid]
    before = (since or {}).get(pid)
    if before is not None:
      snap = np.concatenate([snap[:1], snap[1:] - before[1:]])
      snap[0, 1] -= before[0, 1]
    elapsed = max(float(snap[0, 1]), 1e-9)
    seconds = max(seconds, elapsed)
    storage += snap[1, : len(STORAGE)]
    name = "main" if pid == main_pid else f"worker {n - (main_pid in snapshots)}"
    rss, started_s, jax = snap[0, 2:5]
    processes.append(Process(f"{name} ({pid})", rss / 2**20, float(started_s), bool(jax)))
    for stage, c in zip(STAGES, snap[_HEAD:]):
      if c[0] or c[2] or c[4]:
        rows.append(_row(f"{name} ({pid})", stage, c, elapsed, batch_size))
      if stage in held:
        held[stage] += c[3] if c[4] else c[1]  # waited for, or ran in the consumer's thread
    staged += elapsed if snap[_HEAD : _HEAD + len(held), 0].any() else 0.0
  requests, request_bytes, request_records, retries, reads, cached = storage.tolist()
  slowest = max(held, key=held.get)
  return Stats(
    tuple(rows),
    Storage(
      requests=int(requests),
      request_bytes=int(request_bytes),
      request_records=int(request_records),
      requests_per_s=float(requests / max(seconds, 1e-9)),
      kb_per_request=float(request_bytes / 1e3 / max(requests, 1)),
      images_per_request=float(request_records / max(requests, 1)),
      retries=int(retries),
      reads=int(reads),
      cached=int(cached),
    ),
    tuple(processes),
    seconds=seconds,
    slowest=slowest if held[slowest] > 0 else None,
    slowest_share=float(held[slowest] / max(staged, 1e-9)),
    stages_share=float(sum(held.values()) / max(staged, 1e-9)),
  )


def _row(process: str, stage: str, c: np.ndarray, elapsed: float, batch_size: int) -> Row:
  hist = c[len(_COUNTS) :]
  return Row(
    process=process,
    stage=stage,
    items=int(c[0]),
    images_per_s=float(c[0] * batch_size / elapsed),
    busy=float(c[1] / elapsed),
    wait_share=float(c[3] / elapsed),
    queued=float(c[5] / c[6]) if c[6] else None,
    p50_ms=_quantile(hist, 0.5),
    p99_ms=_quantile(hist, 0.99),
    cpu=float(c[7] / elapsed),
  )


def _quantile(hist: np.ndarray, q: float) -> float:
  """The `q` quantile of durations in log2 bins of microseconds, in ms (a bin's middle)."""
  total = hist.sum()
  if not total:
    return 0.0
  k = int(np.searchsorted(np.cumsum(hist), q * total))
  return float(2 ** (k + 0.5) / 1e3)
