"""The pipeline doctor: why is my step input-bound, and what setting fixes it?

    python -m bench.doctor data/photos --batch-size 128 --step-ms 100
    python -m bench.doctor --config configs/default.py --apply configs/default_tuned.py
    python -m bench.doctor --config default --config.input.image_size=64   # the run's config
    python -m bench.doctor data/photos --cores 224        # for a host you are not on

Times each stage alone on one thread through the library's functions (read: batched reads
of the split's shards; parse; decode: header, crop window, crop-aware decode; augment:
resize and flip into the batch; wall and CPU ms per image), then runs the whole
`make_dataset` pipeline for a few seconds (and, with --step-ms, beside a simulated train
step to measure the input wait), then once more on 16 threads with decode and resize
replaced by GIL-free waits of their length: the rate where the GIL binds gives the time
each image holds it ("python"). These costs feed `pipeline.host.parallelism`'s host model
(threads, GIL, cores, worker processes' transfer; see there) plus the loader's own limits
(P = max(W, 1) processes of W worker processes):

    reads:    P x N / L         Little's law on the read stage (`pipeline.stages.read`): each
                                process keeps N records in flight at storage, the batches its
                                read-ahead share holds (performance.read_ahead_mb, at least
                                one batch, at most performance.read_ahead batches), within
                                MAX_READ_THREADS requests of K images; L: a request's latency
                                as the run measured it (counted when the run made requests)
    prefetch: P x D / S         the decode side: prefetch batches being decoded, each cut
                                into tasks (`pipeline.stages.decode.task_size`), give D =
                                min(T, prefetch x tasks) of the T decode threads work of S
                                per image (parse, decode, augment); it binds only with
                                fewer tasks than threads (small batches)
    requests: C x K             storage answers C requests/s however many are in flight (the
                                storage check), K images per request; counted when the run's
                                read stage makes most of C or its reads queue at storage

The smallest limit names the resource, its largest stage the bottleneck, and re-evaluating
the model with other settings gives each recommendation's expected gain; `--cores N`
evaluates it for a host of N cores. `--apply` writes the settings into a config's `input`
block (`make_dataset`'s keywords).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import math
import os
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import grain
import ml_collections
import psutil

import pipeline
from bench import costs as costs_lib
from bench import emulate, measure, storage_check, timeline
from bench.costs import STAGES, Cost
from pipeline import dataset, options
from pipeline.catalog import manifest as manifest_lib
from pipeline.host import parallelism
from pipeline.image import decode
from pipeline.order.blocks import BLOCK_RECORDS
from pipeline.stages import decode as decode_stage
from pipeline.stages import read as read_lib
from pipeline.stages.stats import Stats
from train import config as train_config

GIL_STAGES = ("read", "parse", "other")  # "other": crop box, RNG, Python layers, Grain
# ties: hardware first
LIMITS = ("requests", "cores", "gil", "threads", "reads", "prefetch", "main")
MAX_PREFETCH = 16
REFERENCE_PIXELS = 224 * 224  # the image size parallelism.COSTS were measured at
CEILING_THREADS = 16  # threads of the emulated run that measures the GIL-held time
PRESSED = 0.75  # a run making this share of storage's request ceiling is bound by it
REQUEST_BUDGET = "storage request budget"  # the bottleneck's name when requests bind


class UsageError(ValueError):
  """A mistake in the command line or the config: one line, exit 2."""


@dataclasses.dataclass
class Settings:
  """What the doctor runs: `make_dataset`'s keywords (a config's `input` block) and the
  batch size of this process."""

  data_dir: str
  split: str = "train"
  batch_size: int = 128
  image_size: int = 224
  seed: int = 0
  augment: dict = dataclasses.field(default_factory=dict)  # pipeline.Augment fields
  performance: dict = dataclasses.field(default_factory=dict)  # pipeline.Performance fields
  decoding: dict = dataclasses.field(default_factory=dict)  # pipeline.Decoding fields
  other: dict = dataclasses.field(default_factory=dict)  # any other make_dataset keyword
  recipe: str | None = None  # the config file they came from (None: the doctor's defaults)

  @property
  def aug(self) -> pipeline.Augment:
    return options.coerce(pipeline.Augment, self.augment)

  @property
  def perf(self) -> pipeline.Performance:
    return options.coerce(pipeline.Performance, self.performance)

  @property
  def dec(self) -> pipeline.Decoding:
    return options.coerce(pipeline.Decoding, self.decoding)

  def plan(self, cores: int, memory_bytes: int | None = None) -> parallelism.Plan:
    """The workers x threads `make_dataset` runs with on a host of `cores` cores."""
    p = self.perf
    return parallelism.plan(
      cores,
      num_workers=p.num_workers,
      num_threads=p.num_threads,
      batch_size=self.batch_size,
      image_bytes=self.image_size**2 * 3,
      prefetch=p.prefetch,
      memory_bytes=memory_bytes,
    )

  def check(self) -> None:
    """Raises ValueError naming a bad augment, decoding or performance field or value."""
    options.coerce(pipeline.Augment, self.augment)
    options.coerce(pipeline.Decoding, self.decoding)
    options.coerce(pipeline.Performance, self.performance)

  def keywords(self) -> dict:
    """`make_dataset`'s arguments for these settings (one process, train)."""
    return dict(
      data_dir=self.data_dir,
      split=self.split,
      batch_size=self.batch_size,
      train=True,
      seed=self.seed,
      image_size=self.image_size,
      shard_index=0,
      shard_count=1,
      augment=self.augment,
      performance=self.performance,
      decoding=self.decoding,
      **self.other,
    )

  def stages(self) -> dataset.Stages:
    """The stages `make_dataset` joins for these settings (`dataset.chain` joins them)."""
    return dataset.build(dataset.Spec.of(**self.keywords()))

  def dataset(self, emulate_us: tuple[float, float] | None = None) -> grain.IterDataset:
    """The dataset these settings make (decode and resize emulated with `emulate_us`)."""
    return emulate.make_dataset(**self.keywords(), emulate_us=emulate_us)


@dataclasses.dataclass
class Requests:
  """The read stage's storage requests over a run's timed part (`stages.read.ReadStats`)."""

  made: int
  per_s: float
  kb_per_request: float
  images_per_request: float
  order: str  # "global": one request per image; "blocks": one per block of block_records
  block_records: int | None
  max_per_s: float | None  # performance.max_requests_per_s
  latency_open_ms: float  # one read at open
  latency_ms: float  # a read task at the end (moving average)


@dataclasses.dataclass
class Run:
  """The whole pipeline, steady state (after the first batch)."""

  images_per_sec: float
  first_batch_s: float
  images: int
  seconds: float
  cpu_ms_per_image: float  # this process and its worker processes
  wait_share: float | None = None  # with a simulated step: time blocked in next() / total
  requests: Requests | None = None  # every process's, worker processes' too


