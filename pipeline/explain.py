"""What bounds a pipeline's images/s, and which settings would raise it, from measured costs.

`explain(spec, measured)` evaluates `pipeline.host.parallelism`'s host model (threads, GIL,
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
model with other settings gives each recommendation's expected gain. `python -m bench.doctor`
measures the costs and prints the explanation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from pipeline.host import parallelism
from pipeline.image import decode
from pipeline.order.blocks import BLOCK_RECORDS
from pipeline.spec import Spec
from pipeline.stages import decode as decode_stage
from pipeline.stages.read import MAX_READ_THREADS

STAGES = ("read", "parse", "decode", "augment")  # a train image's stages, each timed alone
GIL_STAGES = ("read", "parse", "other")  # "other": crop box, RNG, Python layers, Grain
LIMITS = ("requests", "cores", "gil", "threads", "reads", "prefetch", "main")  # ties: hardware
MAX_PREFETCH = 16
REFERENCE_PIXELS = 224 * 224  # the image size parallelism.COSTS were measured at
PRESSED = 0.75  # a run making this share of storage's request ceiling is bound by it
QUEUED = 2.0  # a read's latency this many times another's, with more in flight: a queue
UNDER = 0.95  # performance.max_requests_per_s advised: this share of the requests/s ceiling
REQUEST_BUDGET = "storage request budget"  # the bottleneck's name when requests bind


@dataclasses.dataclass
class Cost:
  """Milliseconds per image of one stage run alone on one thread.

  `queued_ms` is time spent runnable but waiting for a CPU (other work on the machine);
  `active_ms` leaves it out, so a busy machine does not pass for a stage waiting on I/O.
  """

  wall_ms: float
  cpu_ms: float
  queued_ms: float = 0.0

  @property
  def active_ms(self) -> float:
    return max(self.cpu_ms, self.wall_ms - self.queued_ms)


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


@dataclasses.dataclass(frozen=True)
class Storage:
  """A storage check's verdict: the requests/s storage answers however many are in flight
  (None: no such ceiling), and a read's latency alone and at the most reads in flight."""

  ceiling_per_s: float | None
  alone_ms: float
  loaded_ms: float
  loaded_in_flight: int


@dataclasses.dataclass
class Measured:
  """What was measured on a host of `cores` cores: each stage alone (`STAGES`, plus
  "decode_dct", "cache_fill", "augment_cached"), the whole pipeline, storage."""

  cores: int
  costs: dict[str, Cost]
  run: Run
  cache_mb: float  # every decoded image of the split, cached
  dct_share: float  # share of crops decoded with DCT scaling
  load_average: float = 0.0
  python_us: float | None = None  # GIL-held time per image, where measured (native path)
  storage: Storage | None = None


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
  cache_estimate_mb: float


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


def _free_stages(costs: dict[str, Cost], state: _State) -> tuple[str, ...]:
  """The decode threads' GIL-free work: decode and augment, or a crop of the cache
  ("decode_dct", measured with DCT scaling on, when the settings have it off)."""
  if state.cached:
    return ("augment_cached",)
  return ("decode_dct" if state.dct and "decode_dct" in costs else "decode", "augment")


def _gil_stages(costs: dict[str, Cost], state: _State) -> tuple[str, ...]:
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


def host_costs(costs: dict[str, Cost], state: _State, spec: Spec) -> parallelism.Costs:
  """`parallelism.Costs` from measured stage costs (with "other")."""
  free = _free_stages(costs, state)
  wait = sum(costs[x].active_ms - costs[x].cpu_ms for x in ("parse", *free)) * 1e3
  return parallelism.Costs(
    cpu_us=sum(costs[x].cpu_ms for x in (*GIL_STAGES, *free)) * 1e3,
    gil_us=max(sum(costs[x].cpu_ms for x in _gil_stages(costs, state)) * 1e3, 1.0),
    handoff=parallelism.COSTS.handoff,
    worker_mb=parallelism.COSTS.worker_mb,
    wait_us=max(wait, 0.0),
    **_transfer_us(spec),
  )


