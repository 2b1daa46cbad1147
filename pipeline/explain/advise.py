"""`explain`: what bounds a pipeline on a host and the settings proposed in turn, each with
its expected gain (the model re-evaluated with the change, `pipeline.explain.model`)."""

from __future__ import annotations

import dataclasses
import math

from pipeline.explain.evidence import Cost, Measured
from pipeline.explain.model import (
  MAX_PREFETCH,
  UNDER,
  Explanation,
  Recommendation,
  State,
  binding,
  host_costs,
  host_plan,
  model,
  per_record,
  read_ahead,
  request_budget,
  smallest,
  stage_of,
  with_other,
)
from pipeline.explain.words import add_notes, limit_words
from pipeline.host import parallelism
from pipeline.order.blocks import BLOCK_RECORDS
from pipeline.spec import Spec
from pipeline.stages import decode as decode_stage
from pipeline.stages.read import MAX_READ_THREADS


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
  run = per_record(m.run) if budget else m.run
  costs = with_other(m.costs, run, host_plan(spec, m.cores).workers, spec)
  if m.python_us is not None and budget is None:  # else the emulated run waited on storage
    costs["python"] = Cost(m.python_us / 1e3, m.python_us / 1e3)
  perf, q = spec.performance, m.run.requests
  made = bool(q and q.made)
  state = State(
    chosen.workers,
    chosen.threads,
    perf.prefetch,
    m.cache_mb is not None and 0 < m.cache_mb <= spec.decoding.cache_mb,
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
  input_stage = stage_of(limit, costs, state)
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
    limit=limit_words(limit, limits, state, costs, cores, m, spec),
    recommendations=[],
    notes=[],
    cache_estimate_mb=None if m.cache_mb is None else round(m.cache_mb, 1),
  )
  _recommend(e, spec, m, state, step_ms)
  return e


def _recommend(e: Explanation, s: Spec, m: Measured, start: State, step_ms: float | None):
  """Fills e.recommendations and e.notes. Changes are proposed in turn, each on top of the
  ones before; its gain is the model's rate with it over without it, and its expected rate
  the measured one scaled by the model's rate with all changes so far (on another host: the
  model's rate)."""
  state = start

  def rate(st: State) -> float:
    return min(model(e.costs, st, e.cores, s).values())

  # Under a request budget the model's rate is storage's ceiling, which reads queueing at
  # storage fall short of: the expected rates are the model's.
  scale = m.run.images_per_sec / rate(start) if e.here and not start.budget_per_s else 1.0

  def propose(field, current, proposed, why, writes, since=None, **change) -> State:
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
    add_notes(e, s, m)
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
    smallest(range(1, MAX_PREFETCH + 1), lambda p: rate(dataclasses.replace(state, prefetch=p))),
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
  weighed = e.cache_estimate_mb is not None and "augment_cached" in costs  # where measured
  fits = weighed and e.cache_estimate_mb <= 0.5 * parallelism.available_memory() / 2**20
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
  elif not state.cached and weighed:
    e.notes.append(
      f"caching decoded images would need ~{e.cache_estimate_mb:.0f} MB, more than half the "
      "free RAM: no cache recommended"
    )
  if need:
    e.notes.append(f"{alone} is slower than a {step_ms:g} ms step needs ({need:.0f} img/s)")
  add_notes(e, s, m)


def _recommend_requests(e: Explanation, s: Spec, m: Measured, state: State, propose, rate):
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


def _recommend_reads(e: Explanation, s: Spec, state: State, propose, rate) -> State:
  """Records read ahead for the reads in flight the rest of the host needs (Little's law):
  performance.read_ahead (batches) when it caps them, then performance.read_ahead_mb."""
  batch_mb = s.batch_size * state.record_bytes / 2**20
  most = max(1, math.ceil(MAX_READ_THREADS * state.per_request / s.batch_size))
  unset = dataclasses.replace(state, max_depth=None)
  batches = smallest(
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


def _recommend_processes(e: Explanation, s: Spec, state: State, propose) -> State:
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

    threads = smallest(range(1, 8 * cores + 1), rate)
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