@dataclasses.dataclass
class Measurements:
  """What the doctor measured on this machine."""

  cores: int
  load_average: float
  num_records: int
  num_shards: int
  costs: dict[str, Cost]
  cache_bytes_per_image: float
  dct_share: float  # share of crops decoded with DCT scaling
  run: Run
  consumer_run: Run | None = None
  python_us: float | None = None  # GIL-held time per image (emulated ceiling; native path)
  storage: storage_check.StorageCheck | None = None  # reads at 1, 16, 128 in flight


@dataclasses.dataclass
class Recommendation:
  field: str
  current: object
  proposed: object
  expected_images_per_sec: float
  gain: float
  why: str
  writes: dict  # config.input paths -> values, e.g. {"performance.prefetch": 8}


@dataclasses.dataclass
class Diagnosis:
  settings: Settings
  cores: int  # the host diagnosed (--cores), maybe not this one
  here: bool  # whether that host is this machine (measured) or projected
  plan: dict  # workers and threads make_dataset runs with there
  measured: Measurements
  costs: dict[str, Cost]  # stages, plus "other" (the rest of the GIL-held work)
  limits: dict[str, float]  # images/s each resource allows (see the module docstring)
  predicted: float
  run: Run
  step_ms: float | None
  bottleneck: str  # a stage, or "train step" when the input keeps up
  input_stage: str  # the stage limiting the input pipeline itself
  limit: str  # which resource binds, in words
  recommendations: list[Recommendation]
  notes: list[str]
  cache_estimate_mb: float


# ---------------------------------------------------------------- whole pipeline


def measure_run(
  ds,
  seconds: float,
  step_s: float = 0.0,
  recorder: timeline.Recorder | None = None,
  min_batches: int = 3,
  read: read_lib.ReadRecords | None = None,
) -> Run:
  """Iterates `ds` for `seconds` after the first batch; sleeps `step_s` per batch if > 0.
  The recorder gets the consumer's view: waiting for batches, train steps. With `read`,
  `ds`'s read stage, the run counts the storage requests of every process (`it.stats()`)."""
  recorder = recorder or timeline.Recorder()
  start = time.perf_counter()
  opened = read.stats.latency_s if read else 0.0  # the latency measured at open
  it: Iterator = iter(ds)
  with recorder.span("wait for batch"):
    next(it)
  first = time.perf_counter()
  kids = measure.workers()
  cpu0 = time.process_time() + measure.cpu_s(kids)
  before = it.stats() if read else None
  images = batches = 0
  waited = 0.0
  while time.perf_counter() - first < seconds or batches < min_batches:
    t0 = time.perf_counter()
    batch = next(it)
    t1 = time.perf_counter()
    recorder.add("wait for batch", t0, t1)
    waited += t1 - t0
    images += len(batch["image"])
    batches += 1
    if step_s:
      with recorder.span("train step"):
        time.sleep(step_s)
  end = time.perf_counter()
  cpu = time.process_time() + measure.cpu_s(kids) - cpu0
  after = it.stats() if read else None
  close = getattr(it, "close", None)
  if close:
    close()
  return Run(
    round(images / (end - first), 1),
    round(first - start, 3),
    images,
    round(end - first, 3),
    round(cpu / images * 1e3, 4),
    round(waited / (end - first), 3) if step_s else None,
    _requests(read, before, after, end - first, opened) if read else None,
  )


def _requests(
  read: read_lib.ReadRecords, before: Stats, after: Stats, seconds: float, opened_s: float
) -> Requests:
  """The storage requests of every process between `before` and `after` (`it.stats()`), over
  `seconds`; `read`: the read stage's settings; `opened_s`: its read latency at open. The
  latency at the end: this process's moving average, or the worker processes' median read
  task (log2 bins) when they read."""
  a, b = after.storage, before.storage
  made = a.requests - b.requests
  tasks = [r.p50_ms for r in after.rows if r.stage == "read" and r.process.startswith("worker")]
  latency_ms = statistics.median(tasks) if tasks else read.stats.latency_s * 1e3
  return Requests(
    made,
    round(made / seconds, 1),
    round((a.request_bytes - b.request_bytes) / max(made, 1) / 1e3, 1),
    round((a.request_records - b.request_records) / max(made, 1), 2),
    "global" if read.ranges is None else "blocks",
    None if read.ranges is None else read.ranges.block_records,
    None if read.budget is None else read.budget.per_s * max(1, len(tasks)),
    round(opened_s * 1e3, 2),
    round(latency_ms, 2),
  )


def measure_all(
  s: Settings,
  seconds: float = 5.0,
  step_ms: float | None = None,
  sample: int = 128,
  recorder: timeline.Recorder | None = None,
  storage_levels: tuple[int, ...] = (),
  storage_reads: int = 256,
) -> Measurements:
  """Stage costs; with `storage_levels`, the storage check (`bench.storage_check`:
  `storage_reads` reads at each level in flight); the whole pipeline alone (its storage
  requests counted when it has no worker processes), then (with `step_ms`) beside a step;
  then the GIL-held time, unless storage's request budget binds (the emulated run would
  wait on storage, not on the GIL)."""
  stages = s.stages()
  costs, facts = costs_lib.stage_costs(
    s.data_dir, s.split, stages.decode.head, s.batch_size, sample, s.seed, s.other.get("keys")
  )
  check = (
    storage_check.measure(s.data_dir, s.split, storage_levels, storage_reads)
    if storage_levels
    else None
  )
  recorder = recorder or timeline.Recorder()
  run = measure_run(
    dataset.chain(stages),
    seconds,
    recorder=None if step_ms else recorder,
    read=stages.read,
  )
  consumer = None
  if step_ms:  # the timeline shows this run: input waits beside train steps
    consumer = measure_run(
      s.dataset(), max(seconds / 2, 3 * step_ms / 1e3), step_ms / 1e3, recorder
    )
  m = Measurements(
    parallelism.available_cores(),
    round(os.getloadavg()[0], 2),
    facts["num_records"],
    facts["num_shards"],
    costs,
    facts["cache_bytes_per_image"],
    round(facts["dct_share"], 3),
    run,
    consumer,
    storage=check,
  )
  if decode.native() is not None and request_budget(m) is None:
    m.python_us = measure_python(s, costs, seconds / 2)
  return m


def measure_python(s: Settings, costs: dict[str, Cost], seconds: float) -> float:
  """GIL-held time per image of the native path: `make_dataset` on CEILING_THREADS threads
  with each image's decode and resize replaced by GIL-free waits of their measured length
  (`bench.emulate`), so that the GIL binds; the rate it reaches is 1 / (GIL time x
  hand-off factor)."""
  waits = (costs["decode"].cpu_ms * 1e3, costs["augment"].cpu_ms * 1e3)
  perf = {**s.performance, "num_threads": CEILING_THREADS, "num_workers": 0}
  uncached = dataclasses.replace(s, performance=perf, decoding={**s.decoding, "cache_mb": 0.0})
  run = measure_run(uncached.dataset(waits), seconds)
  factor = parallelism.handoff_factor(CEILING_THREADS, parallelism.COSTS.handoff)
  return round(1e6 / run.images_per_sec / factor, 1)


