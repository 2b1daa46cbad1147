"""The rule table: what each resource allows a pipeline, and which binds, from measured costs.

`model(costs, state, cores, spec)` evaluates `pipeline.host.parallelism`'s host model (threads, GIL,
cores, the main process receiving workers' batches) plus the loader's own limits on what a run
measured (P = max(W, 1) processes of W worker processes):

    reads:    P x N / L   Little's law on the read stage (`pipeline.stages.read`): each process
                          keeps N records in flight at storage, the batches its read-ahead share
                          holds (performance.read_ahead_mb, at least one batch, at most
                          performance.read_ahead batches), within MAX_READ_THREADS requests of K
                          images; L: a request's latency as the run measured it
    prefetch: P x D / S   prefetch batches being decoded, each cut into tasks
                          (`pipeline.stages.decode.task_size`), give D = min(T, prefetch x tasks)
                          of the T decode threads work of S per image (parse, decode, augment)
    requests: C x K       storage answers C requests/s however many are in flight (a storage
                          check), K images per request; counted when the run presses C

The smallest limit names the resource, its largest stage the bottleneck; re-evaluating the
model with other settings gives each recommendation's expected gain (`pipeline.explain.advise`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from pipeline.explain.evidence import STAGES, Cost, Measured, Run
from pipeline.host import parallelism
from pipeline.image import decode
from pipeline.spec import Spec
from pipeline.stages import decode as decode_stage
from pipeline.stages.read import MAX_READ_THREADS

GIL_STAGES = ("read", "parse", "other")  # "other": crop box, RNG, Python layers, Grain
LIMITS = ("requests", "cores", "gil", "threads", "reads", "prefetch", "main")  # ties: hardware
MAX_PREFETCH = 16
REFERENCE_PIXELS = 224 * 224  # the image size parallelism.COSTS were measured at
PRESSED = 0.75  # a run making this share of storage's request ceiling is bound by it
QUEUED = 2.0  # a read's latency this many times another's, with more in flight: a queue
UNDER = 0.95  # performance.max_requests_per_s advised: this share of the requests/s ceiling
REQUEST_BUDGET = "storage request budget"  # the bottleneck's name when requests bind


@dataclasses.dataclass
class Recommendation:
  """One change, its expected rate and its gain over the rate without it."""

  field: str
  current: object
  proposed: object
  expected_images_per_sec: float
  gain: float
  why: str
  writes: dict  # make_dataset keyword paths -> values, e.g. {"performance.prefetch": 8}


@dataclasses.dataclass
class Explanation:
  """What bounds a pipeline on a host, and the changes proposed in turn (`explain`)."""

  cores: int  # the host explained, maybe not the measured one
  here: bool  # whether that host is the measured one
  plan: dict  # workers and threads make_dataset runs with there
  costs: dict[str, Cost]  # stages, plus "other" (the rest of the run's CPU)
  limits: dict[str, float]  # images/s each resource allows
  predicted: float
  bottleneck: str  # a stage, or "train step" when the input keeps up
  input_stage: str  # the stage limiting the input pipeline itself
  limit: str  # which resource binds, in words
  recommendations: list[Recommendation]
  notes: list[str]
  cache_estimate_mb: float | None  # None: not measured


@dataclasses.dataclass(frozen=True)
class State:
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


def host_plan(spec: Spec, cores: int, memory_bytes: int | None = None) -> parallelism.Plan:
  """The workers x threads `make_dataset` runs `spec` with on a host of `cores` cores."""
  p = spec.performance
  return parallelism.plan(
    cores,
    num_workers=p.num_workers,
    num_threads=p.num_threads,
    batch_size=spec.batch_size,
    image_bytes=spec.image_size**2 * 3,
    prefetch=p.prefetch,
    memory_bytes=memory_bytes,
  )


def free_stages(costs: dict[str, Cost], state: State) -> tuple[str, ...]:
  """The decode threads' GIL-free work: decode and augment, or a crop of the cache
  ("decode_dct", measured with DCT scaling on, when the settings have it off)."""
  if state.cached:
    return ("augment_cached",)
  return ("decode_dct" if state.dct and "decode_dct" in costs else "decode", "augment")


def gil_stages(costs: dict[str, Cost], state: State) -> tuple[str, ...]:
  """The work holding the GIL. The native path: "python", measured, else read and other
  (it parses in C without the GIL); the Python path (a RAM cache, no C extension): read,
  parse and other."""
  if decode.native() is None or state.cached:
    return GIL_STAGES
  return ("python",) if "python" in costs else ("read", "other")


def with_other(costs: dict[str, Cost], run: Run, workers: int, spec: Spec) -> dict[str, Cost]:
  """The stage costs plus "other": the run's CPU per image beyond its stages and the
  workers' transfer (crop box, RNG, Python layers, Grain)."""
  t = _transfer_us(spec)
  per_batch = t["receive_us"] * parallelism.COSTS_BATCH / spec.batch_size
  transfer = t["send_us"] + t["receive_free_us"] + per_batch if workers else 0.0
  staged = sum(costs[x].cpu_ms for x in STAGES)
  other = round(max(run.cpu_ms_per_image - transfer / 1e3 - staged, 0.0), 4)
  return {**costs, "other": Cost(other, other)}


