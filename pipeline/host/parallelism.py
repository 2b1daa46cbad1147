"""How many worker processes and decode threads per process a host should run, and why.

One process's decode threads scale until the per-image work that holds the GIL fills one
core: past that, more threads only add GIL hand-offs. A many-core host therefore runs Grain
worker processes (`mp_prefetch`) with a few threads each, and the main process only
receives their batches (`pipeline.stages.handoff`). A small model turns measured per-image costs
into the images/s each resource allows (per image, in microseconds; T threads per process,
W workers, C vCPUs worth `core_equivalents(C)` cores, B images per step of the main process):

    threads   max(W, 1) * T / (cpu + wait [+ send])   each thread decodes its images in turn
    gil       max(W, 1) / (gil * handoff(T))          handoff(T) = 1 + handoff * (T - 1)
    cores     core_equivalents(C) / (cpu [+ send + receive + receive_free])
    main      1 / (receive + receive_free + step / B) every thread of the main process, and
                                                      the training step's host work, serial

([...]: with W > 0 workers, whose batches the main process receives.) vCPUs are hyperthreads
on cloud hosts (a TPU VM's 224 vCPUs are 112 cores x 2): the second thread of a core adds
`smt_yield` of a core, stated, not measured here (this machine shows no SMT siblings).

`project` is the smallest, `plan` the fewest processes (then threads) within 3% of the best
plan for the host, and `python -m bench scaling` measures the costs below. Memory:
a worker takes ~110 MB (imports: Grain, never JAX, `pipeline.host.light`; `light.JAX_MB` more
with `performance.worker_jax`) plus its batches (prefetch + 4; ~115 MB at batch 128 of 224 px
images), and the workers together at most half the loader's memory budget
(`pipeline.host.memory`).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from pipeline.host import light

SMT_YIELD = 0.25  # stated: a hyperthread sibling adds ~15-30% on integer SIMD decode work


@dataclasses.dataclass(frozen=True)
class Costs:
  """Per-image costs in microseconds (a 224 px train image, batch 128) and a worker's RSS."""

  cpu_us: float  # all CPU of one image in the process that decodes it (one thread)
  gil_us: float  # of which holding the GIL (read, parse, crop box, RNG, Python, Grain)
  handoff: float  # extra GIL time per image for each thread beyond the first
  send_us: float  # a worker's extra CPU per image (handing the batch over)
  receive_us: float  # the main process's user CPU per image receiving it (all its threads)
  receive_free_us: float  # and its system CPU (mapping pages, queues)
  worker_mb: float  # a worker's RSS before its batches (its imports: Grain, not JAX)
  wait_us: float = 0.0  # off-CPU time of a thread per image (slow storage); 0 on local disk
  step_us: float = 0.0  # the training step's host work per step (dispatch, metrics), main process
  threads_per_core: int = 1  # hardware threads per core (2 on cloud hosts' vCPUs)
  smt_yield: float = SMT_YIELD  # what a core's second hardware thread adds, in cores


# The costs of one image on the 2 shared vCPUs of the development machine, measured with
# `python -m bench scaling` on 2026-11-23 (medians of 3 interleaved repeats; runs since,
# with the spread of each figure: bench/REPORT.md, "Scaling"): CPU per image on one thread, GIL-held
# CPU per image (bench.gil's shim, real decode on 2 threads), the hand-off per thread, a
# worker's extra CPU per image (send), the main process's user/system CPU per image at batch
# 128 (receive), and a worker's RSS before its batches (2026-11-28: 108-110 MB, 8-image batches
# of 32 px; light workers, `pipeline.host.light`, were 300 MB with JAX before).
COSTS = Costs(
  cpu_us=1064.0,
  gil_us=61.0,
  handoff=0.009,
  send_us=5.0,
  receive_us=3.4,
  receive_free_us=3.4,
  worker_mb=110.0,
)
COSTS_BATCH = 128  # the batch size COSTS were measured at
WORKER_BATCHES = 4  # batches a worker holds beyond its prefetch (measured: 5.7 at prefetch 2)
MEMORY_SHARE = 0.5  # of the available memory the workers may take
NEAR_BEST = 0.97  # a plan this close to the best rate counts as the best
SMALL_HOST = 2  # cores up to which no workers are chosen: their start-up and memory never pay


@dataclasses.dataclass(frozen=True)
class Plan:
  """Grain worker processes (0: decode in this process) and decode threads per process."""

  workers: int
  threads: int
  why: str = ""

  def describe(self) -> str:
    where = (
      f"{self.workers} worker processes x {self.threads} decode threads"
      if self.workers
      else f"no worker processes, {self.threads} decode threads"
    )
    return f"{where} ({self.why})" if self.why else where


def available_cores() -> int:
  """The cores this process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def available_memory() -> int:
  """Bytes of memory available to new processes: MemAvailable (free plus reclaimable page
  cache), or free pages where /proc/meminfo is missing."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def core_equivalents(vcpus: int, costs: Costs) -> float:
  """What `vcpus` hardware threads are worth in cores."""
  tpc = max(1, costs.threads_per_core)
  return vcpus / tpc * (1 + costs.smt_yield * (tpc - 1))


def handoff_factor(threads: int, handoff: float) -> float:
  return 1.0 + handoff * max(0, threads - 1)