# ---------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class _State:
  """The settings the model is evaluated at."""

  workers: int
  threads: int
  prefetch: int
  cached: bool
  dct: bool
  read_s: float  # a storage request's latency
  record_bytes: float  # a stored record
  ahead_mb: float  # performance.read_ahead_mb: each process's record bytes read ahead
  max_depth: int | None = None  # performance.read_ahead: batches read ahead at most
  budget_per_s: float | None = None  # storage's request ceiling, when the run presses it
  per_request: float = 1.0  # images per storage request


def _free_stages(costs: dict[str, Cost], state: _State) -> tuple[str, ...]:
  """The GIL-free work of the decode threads: decode and augment, or a crop of the cache.
  "decode" was measured with the settings' dct_scaling; "decode_dct", when the settings
  have it off, with it on."""
  if state.cached:
    return ("augment_cached",)
  return ("decode_dct" if state.dct and "decode_dct" in costs else "decode", "augment")


def _gil_stages(costs: dict[str, Cost], state: _State) -> tuple[str, ...]:
  """The work holding the GIL. The native path: "python", measured, else read and other
  (it parses in C without the GIL); the Python path (a RAM cache, or no C extension):
  read, parse and other."""
  if decode.native() is None or state.cached:
    return GIL_STAGES
  return ("python",) if "python" in costs else ("read", "other")


def with_other(costs: dict[str, Cost], run: Run, workers: int, s: Settings) -> dict[str, Cost]:
  """The stage costs plus "other": the run's CPU per image beyond its stages and the
  workers' transfer (crop box, RNG, Python layers, Grain)."""
  t = _transfer_us(s)
  transfer = (
    (t["send_us"] + t["receive_free_us"] + t["receive_us"] * parallelism.COSTS_BATCH / s.batch_size)
    if workers
    else 0.0
  )
  staged = sum(costs[x].cpu_ms for x in STAGES)
  other = round(max(run.cpu_ms_per_image - transfer / 1e3 - staged, 0.0), 4)
  return {**costs, "other": Cost(other, other)}


def _transfer_us(s: Settings) -> dict[str, float]:
  """Worker transfer costs per image, from parallelism.COSTS: the pages' share scaled to
  this image size (the Python per batch is spread by `parallelism.at_batch`)."""
  pixels = s.image_size**2 / REFERENCE_PIXELS
  base = parallelism.COSTS
  return {
    "send_us": base.send_us * pixels,
    "receive_free_us": base.receive_free_us * pixels,
    "receive_us": base.receive_us,
  }


def host_costs(costs: dict[str, Cost], state: _State, s: Settings) -> parallelism.Costs:
  """`parallelism.Costs` from measured stage costs (with "other")."""
  free = _free_stages(costs, state)
  thread_work = ("parse", *free)
  wait = sum(costs[x].active_ms - costs[x].cpu_ms for x in thread_work) * 1e3
  return parallelism.Costs(
    cpu_us=sum(costs[x].cpu_ms for x in (*GIL_STAGES, *free)) * 1e3,
    gil_us=max(sum(costs[x].cpu_ms for x in _gil_stages(costs, state)) * 1e3, 1.0),
    handoff=parallelism.COSTS.handoff,
    worker_mb=parallelism.COSTS.worker_mb,
    wait_us=max(wait, 0.0),
    **_transfer_us(s),
  )


