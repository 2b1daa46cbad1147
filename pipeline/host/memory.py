"""One memory budget for what the loader holds on a host: `performance.memory_mb`.

The parts, for all the processes of one dataset on the host (W worker processes, or the
main process alone; P = max(W, 1) processes read and decode):

    read-ahead     P x the record bytes of batches read ahead (performance.read_ahead_mb each)
    blocks         two windows of the block order's blocks, kept for later rounds
                   (`Sampler.window_bytes`; shared in /dev/shm, or dealt to the workers)
    record cache   P x the record cache's RAM (each process keeps its own, `storage.cache`)
    worker rings   the workers' rings of shared memory for their batches
                   (`shm.needed`); without workers, the batches in flight (`held_bytes`)
    working        P x what a process holds beyond the parts above (`working`): a fixed
                   64 MB (its malloc arenas, decoder state), each decode thread's arena of
                   windows, and three batches' records (being decoded, read, and freed but
                   kept by malloc). Measured at 224 px (`bench throughput --pss`: peak PSS
                   above the imports) from batch 8 to 2048, every run held 88% of its plan
                   or less (docs/HISTORY.md, "The working memory at batch 8 to 2048"); the
                   rule it replaced, 8 batches' images, planned 1/20 of batch 8's and 1.9-2.2x
                   batch 2048's
    workers        W x `parallelism.worker_mb` (110 MB: a worker's RSS before its batches,
                   its imports: Grain, not JAX; 250 with `performance.worker_jax`)

The main process's own imports are the trainer's, not counted. When the parts exceed the
budget, what can shrink shrinks, in this order: the record cache (it saves a later epoch's
reads; down to none), then the read-ahead (down to one batch of records, which the read
stage always holds). If even that does not fit, one line refuses, naming the settings
(`BudgetError`, which says how much the least is).
Default budget: half the memory available at open, as tf.data's default RAM budget. None of
this changes a batch: a smaller cache or read-ahead reads the same records again, later.
The host plan (`pipeline.planner.workers`) plans the worker processes within the budget and
/dev/shm's room.
"""

from __future__ import annotations

import dataclasses
import os
import resource

from pipeline.host import parallelism, pool, shm

MB = 2**20
DEFAULT_SHARE = 0.5  # of the available memory, when performance.memory_mb is None
FLAG = "performance.memory_mb"
WORKING_FIXED = 64 * MB  # a process's malloc arenas and decoder state (measured: see above)
RECORD_BATCHES = 3  # batches' records a process holds beyond the read-ahead (measured)


@dataclasses.dataclass(frozen=True)
class Split:
  """Bytes of each part, for the whole host (`processes` share read-ahead and cache)."""

  budget: int
  processes: int
  read_ahead: int
  blocks: int
  record_cache: int
  batches: int
  working: int
  workers: int
  worker_bytes: int

  @property
  def total(self) -> int:
    fixed = self.blocks + self.batches + self.working + self.workers * self.worker_bytes
    return self.read_ahead + self.record_cache + fixed

  def per_process(self, part: str) -> int:
    """One process's share of `part` ("read_ahead" or "record_cache")."""
    return getattr(self, part) // self.processes

  def describe(self) -> str:
    """The split in one line, as make_dataset prints it."""
    rings = "worker rings" if self.workers else "batches"
    workers = _workers(self.workers, self.worker_bytes)
    return (
      f"memory: {mb(self.total)} of {mb(self.budget)} MB (read-ahead {mb(self.read_ahead)}, "
      f"blocks {mb(self.blocks)}, record cache {mb(self.record_cache)}, {rings} "
      f"{mb(self.batches)}, working {mb(self.working)}, workers {workers}); {FLAG} sets the "
      "budget"
    )


class BudgetError(ValueError):
  """A budget below the `least` bytes a loader holds (its parts in words: `parts`); one line
  naming performance.memory_mb."""

  def __init__(self, line: str, least: int, parts: str):
    super().__init__(line)
    self.least, self.parts = least, parts