def limits(cores: int, costs: Costs, plan: Plan, batch_size: int = 0) -> dict[str, float]:
  """Images/s each resource allows a host of `cores` vCPUs running `plan` (see above);
  `batch_size`: images per step of the main process (for `costs.step_us`)."""
  w, t = plan.workers, plan.threads
  processes = max(w, 1)
  send = costs.send_us if w else 0.0
  cpu = costs.cpu_us + send + (costs.receive_us + costs.receive_free_us if w else 0.0)
  out = {
    "threads": processes * t * 1e6 / (costs.cpu_us + costs.wait_us + send),
    "gil": processes * 1e6 / (costs.gil_us * handoff_factor(t, costs.handoff)),
    "cores": core_equivalents(cores, costs) * 1e6 / cpu,
  }
  main = costs.step_us / batch_size if batch_size else 0.0
  if w:
    main += costs.receive_us + costs.receive_free_us
  if main:
    out["main"] = 1e6 / main
  return out


def project(cores: int, costs: Costs, plan: Plan, batch_size: int = 0) -> float:
  """The images/s a host of `cores` vCPUs delivers with `plan`: the smallest limit."""
  return min(limits(cores, costs, plan, batch_size).values())


def bound(cores: int, costs: Costs, plan: Plan, batch_size: int = 0) -> str:
  """The resource that sets `project`'s rate."""
  lim = limits(cores, costs, plan, batch_size)
  return min(lim, key=lim.get)


def at_batch(costs: Costs, batch_size: int, measured_at: int = COSTS_BATCH) -> Costs:
  """`costs` for batches of `batch_size`: the main process's Python per received batch
  (`receive_us`, measured at batches of `measured_at`) spreads over its images."""
  return dataclasses.replace(costs, receive_us=costs.receive_us * measured_at / batch_size)


def plan(
  cores: int | None = None,
  *,
  num_workers: int | None = None,
  num_threads: int | None = None,
  batch_size: int = COSTS_BATCH,
  image_bytes: int = 0,
  prefetch: int = 2,
  costs: Costs = COSTS,
  costs_batch: int = COSTS_BATCH,
  memory_bytes: int | None = None,
  divide: int | None = None,
) -> Plan:
  """Worker processes x decode threads for a host of `cores` cores (default: this one's),
  batches of `batch_size` images of `image_bytes` each.

  Settings you give (`num_workers`, `num_threads`) are kept; the others are chosen by
  `project` (`costs` measured at batches of `costs_batch`). Memory budget: each worker
  takes `costs.worker_mb` plus `prefetch +
  WORKER_BATCHES` batches, and the workers together at most half of `memory_bytes`
  (default: the memory available now); threads never outnumber the cores. `divide`: only
  worker counts that divide it, or none (the block order's where /dev/shm cannot share its
  blocks, `pipeline.storage.blockstore`). Up to
  SMALL_HOST cores it is the fast path whatever the costs: no workers, one thread per core.
  """
  cores = cores or available_cores()
  if num_workers is not None and num_threads is not None:
    return Plan(num_workers, num_threads, "set by you")
  costs = at_batch(costs, batch_size, costs_batch)
  batch_bytes = batch_size * image_bytes
  memory = available_memory() if memory_bytes is None else memory_bytes
  per_worker = costs.worker_mb * 2**20 + (prefetch + WORKER_BATCHES) * batch_bytes
  memory_cap = int(MEMORY_SHARE * memory // per_worker)
  max_workers = 0 if cores <= SMALL_HOST else min(cores, memory_cap)
  workers = [num_workers] if num_workers is not None else range(max_workers + 1)
  if divide and num_workers is None:
    workers = [w for w in workers if w == 0 or divide % w == 0]
  candidates = []
  for w in workers:
    top = cores if w == 0 else max(1, cores // w)
    for t in [num_threads] if num_threads is not None else range(1, top + 1):
      candidates.append((project(cores, costs, Plan(w, t), batch_size), w, t))
  best = max(rate for rate, _, _ in candidates)
  rate, w, t = min((c for c in candidates if c[0] >= NEAR_BEST * best), key=lambda c: c[1:])
  given = (
    " (num_workers set by you)"
    if num_workers is not None
    else " (num_threads set by you)"
    if num_threads is not None
    else ""
  )
  memory_note = (
    f", memory for at most {memory_cap} workers"
    if num_workers is None and cores > SMALL_HOST and w == memory_cap < cores
    else ""
  )
  given += f", workers dividing {divide} for the block order" if divide and not given else ""
  why = (
    f"auto for {cores} cores{given}: projected {rate:,.0f} img/s, bound by "
    f"{bound(cores, costs, Plan(w, t))}{memory_note}"
  )
  return Plan(w, t, why)


_announced: set[tuple[Plan, str, str]] = set()


def announce(chosen: Plan, reads_note: str = "", memory_note: str = "") -> None:
  """Prints the plan with the memory split (`pipeline.host.memory`), and the read stage's
  `reads_note`, once per process; make_dataset calls this for every dataset."""
  if (chosen, reads_note, memory_note) not in _announced:
    _announced.add((chosen, reads_note, memory_note))
    memory_note = f"; {memory_note}" if memory_note else ""
    print(
      f"pipeline: {chosen.describe()}; override with performance.num_workers / num_threads"
      f"{memory_note}",
      file=sys.stderr,
      flush=True,
    )
    if reads_note:
      print(f"pipeline: {reads_note}", file=sys.stderr, flush=True)


def worker_mb(worker_jax: bool) -> float:
  """A worker's RSS before its batches: light, or with JAX (`performance.worker_jax`)."""
  return COSTS.worker_mb + (light.JAX_MB if worker_jax else 0)


def process_shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
  """This process's (index, count) of the data: as given, else JAX's process index and count."""
  if shard_index is None or shard_count is None:
    import jax  # only here: worker processes and converters never load JAX

    return jax.process_index(), jax.process_count()
  return shard_index, shard_count