def read_ahead(state: _State, batch_size: int) -> int:
  """Records one process keeps in flight at storage: the batches its read-ahead share holds
  (at least one, at most performance.read_ahead; `ReadAhead.bounds`' ceiling), within
  MAX_READ_THREADS requests of `state.per_request` records."""
  batches = max(1, int(state.ahead_mb * 2**20 // max(1.0, state.record_bytes * batch_size)))
  records = min(batches, state.max_depth or batches) * batch_size
  return min(records, math.floor(read_lib.MAX_READ_THREADS * state.per_request))


def model(costs: dict[str, Cost], state: _State, cores: int, s: Settings) -> dict[str, float]:
  """Images/s each resource allows (the module docstring and pipeline.host.parallelism)."""
  hc = parallelism.at_batch(host_costs(costs, state, s), s.batch_size)
  lim = parallelism.limits(cores, hc, parallelism.Plan(state.workers, state.threads))
  processes = max(state.workers, 1)
  if state.budget_per_s:  # requests: storage answers so many a second, however many wait
    lim["requests"] = state.budget_per_s * state.per_request
  if state.read_s:  # Little's law on the records in flight; none without storage requests
    lim["reads"] = processes * read_ahead(state, s.batch_size) / state.read_s
  free = _free_stages(costs, state)
  work_wall = sum(costs[s].active_ms for s in ("parse", *free)) / 1e3
  tasks = -(-s.batch_size // decode_stage.task_size(s.batch_size, state.threads))
  decoding = min(state.threads, state.prefetch * tasks)  # tasks the decode threads can run
  lim["prefetch"] = processes * decoding / max(work_wall, 1e-9)
  return lim


def binding(limits: dict[str, float]) -> str:
  """The limit with the lowest rate; near ties (2%) go to the hardware first."""
  low = min(limits.values())
  return next(k for k in LIMITS if k in limits and limits[k] <= low * 1.02)


def _stage_of(limit: str, costs: dict[str, Cost], state: _State) -> str:
  """The stage to blame under `limit`: the largest share of the bound resource."""
  free = _free_stages(costs, state)
  if limit == "requests":
    return REQUEST_BUDGET
  if limit == "main":
    return "transfer"
  if limit == "gil":
    return max(_gil_stages(costs, state), key=lambda s: costs[s].cpu_ms)
  if limit == "cores":
    return max((*GIL_STAGES, *free), key=lambda s: costs[s].cpu_ms)
  if limit == "reads":
    return "read"
  return max(("parse", *free), key=lambda s: costs[s].active_ms)


def _smallest(values: range, rate: Callable[[int], float], share: float = 0.95) -> int:
  """The smallest value whose rate reaches `share` of the best rate over `values`."""
  best = max(rate(v) for v in values)
  return next(v for v in values if rate(v) >= share * best)


# ---------------------------------------------------------------- diagnosis


def diagnose(
  s: Settings, m: Measurements, step_ms: float | None = None, cores: int | None = None
) -> Diagnosis:
  """Names the bottleneck of `s` on a host of `cores` cores (default: this machine, where
  `m` was measured) and recommends settings."""
  cores = cores or m.cores
  here = cores == m.cores
  memory = None if here else cores * 2**30
  chosen = s.plan(cores, memory)
  budget = request_budget(m)
  costs = with_other(m.costs, _per_record(m.run) if budget else m.run, s.plan(m.cores).workers, s)
  if m.python_us is not None and budget is None:  # else the emulated run waited on storage
    costs["python"] = Cost(m.python_us / 1e3, m.python_us / 1e3)
  cache_mb = m.cache_bytes_per_image * m.num_records / 2**20
  perf, q = s.perf, m.run.requests
  state = _State(
    chosen.workers,
    chosen.threads,
    perf.prefetch,
    0 < cache_mb <= s.dec.cache_mb,
    s.dec.dct_scaling,
    # storage's own latency: under a request budget the one at the end queued at storage
    (q.latency_open_ms if budget else q.latency_ms) / 1e3 if q.made else 0.0,
    q.kb_per_request * 1e3 / max(q.images_per_request, 1.0),
    perf.read_ahead_mb,
    perf.read_ahead,
    budget and min(budget, q.max_per_s or budget),  # a lower max_requests_per_s
    max(q.images_per_request, 1.0) if q.made else 1.0,
  )
  limits = model(costs, state, cores, s)
  predicted = min(limits.values())
  limit = binding(limits)
  input_stage = _stage_of(limit, costs, state)
  rate = m.run.images_per_sec if here else predicted
  need = s.batch_size / (step_ms / 1e3) if step_ms else None
  bottleneck = "train step" if need and rate >= 1.05 * need else input_stage
  d = Diagnosis(
    settings=s,
    cores=cores,
    here=here,
    plan=dataclasses.asdict(chosen),
    measured=m,
    costs=costs,
    limits={k: round(v, 1) for k, v in limits.items()},
    predicted=round(predicted, 1),
    run=m.run,
    step_ms=step_ms,
    bottleneck=bottleneck,
    input_stage=input_stage,
    limit=_words(limit, limits, state, costs, cores, m, s),
    recommendations=[],
    notes=[],
    cache_estimate_mb=round(cache_mb, 1),
  )
  _recommend(d, state, need)
  return d


def _per_record(run: Run) -> Run:
  """`run` with its CPU spread over the records it read when more than it delivered: under
  a request budget reads ahead run far past the batches delivered, and their CPU is not a
  delivered image's."""
  read = run.requests.made * run.requests.images_per_request
  return dataclasses.replace(
    run, cpu_ms_per_image=run.cpu_ms_per_image * run.images / max(run.images, read)
  )


def request_budget(m: Measurements) -> float | None:
  """Storage's request ceiling (requests/s) when it binds the run: the storage check finds
  one (throughput flat while latency grows with reads in flight) and the run's read stage
  makes at least PRESSED of it, or its reads queue (their latency QUEUED times the one at
  open: reads ahead wait at storage, and a run that reads far ahead uses few of them).
  None otherwise, or where either was not measured."""
  ceiling = m.storage.request_budget_per_s(m.cores) if m.storage else None
  q = m.run.requests
  if ceiling and q:
    if q.per_s >= PRESSED * ceiling or q.latency_ms >= storage_check.QUEUED * q.latency_open_ms:
      return ceiling
  return None


def _words(
  limit: str,
  limits: dict[str, float],
  state: _State,
  costs: dict[str, Cost],
  cores: int,
  m: Measurements,
  s: Settings,
) -> str:
  rate = f"{limits[limit]:.0f} img/s at most"
  procs = f"{state.workers} worker processes" if state.workers else "one process"
  gil_us = sum(costs[s].cpu_ms for s in _gil_stages(costs, state)) * 1e3
  if limit == "requests":
    levels, r = m.storage.levels, m.run.requests
    ceiling = m.storage.request_budget_per_s(m.cores)
    cap = f", max_requests_per_s={r.max_per_s:g}" if r.max_per_s else ""
    return (
      f"storage answers ~{ceiling:,.0f} requests/s however many are in flight "
      f"(a read's latency {levels[0].median_ms:,.1f} ms alone, {levels[-1].median_ms:,.0f} ms "
      f"at {levels[-1].concurrency} in flight); the run made {r.per_s:,.0f} requests/s of "
      f"{state.per_request:.1f} images each (order='{r.order}'{cap}): {rate}"
    )
  return {
    "cores": f"all {cores} cores busy: {rate}",
    "gil": (
      f"the GIL: {procs} x {state.threads} threads, each image holding it "
      f"~{gil_us:.0f} us (read, Python per image and batch, Grain): {rate}"
    ),
    "threads": f"num_threads={state.threads} decode threads per process: {rate}",
    "reads": (
      f"reads: {procs} x {read_ahead(state, s.batch_size):,} records in flight "
      f"(read_ahead_mb={state.ahead_mb:g}"
      + (f", read_ahead={state.max_depth}" if state.max_depth else "")
      + f"), {state.read_s * 1e3:.1f} ms a request of {state.per_request:.1f} images: {rate}"
    ),
    "prefetch": (
      f"prefetch={state.prefetch} batches being decoded, too few tasks for "
      f"{state.threads} decode threads: {rate}"
    ),
    "main": f"the main process receiving every worker's batches: {rate}",
  }[limit]


def _recommend(d: Diagnosis, start: _State, need: float | None) -> None:
  """Fills d.recommendations and d.notes. Changes are proposed in turn, each on top of the
  ones before; its gain is the model's rate with it over without it, and its expected
  rate the measured one scaled by the model's rate with all changes so far (on another
  host: the model's rate)."""
  s, C, costs = d.settings, d.cores, d.costs
  state = start

  def rate(st: _State) -> float:
    return min(model(costs, st, C, s).values())

  base = rate(start)
  # Under a request budget the model's rate is storage's ceiling, which reads queueing
  # at storage fall short of: the expected rates are the model's.
  scale = d.run.images_per_sec / base if d.here and not start.budget_per_s else 1.0

  def propose(field, current, proposed, why, writes, since=None, **change):
    """Adds the change when it gains 5% over the model's rate without it (or over the
    rate `since`, given for a change worth making whatever the model says)."""
    nonlocal state
    new = dataclasses.replace(state, **change)
    gain = rate(new) * scale / since if since else rate(new) / rate(state)
    if gain >= 1.05 or since:
      state = new
      d.recommendations.append(
        Recommendation(
          field, current, proposed, round(rate(new) * scale, 1), round(gain, 3), why, writes
        )
      )
    return state

  if d.bottleneck == "train step":
    d.notes.append(
      f"the input ({d.run.images_per_sec:.0f} img/s alone) keeps up with a "
      f"{d.step_ms:g} ms step ({need:.0f} img/s): no input change will speed up "
      "training"
    )
  else:
    if state.budget_per_s:
      _recommend_requests(d, state, propose, rate)
    if not start.dct and "decode_dct" in costs:
      propose(
        "dct_scaling",
        False,
        True,
        f"{d.measured.dct_share:.0%} of the crops are at least twice image_size and "
        f"decode at 1/2 to 1/8 resolution ({costs['decode'].cpu_ms:.2f} -> "
        f"{costs['decode_dct'].cpu_ms:.2f} ms per image)",
        {"decoding.dct_scaling": True},
        dct=True,
      )
    if state.read_s:
      state = _recommend_reads(d, state, propose, rate)
    _recommend_processes(d, state, propose)
    prefetch = max(
      state.prefetch,
      _smallest(range(1, MAX_PREFETCH + 1), lambda p: rate(dataclasses.replace(state, prefetch=p))),
    )
    batch_mb = s.batch_size * s.image_size**2 * 3 / 2**20
    task = decode_stage.task_size(s.batch_size, state.threads)
    propose(
      "prefetch",
      state.prefetch,
      prefetch,
      f"each batch of {s.batch_size} images is {-(-s.batch_size // task)} decode tasks: "
      f"{prefetch} batches being decoded keep the {state.threads} decode threads busy "
      f"(+{(prefetch - state.prefetch) * batch_mb:.0f} MB of batches held per process)",
      {"performance.prefetch": prefetch},
      prefetch=prefetch,
    )
    # Cache: decode once, then crop and flip the cached pixels in every later epoch.
    fits = d.cache_estimate_mb <= 0.5 * psutil.virtual_memory().available / 2**20
    if not state.cached and fits:
      side = round(s.image_size / s.aug.crop_fraction)
      budget = float(math.ceil(d.cache_estimate_mb * 1.2))
      propose(
        "cache_mb",
        s.dec.cache_mb,
        budget,
        f"decoded images (shorter side {side}) take ~{d.cache_estimate_mb:.0f} MB and "
        f"fit in RAM: after the first epoch the decode ({costs['decode'].cpu_ms:.2f} ms "
        f"CPU) becomes a crop of cached pixels ({costs['augment_cached'].cpu_ms:.2f} "
        "ms)",
        {"decoding.cache_mb": budget},
        cached=True,
      )
    elif not state.cached:
      d.notes.append(
        f"caching decoded images would need ~{d.cache_estimate_mb:.0f} MB, more "
        "than half the free RAM: no cache recommended"
      )
    if need:
      d.notes.append(
        f"the input ({d.run.images_per_sec:.0f} img/s alone) is slower than a "
        f"{d.step_ms:g} ms step needs ({need:.0f} img/s)"
      )
  _notes(d)


def _recommend_requests(d: Diagnosis, state: _State, propose, rate) -> None:
  """Under storage's request ceiling: requests kept just under it
  (performance.max_requests_per_s), so that reads wait their turn in the pipeline instead
  of queueing at storage; then more images per request (the block order, larger blocks) up
  to the rate the rest of the host allows."""
  s, r, m = d.settings, d.run.requests, d.measured
  ceiling = m.storage.request_budget_per_s(m.cores)
  under = math.floor(storage_check.UNDER * ceiling)
  if r.max_per_s is None or r.max_per_s > under:
    levels = m.storage.levels
    state = propose(
      "max_requests_per_s",
      r.max_per_s,
      under,
      f"just under storage's ~{ceiling:,.0f} requests/s, so that reads wait their turn in "
      f"the pipeline instead of queueing at storage (a read took {r.latency_ms:,.0f} ms in "
      f"the run, {r.latency_open_ms:,.1f} ms at open; {levels[-1].median_ms:,.0f} ms at "
      f"{levels[-1].concurrency} in flight in the storage check)",
      {"performance.max_requests_per_s": under},
      since=d.run.images_per_sec,
      budget_per_s=float(under),
    )
  if r.order == "global":
    k = s.other.get("block_records", BLOCK_RECORDS)
    state = propose(
      "order",
      "global",
      "blocks",
      f"one request per image; the block order (pipeline.order.blocks) reads {k} consecutive "
      f"records a request: up to ~{state.budget_per_s * k:,.0f} img/s at "
      f"{state.budget_per_s:,.0f} requests/s",
      {"order": "blocks"},
      per_request=float(k),
    )
  if state.per_request > 1:  # the block order: larger blocks for the rate the host allows
    rest = rate(dataclasses.replace(state, budget_per_s=math.inf))  # no read waits
    k = math.ceil(rest / state.budget_per_s)
    current = r.block_records or s.other.get("block_records", BLOCK_RECORDS)
    if k > current:
      propose(
        "block_records",
        current,
        k,
        f"the host allows ~{rest:,.0f} img/s: at {state.budget_per_s:,.0f} requests/s that "
        f"is {k} images per request (larger blocks hold more memory ahead: "
        "performance.read_ahead_mb)",
        {"block_records": k},
        per_request=float(k),
      )


def _recommend_reads(d: Diagnosis, state: _State, propose, rate) -> _State:
  """Records read ahead for the reads in flight the rest of the host needs (Little's law):
  performance.read_ahead (batches) when it caps them, then performance.read_ahead_mb."""
  s = d.settings
  batch_mb = s.batch_size * state.record_bytes / 2**20
  most = max(1, math.ceil(read_lib.MAX_READ_THREADS * state.per_request / s.batch_size))
  unset = dataclasses.replace(state, max_depth=None)
  batches = _smallest(
    range(1, most + 1), lambda b: rate(dataclasses.replace(unset, ahead_mb=b * batch_mb))
  )
  latency = f"{state.read_s * 1e3:.1f} ms a request of {state.per_request:.1f} images"
  if state.max_depth and state.max_depth < batches:
    state = propose(
      "read_ahead",
      state.max_depth,
      None,
      f"at {latency}, {batches} batches read ahead keep the decode threads fed; None lets "
      "the read stage size them by Little's law, within read_ahead_mb",
      {"performance.read_ahead": None},
      max_depth=None,
    )
  need = float(math.ceil(batches * batch_mb))
  if need > state.ahead_mb:
    state = propose(
      "read_ahead_mb",
      state.ahead_mb,
      need,
      f"at {latency}, the reads in flight the host needs (Little's law) are {batches} "
      f"batches of {state.record_bytes / 1e3:.0f} KB records a process "
      f"(x{max(state.workers, 1)} processes: within performance.memory_mb)",
      {"performance.read_ahead_mb": need},
      ahead_mb=need,
    )
  threads = math.floor(read_lib.MAX_READ_THREADS * state.per_request)
  if (
    read_ahead(state, s.batch_size) >= threads
    and binding(model(d.costs, state, d.cores, s)) == "reads"
  ):
    d.notes.append(
      f"the read stage's {read_lib.MAX_READ_THREADS} I/O threads a process are all waiting: "
      "more images a request (order='blocks', block_records) or more worker processes "
      "read more at once"
    )
  return state


def _recommend_processes(d: Diagnosis, state: _State, propose) -> None:
  """Worker processes x decode threads: `parallelism.plan` with the measured costs; when
  the decode threads' work mostly waits (slow storage), threads beyond the cores."""
  s, C, costs = d.settings, d.cores, d.costs
  hc = host_costs(costs, state, s)
  best = parallelism.plan(
    C,
    batch_size=s.batch_size,
    image_bytes=s.image_size**2 * 3,
    prefetch=state.prefetch,
    costs=hc,
    memory_bytes=None if d.here else C * 2**30,
  )
  workers, threads = best.workers, best.threads
  if hc.wait_us > 0.5 * hc.cpu_us:  # the work waits: more threads overlap the waiting

    def rate(t: int) -> float:
      st = dataclasses.replace(state, workers=workers, threads=t, prefetch=MAX_PREFETCH)
      return min(model(costs, st, C, s).values())

    threads = _smallest(range(1, 8 * C + 1), rate)
  if (workers, threads) == (state.workers, state.threads):
    return
  why = (
    f"per image {hc.cpu_us:.0f} us of CPU, {hc.gil_us:.0f} us of it holding the GIL"
    + (
      f", {hc.wait_us:.0f} us waiting off-CPU: threads beyond the {C} cores overlap the waiting"
      if threads > C
      else ""
    )
    + (
      f"; worker processes each hold their own GIL (~{hc.worker_mb:.0f} MB each)"
      if workers
      else "; one process: no pickling, instant start"
    )
  )
  propose(
    "num_workers x num_threads",
    f"{state.workers} x {state.threads}",
    f"{workers} x {threads}",
    why,
    {"performance.num_workers": workers, "performance.num_threads": threads},
    workers=workers,
    threads=threads,
  )


def _notes(d: Diagnosis) -> None:
  s = d.settings
  d.notes.append(
    f"DCT scaling {'applies' if s.dec.dct_scaling else 'would apply'} to "
    f"{d.measured.dct_share:.0%} of the crops at image_size {s.image_size} "
    "(those at least twice the output size)"
  )
  if d.input_stage == "read":
    d.notes.append(
      f"reading is slow: each process keeps the records of the batches its read-ahead holds "
      f"in flight, up to {read_lib.MAX_READ_THREADS} requests at once (pipeline.stages.read); "
      "the record cache (record_cache_mb) reads storage once, the block order (order='blocks') "
      "reads more images a request, and a local disk reads faster than network storage"
    )
  if d.input_stage == REQUEST_BUDGET:
    d.notes.append(
      "the GIL-held time is not measured under a request budget: its emulated run would "
      "wait on storage's requests, not on the GIL"
    )
  auto = s.plan(d.cores, None if d.here else d.cores * 2**30)
  if s.perf.num_workers is None or s.perf.num_threads is None:
    d.notes.append(f"on {d.cores} cores make_dataset chooses {auto.describe()}")
  if d.measured.load_average > d.measured.cores:
    d.notes.append(
      f"load average {d.measured.load_average:.1f} on {d.measured.cores} cores: "
      "other work shares the CPUs, so rates are noisy; run again on a quiet "
      "machine"
    )


# ---------------------------------------------------------------- report and --apply


def verdict_host(d: Diagnosis) -> str:
  """Which host the verdict is about: this one (measured) or the one --cores projects."""
  return f"this host ({d.cores} cores)" if d.here else f"a projected host of {d.cores} cores"


def requests_line(q: Requests) -> str:
  """The run's storage requests in one line."""
  plan = "one per image" if q.order == "global" else f"one per block of {q.block_records}"
  cap = f", at most {q.max_per_s:,.0f}/s" if q.max_per_s else ""
  return (
    f"storage requests (order='{q.order}': {plan}{cap}): {q.made:,} in the timed run, "
    f"{q.per_s:,.0f}/s, {q.kb_per_request:,.0f} KB and {q.images_per_request:.1f} images per "
    f"request; a read took {q.latency_open_ms:.1f} ms at open, {q.latency_ms:.1f} ms at the end"
  )


def report(d: Diagnosis) -> str:
  s, r, m = d.settings, d.run, d.measured
  plan = parallelism.Plan(d.plan["workers"], d.plan["threads"])
  source = f"from {s.recipe}" if s.recipe else "defaults: --config RECIPE takes the run's"
  lines = [
    (
      f"pipeline doctor: {s.data_dir} ({s.split}, {m.num_records} records, {m.num_shards} "
      f"shards), batch {s.batch_size}, image {s.image_size} ({source}), performance "
      f"{dataclasses.asdict(s.perf)}, decoding {dataclasses.asdict(s.dec)}"
    ),
    f"machine: {measure.machine()}, load average {m.load_average}",
    "",
    "stages alone, one thread, per image:   wall ms    cpu ms  queued ms",
  ]
  notes = {
    "other": "  (the run's CPU beyond its stages: crop box, RNG, Python, Grain)",
    "python": (f"  (GIL held, per image: decode and resize emulated, {CEILING_THREADS} threads)"),
    "cache_fill": "  (once per image with cache_mb)",
    "augment_cached": "  (every image after the first epoch with cache_mb)",
  }
  for name, c in d.costs.items():
    lines.append(
      f"  {name:16s}                    {c.wall_ms:8.3f}  {c.cpu_ms:8.3f}  "
      f"{c.queued_ms:8.3f}{notes.get(name, '')}"
    )
  host = (
    f"this host ({d.cores} cores)"
    if d.here
    else f"a host of {d.cores} cores (this one has {m.cores}: projected, not measured)"
  )
  verdict = f"bottleneck on {verdict_host(d)}"
  lines += [
    "",
    f"on {host}, {plan.describe()}, what each resource allows: "
    + ", ".join(f"{k} {v:.0f} img/s" for k, v in d.limits.items()),
    (
      f"whole pipeline here: {r.images_per_sec:.0f} img/s measured"
      + (
        f" vs {d.predicted:.0f} predicted ({r.images_per_sec / d.predicted:.0%})" if d.here else ""
      )
      + f"; first batch {r.first_batch_s:.2f} s; {r.cpu_ms_per_image:.2f} ms CPU per image "
      f"({r.images} images in {r.seconds:.1f} s)"
    ),
  ]
  if r.requests:
    lines.append(requests_line(r.requests))
  if m.consumer_run:
    w = m.consumer_run.wait_share
    level = "highly" if w >= 0.2 else "moderately" if w >= 0.05 else "not"
    lines.append(
      f"with a {d.step_ms:g} ms train step: {m.consumer_run.images_per_sec:.0f} "
      f"img/s, waiting for input {w:.0%} of the time: {level} input-bound"
    )
  if d.bottleneck == "train step":
    lines.append(
      f"\n{verdict}: the train step; the input's own limit is {d.input_stage} ({d.limit})"
    )
  else:
    lines.append(f"\n{verdict}: {d.bottleneck} ({d.limit})")
  lines.append(
    "recommendations (expected rates include the changes above them):"
    if d.recommendations
    else "recommendations: none"
  )
  for k, rec in enumerate(d.recommendations, 1):
    lines.append(
      f"  {k}. {rec.field} {rec.current} -> {rec.proposed}: x{rec.gain:.2f}, "
      f"expected {rec.expected_images_per_sec:.0f} img/s; {rec.why}"
    )
  lines += [f"  - {n}" for n in d.notes]
  return "\n".join(lines)


def find_config(name_or_path: str) -> str:
  """A recipe's path, as the trainer finds it: a file, or a name in the repo's configs/."""
  try:
    return os.fspath(train_config.find(name_or_path))
  except ValueError as e:
    raise UsageError(f"no config file {name_or_path} ({e})") from None


def load_config(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file; one inside a package imports as that package."""
  if not pathlib.Path(path).is_file():
    raise UsageError(f"no config file {path}")
  name, root = _module_name(path)
  if name:
    if root not in sys.path:
      sys.path.insert(0, root)
    return importlib.import_module(name).get_config()
  spec = importlib.util.spec_from_file_location("doctor_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _module_name(path: str) -> tuple[str | None, str]:
  """('configs.x', root) for ROOT/configs/x.py when configs/ is a package, else (None, '')."""
  p = pathlib.Path(path).resolve()
  parts, d = [p.stem], p.parent
  while (d / "__init__.py").exists():
    parts.insert(0, d.name)
    d = d.parent
  return (".".join(parts), os.fspath(d)) if len(parts) > 1 else (None, "")


def _plain(value):
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  return tuple(value) if isinstance(value, list) else value


def override(config: ml_collections.ConfigDict, flags: list[str]) -> None:
  """Applies the trainer's `--config.FIELD=VALUE` overrides to `config` (values as Python
  literals, else strings; each field keeps its type)."""
  for flag in flags:
    key, sep, text = flag.removeprefix("--config.").partition("=")
    if not flag.startswith("--config.") or not sep:
      raise UsageError(f"unrecognized argument {flag}: overrides are --config.FIELD=VALUE")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = {"true": True, "false": False}.get(text.lower(), text)
    *parents, leaf = key.split(".")
    node = config
    try:
      for name in parents:
        node = node[name]
      if leaf not in node:
        raise KeyError(leaf)
      node[leaf] = value
    except (KeyError, AttributeError):
      raise UsageError(f"unknown config field {key} (in --config.{key}={text})") from None
    except TypeError as e:
      raise UsageError(f"--config.{key}={text}: {' '.join(str(e).split())}") from None


def settings_from_config(config, path: str = "the config") -> Settings:
  """Settings from a config's `input` block (make_dataset's keywords), its global
  batch_size (one process) and seed (unless the input names its own)."""
  if "input" not in config:
    raise UsageError(
      f"{path} has no `input` block (pipeline.make_dataset's keywords, as in configs/default.py)"
    )
  kwargs = {k: v for k, v in _plain(config.input).items() if v is not None}  # None: unset
  fields = {f.name for f in dataclasses.fields(Settings)} - {"batch_size", "other"}
  known = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
  known.setdefault("seed", config.get("seed", 0))
  known["augment"] = known.get("augment") or {}
  known["performance"] = known.get("performance") or {}
  known["decoding"] = known.get("decoding") or {}
  return Settings(batch_size=config.get("batch_size", 128), other=kwargs, recipe=path, **known)


def write_config(path: str, d: Diagnosis, base_module: str, base, command: str) -> None:
  """Writes a config that imports `base_module` and sets, in its `input` block, the
  diagnosed settings that differ from `base` plus the recommendations."""
  diagnosed = dataclasses.asdict(d.settings)
  current = dataclasses.asdict(settings_from_config(base))
  lines, why = {}, {}
  for key in ("data_dir", "split", "image_size", "seed"):
    if diagnosed[key] != current[key]:
      lines[f"input.{key}"] = diagnosed[key]
  if d.settings.batch_size != current["batch_size"]:
    lines["batch_size"] = d.settings.batch_size
  for group in ("augment", "decoding", "performance"):
    for key, value in diagnosed[group].items():
      if current[group].get(key) != value:
        lines[f"input.{group}.{key}"] = value
  for rec in d.recommendations:
    for key, value in rec.writes.items():
      lines[f"input.{key}"] = value
      why[f"input.{key}"] = f"was {rec.current}: x{rec.gain:.2f} expected"
  best = max([d.run.images_per_sec] + [r.expected_images_per_sec for r in d.recommendations])
  module, _, name = base_module.rpartition(".")
  body = (
    "\n".join(f"  c.{k} = {v!r}" + (f"  # {why[k]}" if k in why else "") for k, v in lines.items())
    or "  pass  # nothing to change"
  )
  host = f"{d.cores} cores" + ("" if d.here else " (projected)")
  pathlib.Path(path).write_text(
    f'"""{base_module}, tuned by the pipeline doctor for {host} on {measure.machine()}.\n\n'
    f"    {command}\n\n"
    f"Measured {d.run.images_per_sec:.0f} img/s (bottleneck: {d.bottleneck}); expected "
    f"{best:.0f} img/s with these settings.\n"
    f'"""\n\nfrom {module} import {name} as base\n\n\n'
    f"def get_config():\n  c = base.get_config()\n{body}\n  return c\n"
  )


def parser() -> argparse.ArgumentParser:
  p = measure.Parser(
    prog="python -m bench.doctor",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("data_dir", nargs="?", help="converted dataset (default: the config's)")
  p.add_argument(
    "--config",
    help="the run's recipe, as the trainer takes it (a name in configs/ or a file): its "
    "`input` block and batch_size are used, with any --config.FIELD=VALUE overrides (these "
    "alone: the default recipe)",
  )
  p.add_argument("--split", help="split to read (default: train)")
  p.add_argument("--batch-size", type=int, help="per-process batch size")
  p.add_argument("--image-size", type=int)
  p.add_argument("--num-threads", type=int, help="decode threads per process (default: auto)")
  p.add_argument("--num-workers", type=int, help="worker processes (default: auto)")
  p.add_argument("--prefetch", type=int, help="batches being decoded per process")
  p.add_argument("--read-ahead-mb", type=float, help="record bytes read ahead per process")
  p.add_argument("--cache-mb", type=float, help="decoded-image cache budget")
  p.add_argument("--record-cache-mb", type=float, help="record cache budget (0: off)")
  p.add_argument(
    "--max-requests-per-s", type=float, help="storage requests per second at most (a budget)"
  )
  p.add_argument(
    "--order", choices=("global", "blocks"), help="the shuffle's order (default: by storage)"
  )
  p.add_argument("--block-records", type=int, help="images per request in the block order")
  p.add_argument("--no-dct-scaling", dest="dct_scaling", action="store_false", default=None)
  p.add_argument("--cores", type=int, help="recommend for a host of this many cores")
  p.add_argument("--seconds", type=float, default=5.0, help="length of the whole-pipeline run")
  p.add_argument("--sample", type=int, default=128, help="images timed per stage")
  p.add_argument("--step-ms", type=float, help="your train step: measure the input wait")
  p.add_argument(
    "--out",
    help="folder for the timeline and the diagnosis (default: runs/doctor/DATE-TIME)",
  )
  p.add_argument(
    "--timeline", help="timeline picture of the run (default: OUT/timeline.png; '' to skip)"
  )
  p.add_argument(
    "--storage-levels",
    default="1,16,128",
    help="reads in flight at which to time DATA_DIR's reads ('' skips the storage check)",
  )
  p.add_argument(
    "--storage-reads", type=int, default=256, help="reads timed at each of --storage-levels"
  )
  p.add_argument(
    "--get-price",
    type=float,
    default=storage_check.GET_PRICE_PER_1000,
    help="USD per 1,000 GETs for the epoch's cost (default: GCS class B, 0.0004)",
  )
  p.add_argument("--apply", metavar="OUT.py", help="write the tuned settings to this config")
  p.add_argument("--json", help="the diagnosis as JSON (default: OUT/diagnosis.json; '' to skip)")
  p.add_argument("--verbose", action="store_true", help="tracebacks for errors")
  return p


def _settings(
  args, overrides: list[str] = ()
) -> tuple[Settings, str | None, ml_collections.ConfigDict | None]:
  """The settings to diagnose, the config's module name (for --apply) and the config, with
  the trainer's `--config.FIELD=VALUE` `overrides` (which alone take its default recipe)."""
  base_module, base = None, None
  if overrides and not args.config:
    args.config = "default"
  if args.config:
    args.config = find_config(args.config)
    base_module = _module_name(args.config)[0]
    base = load_config(args.config)
    config = base.copy_and_resolve_references()  # `base` stays the recipe --apply imports
    override(config, list(overrides))
    s = settings_from_config(config, args.config)
  elif args.data_dir:
    s = Settings(args.data_dir)
  else:
    raise UsageError("give DATA_DIR or --config")
  if args.apply and not base_module:
    given = f"{args.config} is not" if args.config else "none was given"
    raise UsageError(f"--apply needs a --config inside a package (like configs/); {given}")
  if args.apply and os.path.realpath(args.apply) == os.path.realpath(args.config):
    raise UsageError(f"--apply {args.apply} is the recipe itself: name a new file")
  for field in ("data_dir", "split", "batch_size", "image_size"):
    if getattr(args, field) is not None:
      setattr(s, field, getattr(args, field))
  performance = (
    "num_threads",
    "num_workers",
    "prefetch",
    "read_ahead_mb",
    "record_cache_mb",
    "max_requests_per_s",
  )
  for field in performance:
    if getattr(args, field) is not None:
      s.performance = {**s.performance, field: getattr(args, field)}
  for field in ("cache_mb", "dct_scaling"):
    if getattr(args, field) is not None:
      s.decoding = {**s.decoding, field: getattr(args, field)}
  for field in ("order", "block_records"):
    if getattr(args, field) is not None:
      s.other = {**s.other, field: getattr(args, field)}
  for name, value in (
    ("--batch-size", s.batch_size),
    ("--image-size", s.image_size),
    ("--cores", args.cores),
    ("--sample", args.sample),
    ("--storage-reads", args.storage_reads),
  ):
    if value is not None and value < 1:
      raise UsageError(f"{name} must be positive, got {value}")
  if args.seconds <= 0 or (args.step_ms is not None and args.step_ms <= 0):
    raise UsageError("--seconds and --step-ms must be positive")
  try:
    args.storage_levels = [int(x) for x in args.storage_levels.split(",") if x.strip()]
  except ValueError:
    raise UsageError(
      f"--storage-levels takes integers like 1,16,128: {args.storage_levels}"
    ) from None
  if any(x < 1 for x in args.storage_levels) or args.get_price < 0:
    raise UsageError("--storage-levels must be >= 1 and --get-price >= 0")
  s.check()
  meta = manifest_lib.load(s.data_dir)
  if s.split not in meta.splits:
    raise UsageError(f"{s.data_dir} has no split {s.split!r} (has: {sorted(meta.splits)})")
  return s, base_module, base


def main(argv: list[str] | None = None) -> Diagnosis:
  argv = sys.argv[1:] if argv is None else argv
  p = parser()
  args, overrides = p.parse_known_args(argv)
  if unknown := [a for a in overrides if not (a.startswith("--config.") and "=" in a)]:
    p.error(f"unrecognized arguments: {' '.join(unknown)} (overrides are --config.FIELD=VALUE)")
  try:
    return _main(args, argv, overrides)
  except (UsageError, FileNotFoundError, ValueError, TypeError, KeyError, OSError) as e:
    if args.verbose:
      traceback.print_exc()
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _outputs(args) -> tuple[str, str]:
  """The timeline and JSON paths: as given, else in the --out folder (default: a new folder
  under runs/doctor/, never the current directory); '' skips one."""
  out = pathlib.Path(args.out or f"runs/doctor/{time.strftime('%Y%m%d-%H%M%S')}")
  timeline_path = os.fspath(out / "timeline.png") if args.timeline is None else args.timeline
  json_path = os.fspath(out / "diagnosis.json") if args.json is None else args.json
  return timeline_path, json_path


def _main(args, argv: list[str], overrides: list[str] = ()) -> Diagnosis:
  s, base_module, base = _settings(args, overrides)
  timeline_path, json_path = _outputs(args)
  recorder = timeline.Recorder()
  m = measure_all(
    s, args.seconds, args.step_ms, args.sample, recorder, args.storage_levels, args.storage_reads
  )
  d = diagnose(s, m, args.step_ms, args.cores)
  print(report(d))
  storage = None
  if m.storage:  # for the rate the CPUs allow when no read waits (not d.predicted, which
    # slow storage already lowers), and this process's share of it
    check = m.storage
    processes = max(1, d.plan.get("workers") or 0)
    rate = min(v for k, v in d.limits.items() if k in ("cores", "gil", "main"))
    advice = storage_check.advise(check, rate / processes, d.cores, rate, args.get_price, processes)
    print("\n" + storage_check.report(check, advice, s.other.get("block_records")))
    storage = {"check": dataclasses.asdict(check), "advice": dataclasses.asdict(advice)}
  if timeline_path:
    os.makedirs(os.path.dirname(os.path.abspath(timeline_path)), exist_ok=True)
    events = recorder.events()
    start = min(e.start for e in events)
    shown = m.consumer_run or m.run  # the recorded run: start-up, then 1.5 s of it
    window = [e for e in events if e.start < start + shown.first_batch_s + 1.5]
    timeline.draw(
      window,
      timeline_path,
      f"{s.data_dir}: {m.run.images_per_sec:.0f} img/s on this host; bottleneck on "
      f"{verdict_host(d)}: {d.bottleneck}",
    )
    print(f"timeline: {timeline_path}")
  command = "python -m bench.doctor " + " ".join(argv)
  if args.apply:
    write_config(args.apply, d, base_module, base, command)
    print(f"wrote {args.apply}")
  if json_path:
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    measure.write_json(
      json_path,
      {
        **dataclasses.asdict(d),
        "storage": storage,
        "machine": measure.machine(),
        "command": command,
      },
    )
    print(f"diagnosis: {json_path}")
  return d


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