def given(value_mb: float) -> str:
  """A `memory_mb` as a user writes it: whole above 10 MB, else 3 significant digits."""
  return f"{value_mb:,.0f}" if value_mb >= 10 else f"{value_mb:.3g}"


def mb(nbytes: float) -> str:
  """`nbytes` in MB: whole above 10, else to a tenth."""
  return f"{nbytes / MB:,.0f}" if nbytes >= 10 * MB or not nbytes else f"{nbytes / MB:.1f}"


def _workers(count: int, each: int) -> str:
  return f"{count}x{mb(each)}" if count else "0"


def budget(memory_mb: float | None) -> int:
  """Bytes the loader may hold: `memory_mb`, or DEFAULT_SHARE of the available memory."""
  if memory_mb is not None:
    return round(memory_mb * MB)
  return int(DEFAULT_SHARE * parallelism.available_memory())


def fit(
  budget_bytes: int,
  *,
  workers: int,
  read_ahead: int,
  least_read_ahead: int,
  record_cache: int,
  blocks: int,
  batches: int,
  working: int,
  worker_bytes: int = int(parallelism.COSTS.worker_mb * MB),
) -> Split:
  """The parts within `budget_bytes`: `read_ahead`, `record_cache` and `working` are bytes
  per process; the first two shrink, the cache first, the read-ahead down to
  `least_read_ahead`; the rest is fixed. Raises `BudgetError` when even the least does not fit."""
  p = max(1, workers)
  fixed = blocks + batches + p * working + workers * worker_bytes
  least = min(read_ahead, least_read_ahead)
  room = budget_bytes - fixed
  if room < p * least:
    parts = (
      f"blocks {mb(blocks)}, worker rings or batches {mb(batches)}, working {mb(p * working)}, "
      f"workers {_workers(workers, worker_bytes)}, read-ahead {mb(p * least)}"
    )
    raise BudgetError(
      f"{FLAG}={given(budget_bytes / MB)} is below the least this loader holds, "
      f"{mb(fixed + p * least)} MB ({parts}): raise it, or lower performance.num_workers or "
      "batch_size",
      fixed + p * least,
      parts,
    )
  cache = max(0, min(p * record_cache, room - p * read_ahead))
  ahead = min(p * read_ahead, room - cache)
  return Split(budget_bytes, p, ahead, blocks, cache, batches, p * working, workers, worker_bytes)


def held_bytes(workers: int, batch_bytes: int, prefetch: int) -> int:
  """Bytes of the batches the host's processes hold: the workers' rings, else this process's
  batches being decoded, waiting and taken (prefetch + 2) and the spare ones of its pool."""
  if workers:
    return shm.needed(workers, batch_bytes, prefetch, parallelism.WORKER_BATCHES)
  return (prefetch + 2 + pool.spare(batch_bytes)) * batch_bytes


def working(threads: int, arena_bytes: int, batch_records: int) -> int:
  """A process's working memory: WORKING_FIXED, `threads` decode arenas of `arena_bytes`, and
  RECORD_BATCHES batches' records of `batch_records` bytes each."""
  return WORKING_FIXED + threads * arena_bytes + RECORD_BATCHES * batch_records


def tree_rss() -> int:
  """Bytes this process tree holds: this process's peak resident memory (the kernel's), plus
  its child processes' (worker processes') resident memory now, read from Linux's /proc."""
  kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  for pid in _descendants(os.getpid()):
    try:
      with open(f"/proc/{pid}/status") as f:
        kb += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):  # exited meanwhile, or a zombie without memory
      continue
  return kb * 1024


def _descendants(pid: int) -> list[int]:
  try:
    tasks = os.listdir(f"/proc/{pid}/task")
  except OSError:
    return []
  children = []
  for task in tasks:
    try:
      with open(f"/proc/{pid}/task/{task}/children") as f:
        children += map(int, f.read().split())
    except OSError:
      continue
  return children + [d for c in children for d in _descendants(c)]