def _transfer_us(spec: Spec) -> dict[str, float]:
  """Worker transfer costs per image, from parallelism.COSTS: the pages' share scaled to
  this image size (the Python per batch is spread by `parallelism.at_batch`)."""
  pixels = spec.image_size**2 / REFERENCE_PIXELS
  base = parallelism.COSTS
  return {
    "send_us": base.send_us * pixels,
    "receive_free_us": base.receive_free_us * pixels,
    "receive_us": base.receive_us,
  }


def host_costs(costs: dict[str, Cost], state: State, spec: Spec) -> parallelism.Costs:
  """`parallelism.Costs` from measured stage costs (with "other")."""
  free = free_stages(costs, state)
  wait = sum(costs[x].active_ms - costs[x].cpu_ms for x in ("parse", *free)) * 1e3
  return parallelism.Costs(
    cpu_us=sum(costs[x].cpu_ms for x in (*GIL_STAGES, *free)) * 1e3,
    gil_us=max(sum(costs[x].cpu_ms for x in gil_stages(costs, state)) * 1e3, 1.0),
    handoff=parallelism.COSTS.handoff,
    worker_mb=parallelism.COSTS.worker_mb,
    wait_us=max(wait, 0.0),
    **_transfer_us(spec),
  )


def read_ahead(state: State, batch_size: int) -> int:
  """Records one process keeps in flight at storage: the batches its read-ahead share holds
  (at least one, at most performance.read_ahead; `ReadAhead.bounds`' ceiling), within
  MAX_READ_THREADS requests of `state.per_request` records."""
  batches = max(1, int(state.ahead_mb * 2**20 // max(1.0, state.record_bytes * batch_size)))
  records = min(batches, state.max_depth or batches) * batch_size
  return min(records, math.floor(MAX_READ_THREADS * state.per_request))


def model(costs: dict[str, Cost], state: State, cores: int, spec: Spec) -> dict[str, float]:
  """Images/s each resource allows (the module docstring and pipeline.host.parallelism)."""
  hc = parallelism.at_batch(host_costs(costs, state, spec), spec.batch_size)
  lim = parallelism.limits(cores, hc, parallelism.Plan(state.workers, state.threads))
  processes = max(state.workers, 1)
  if state.budget_per_s:  # requests: storage answers so many a second, however many wait
    lim["requests"] = state.budget_per_s * state.per_request
  if state.read_s:  # Little's law on the records in flight; none without storage requests
    lim["reads"] = processes * read_ahead(state, spec.batch_size) / state.read_s
  work_wall = sum(costs[x].active_ms for x in ("parse", *free_stages(costs, state))) / 1e3
  tasks = -(-spec.batch_size // decode_stage.task_size(spec.batch_size, state.threads))
  decoding = min(state.threads, state.prefetch * tasks)  # tasks the decode threads can run
  lim["prefetch"] = processes * decoding / max(work_wall, 1e-9)
  return lim


def binding(limits: dict[str, float]) -> str:
  """The limit with the lowest rate; near ties (2%) go to the hardware first."""
  low = min(limits.values())
  return next(k for k in LIMITS if k in limits and limits[k] <= low * 1.02)


def stage_of(limit: str, costs: dict[str, Cost], state: State) -> str:
  """The stage to blame under `limit`: the largest share of the bound resource."""
  free = free_stages(costs, state)
  if limit in ("requests", "main", "reads"):
    return {"requests": REQUEST_BUDGET, "main": "transfer", "reads": "read"}[limit]
  if limit == "gil":
    return max(gil_stages(costs, state), key=lambda x: costs[x].cpu_ms)
  if limit == "cores":
    return max((*GIL_STAGES, *free), key=lambda x: costs[x].cpu_ms)
  return max(("parse", *free), key=lambda x: costs[x].active_ms)


def smallest(values: range, rate: Callable[[int], float], share: float = 0.95) -> int:
  """The smallest value whose rate reaches `share` of the best rate over `values`."""
  best = max(rate(v) for v in values)
  return next(v for v in values if rate(v) >= share * best)


def request_budget(m: Measured) -> float | None:
  """Storage's request ceiling (requests/s) when it binds the run: a storage check found one
  and the run makes at least PRESSED of it, or its reads queue (latency QUEUED times the one
  at open: reads ahead wait at storage). None otherwise, or where either was not measured."""
  ceiling = m.storage.ceiling_per_s if m.storage else None
  q = m.run.requests
  if ceiling and q:
    if q.per_s >= PRESSED * ceiling or q.latency_ms >= QUEUED * q.latency_open_ms:
      return ceiling
  return None


def per_record(run: Run) -> Run:
  """`run` with its CPU spread over the records it read when more than it delivered: under
  a request budget reads ahead run far past the batches delivered."""
  read = run.requests.made * run.requests.images_per_request
  return dataclasses.replace(
    run, cpu_ms_per_image=run.cpu_ms_per_image * run.images / max(run.images, read)
  )