def read_ahead(state: _State, batch_size: int) -> int:
  """Records one process keeps in flight at storage: the batches its read-ahead share holds
  (at least one, at most performance.read_ahead; `ReadAhead.bounds`' ceiling), within
  MAX_READ_THREADS requests of `state.per_request` records."""
  batches = max(1, int(state.ahead_mb * 2**20 // max(1.0, state.record_bytes * batch_size)))
  records = min(batches, state.max_depth or batches) * batch_size
  return min(records, math.floor(MAX_READ_THREADS * state.per_request))


def model(costs: dict[str, Cost], state: _State, cores: int, spec: Spec) -> dict[str, float]:
  """Images/s each resource allows (the module docstring and pipeline.host.parallelism)."""
  hc = parallelism.at_batch(host_costs(costs, state, spec), spec.batch_size)
  lim = parallelism.limits(cores, hc, parallelism.Plan(state.workers, state.threads))
  processes = max(state.workers, 1)
  if state.budget_per_s:  # requests: storage answers so many a second, however many wait
    lim["requests"] = state.budget_per_s * state.per_request
  if state.read_s:  # Little's law on the records in flight; none without storage requests
    lim["reads"] = processes * read_ahead(state, spec.batch_size) / state.read_s
  work_wall = sum(costs[x].active_ms for x in ("parse", *_free_stages(costs, state))) / 1e3
  tasks = -(-spec.batch_size // decode_stage.task_size(spec.batch_size, state.threads))
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
  if limit in ("requests", "main", "reads"):
    return {"requests": REQUEST_BUDGET, "main": "transfer", "reads": "read"}[limit]
  if limit == "gil":
    return max(_gil_stages(costs, state), key=lambda x: costs[x].cpu_ms)
  if limit == "cores":
    return max((*GIL_STAGES, *free), key=lambda x: costs[x].cpu_ms)
  return max(("parse", *free), key=lambda x: costs[x].active_ms)


def _smallest(values: range, rate: Callable[[int], float], share: float = 0.95) -> int:
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


def _per_record(run: Run) -> Run:
  """`run` with its CPU spread over the records it read when more than it delivered: under
  a request budget reads ahead run far past the batches delivered."""
  read = run.requests.made * run.requests.images_per_request
  return dataclasses.replace(
    run, cpu_ms_per_image=run.cpu_ms_per_image * run.images / max(run.images, read)
  )


def explain(
  spec: Spec, m: Measured, cores: int | None = None, step_ms: float | None = None
) -> Explanation:
  """Names what bounds `spec` (with its image_size) on a host of `cores` cores (default: the
  one `m` was measured on; another is given cores GiB of memory), with a train step of
  `step_ms` (None: input alone), and recommends settings."""
  cores = cores or m.cores
  here = cores == m.cores
  chosen = host_plan(spec, cores, None if here else cores * 2**30)
  budget = request_budget(m)
  run = _per_record(m.run) if budget else m.run
  costs = with_other(m.costs, run, host_plan(spec, m.cores).workers, spec)
  if m.python_us is not None and budget is None:  # else the emulated run waited on storage
    costs["python"] = Cost(m.python_us / 1e3, m.python_us / 1e3)
  perf, q = spec.performance, m.run.requests
  made = bool(q and q.made)
  state = _State(
    chosen.workers,
    chosen.threads,
    perf.prefetch,
    0 < m.cache_mb <= spec.decoding.cache_mb,
    spec.decoding.dct_scaling,
    # storage's own latency: under a request budget the one at the end queued at storage
    (q.latency_open_ms if budget else q.latency_ms) / 1e3 if made else 0.0,
    q.kb_per_request * 1e3 / max(q.images_per_request, 1.0) if made else 0.0,
    perf.read_ahead_mb,
    perf.read_ahead,
    budget and min(budget, q.max_per_s or budget),  # a lower max_requests_per_s
    max(q.images_per_request, 1.0) if made else 1.0,
  )
  limits = model(costs, state, cores, spec)
  predicted = min(limits.values())
  limit = binding(limits)
  input_stage = _stage_of(limit, costs, state)
  rate = m.run.images_per_sec if here else predicted
  need = spec.batch_size / (step_ms / 1e3) if step_ms else None
  e = Explanation(
    cores=cores,
    here=here,
    plan=dataclasses.asdict(chosen),
    costs=costs,
    limits={k: round(v, 1) for k, v in limits.items()},
    predicted=round(predicted, 1),
    bottleneck="train step" if need and rate >= 1.05 * need else input_stage,
    input_stage=input_stage,
    limit=_words(limit, limits, state, costs, cores, m, spec),
    recommendations=[],
    notes=[],
    cache_estimate_mb=round(m.cache_mb, 1),
  )
  _recommend(e, spec, m, state, step_ms)
  return e


def _words(
  limit: str, limits: dict[str, float], state: _State, costs: dict, cores: int, m: Measured, s: Spec
) -> str:
  rate = f"{limits[limit]:.0f} img/s at most"
  procs = f"{state.workers} worker processes" if state.workers else "one process"
  gil_us = sum(costs[x].cpu_ms for x in _gil_stages(costs, state)) * 1e3
  if limit == "requests":
    st, r = m.storage, m.run.requests
    cap = f", max_requests_per_s={r.max_per_s:g}" if r.max_per_s else ""
    return (
      f"storage answers ~{st.ceiling_per_s:,.0f} requests/s however many are in flight "
      f"(a read's latency {st.alone_ms:,.1f} ms alone, {st.loaded_ms:,.0f} ms "
      f"at {st.loaded_in_flight} in flight); the run made {r.per_s:,.0f} requests/s of "
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


def _recommend(e: Explanation, s: Spec, m: Measured, start: _State, step_ms: float | None):
  """Fills e.recommendations and e.notes. Changes are proposed in turn, each on top of the
  ones before; its gain is the model's rate with it over without it, and its expected rate
  the measured one scaled by the model's rate with all changes so far (on another host: the
  model's rate)."""
  state = start

  def rate(st: _State) -> float:
    return min(model(e.costs, st, e.cores, s).values())

  # Under a request budget the model's rate is storage's ceiling, which reads queueing at
  # storage fall short of: the expected rates are the model's.
  scale = m.run.images_per_sec / rate(start) if e.here and not start.budget_per_s else 1.0

  def propose(field, current, proposed, why, writes, since=None, **change) -> _State:
    """Adds the change when it gains 5% over the model's rate without it (or over the
    rate `since`, given for a change worth making whatever the model says)."""
    nonlocal state
    new = dataclasses.replace(state, **change)
    gain = rate(new) * scale / since if since else rate(new) / rate(state)
    if gain >= 1.05 or since:
      state = new
      expected = round(rate(new) * scale, 1)
      e.recommendations.append(
        Recommendation(field, current, proposed, expected, round(gain, 3), why, writes)
      )
    return state

  need = s.batch_size / (step_ms / 1e3) if step_ms else None
  alone = f"the input ({m.run.images_per_sec:.0f} img/s alone)"
  if e.bottleneck == "train step":
    e.notes.append(
      f"{alone} keeps up with a {step_ms:g} ms step ({need:.0f} img/s): no input change "
      "will speed up training"
    )
    _notes(e, s, m)
    return
  costs = e.costs
  if state.budget_per_s:
    _recommend_requests(e, s, m, state, propose, rate)
  if not start.dct and "decode_dct" in costs:
    propose(
      "dct_scaling",
      False,
      True,
      f"{m.dct_share:.0%} of the crops are at least twice image_size and decode at 1/2 to "
      f"1/8 resolution ({costs['decode'].cpu_ms:.2f} -> {costs['decode_dct'].cpu_ms:.2f} ms "
      "per image)",
      {"decoding.dct_scaling": True},
      dct=True,
    )
  if state.read_s:
    state = _recommend_reads(e, s, state, propose, rate)
  state = _recommend_processes(e, s, state, propose)
  prefetch = max(
    state.prefetch,
    _smallest(range(1, MAX_PREFETCH + 1), lambda p: rate(dataclasses.replace(state, prefetch=p))),
  )
  batch_mb = s.batch_size * s.image_size**2 * 3 / 2**20
  task = decode_stage.task_size(s.batch_size, state.threads)
  state = propose(
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
  fits = e.cache_estimate_mb <= 0.5 * parallelism.available_memory() / 2**20
  if not state.cached and fits:
    side = round(s.image_size / s.augment.crop_fraction)
    budget = float(math.ceil(e.cache_estimate_mb * 1.2))
    propose(
      "cache_mb",
      s.decoding.cache_mb,
      budget,
      f"decoded images (shorter side {side}) take ~{e.cache_estimate_mb:.0f} MB and fit in "
      f"RAM: after the first epoch the decode ({costs['decode'].cpu_ms:.2f} ms CPU) becomes "
      f"a crop of cached pixels ({costs['augment_cached'].cpu_ms:.2f} ms)",
      {"decoding.cache_mb": budget},
      cached=True,
    )
  elif not state.cached:
    e.notes.append(
      f"caching decoded images would need ~{e.cache_estimate_mb:.0f} MB, more than half the "
      "free RAM: no cache recommended"
    )
  if need:
    e.notes.append(f"{alone} is slower than a {step_ms:g} ms step needs ({need:.0f} img/s)")
  _notes(e, s, m)


def _recommend_requests(e: Explanation, s: Spec, m: Measured, state: _State, propose, rate):
  """Under storage's request ceiling: requests kept just under it
  (performance.max_requests_per_s), so that reads wait their turn in the pipeline instead
  of queueing at storage; then more images per request (the block order, larger blocks) up
  to the rate the rest of the host allows."""
  r, ceiling = m.run.requests, m.storage.ceiling_per_s
  under = math.floor(UNDER * ceiling)
  if r.max_per_s is None or r.max_per_s > under:
    state = propose(
      "max_requests_per_s",
      r.max_per_s,
      under,
      f"just under storage's ~{ceiling:,.0f} requests/s, so that reads wait their turn in "
      f"the pipeline instead of queueing at storage (a read took {r.latency_ms:,.0f} ms in "
      f"the run, {r.latency_open_ms:,.1f} ms at open; {m.storage.loaded_ms:,.0f} ms at "
      f"{m.storage.loaded_in_flight} in flight in the storage check)",
      {"performance.max_requests_per_s": under},
      since=m.run.images_per_sec,
      budget_per_s=float(under),
    )
  if r.order == "global":
    k = s.block_records or BLOCK_RECORDS
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
    current = r.block_records or s.block_records or BLOCK_RECORDS
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


def _recommend_reads(e: Explanation, s: Spec, state: _State, propose, rate) -> _State:
  """Records read ahead for the reads in flight the rest of the host needs (Little's law):
  performance.read_ahead (batches) when it caps them, then performance.read_ahead_mb."""
  batch_mb = s.batch_size * state.record_bytes / 2**20
  most = max(1, math.ceil(MAX_READ_THREADS * state.per_request / s.batch_size))
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
  threads = math.floor(MAX_READ_THREADS * state.per_request)
  waiting = read_ahead(state, s.batch_size) >= threads
  if waiting and binding(model(e.costs, state, e.cores, s)) == "reads":
    e.notes.append(
      f"the read stage's {MAX_READ_THREADS} I/O threads a process are all waiting: more "
      "images a request (order='blocks', block_records) or more worker processes read more "
      "at once"
    )
  return state


def _recommend_processes(e: Explanation, s: Spec, state: _State, propose) -> _State:
  """Worker processes x decode threads: `parallelism.plan` with the measured costs; when
  the decode threads' work mostly waits (slow storage), threads beyond the cores."""
  cores, costs = e.cores, e.costs
  hc = host_costs(costs, state, s)
  best = parallelism.plan(
    cores,
    batch_size=s.batch_size,
    image_bytes=s.image_size**2 * 3,
    prefetch=state.prefetch,
    costs=hc,
    memory_bytes=None if e.here else cores * 2**30,
  )
  workers, threads = best.workers, best.threads
  if hc.wait_us > 0.5 * hc.cpu_us:  # the work waits: more threads overlap the waiting

    def rate(t: int) -> float:
      st = dataclasses.replace(state, workers=workers, threads=t, prefetch=MAX_PREFETCH)
      return min(model(costs, st, cores, s).values())

    threads = _smallest(range(1, 8 * cores + 1), rate)
  if (workers, threads) == (state.workers, state.threads):
    return state
  why = (
    f"per image {hc.cpu_us:.0f} us of CPU, {hc.gil_us:.0f} us of it holding the GIL"
    + (
      f", {hc.wait_us:.0f} us waiting off-CPU: threads beyond the {cores} cores overlap the waiting"
      if threads > cores
      else ""
    )
    + (
      f"; worker processes each hold their own GIL (~{hc.worker_mb:.0f} MB each)"
      if workers
      else "; one process: no pickling, instant start"
    )
  )
  return propose(
    "num_workers x num_threads",
    f"{state.workers} x {state.threads}",
    f"{workers} x {threads}",
    why,
    {"performance.num_workers": workers, "performance.num_threads": threads},
    workers=workers,
    threads=threads,
  )


def _notes(e: Explanation, s: Spec, m: Measured) -> None:
  e.notes.append(
    f"DCT scaling {'applies' if s.decoding.dct_scaling else 'would apply'} to "
    f"{m.dct_share:.0%} of the crops at image_size {s.image_size} "
    "(those at least twice the output size)"
  )
  if e.input_stage == "read":
    e.notes.append(
      f"reading is slow: each process keeps the records of the batches its read-ahead holds "
      f"in flight, up to {MAX_READ_THREADS} requests at once (pipeline.stages.read); the "
      "record cache (record_cache_mb) reads storage once, the block order (order='blocks') "
      "reads more images a request, and a local disk reads faster than network storage"
    )
  if e.input_stage == REQUEST_BUDGET:
    e.notes.append(
      "the GIL-held time is not measured under a request budget: its emulated run would "
      "wait on storage's requests, not on the GIL"
    )
  if s.performance.num_workers is None or s.performance.num_threads is None:
    auto = host_plan(s, e.cores, None if e.here else e.cores * 2**30)
    e.notes.append(f"on {e.cores} cores make_dataset chooses {auto.describe()}")
  if m.load_average > m.cores:
    e.notes.append(
      f"load average {m.load_average:.1f} on {m.cores} cores: other work shares the CPUs, "
      "so rates are noisy; run again on a quiet machine"
    )


def advice(e: Explanation) -> list[str]:
  """The recommendations, numbered, then the notes: lines to print."""
  lines = [
    "recommendations (expected rates include the changes above them):"
    if e.recommendations
    else "recommendations: none"
  ]
  for k, rec in enumerate(e.recommendations, 1):
    lines.append(
      f"  {k}. {rec.field} {rec.current} -> {rec.proposed}: x{rec.gain:.2f}, "
      f"expected {rec.expected_images_per_sec:.0f} img/s; {rec.why}"
    )
  return lines + [f"  - {n}" for n in e.notes]
