"""What an explanation says: the binding limit in words, the notes, and the advice to print
(`advice`: every recommendation, as the doctor prints; `brief`: a few lines, as the trainer
prints when a run is input-bound)."""

from __future__ import annotations

from pipeline.explain.evidence import Measured
from pipeline.explain.model import (
  REQUEST_BUDGET,
  Explanation,
  State,
  gil_stages,
  host_plan,
  read_ahead,
)
from pipeline.spec import Spec
from pipeline.stages.read import MAX_READ_THREADS


def limit_words(
  limit: str, limits: dict[str, float], state: State, costs: dict, cores: int, m: Measured, s: Spec
) -> str:
  """The binding `limit` in words: the resource, the settings it follows from, its rate."""
  rate = f"{limits[limit]:.0f} img/s at most"
  procs = f"{state.workers} worker processes" if state.workers else "one process"
  gil_us = sum(costs[x].cpu_ms for x in gil_stages(costs, state)) * 1e3
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


def add_notes(e: Explanation, s: Spec, m: Measured) -> None:
  """The explanation's notes after its recommendations: what was measured beside them."""
  if m.dct_share is not None:
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


def brief(e: Explanation, most: int = 3, prefix: str = "") -> list[str]:
  """A few lines for a run's log: the stage bounding the input and why, then the first `most`
  recommendations as settings (make_dataset keyword paths after `prefix`, e.g.
  "config.input."); `advice` has them all, with their reasons and the notes."""
  if e.bottleneck == "train step":
    return e.notes[:1]  # the input keeps up with the step: nothing to change
  lines = [f"what bounds the input: {e.input_stage} ({e.limit})"]
  for rec in e.recommendations[:most]:
    writes = ", ".join(f"{prefix}{k}={v}" for k, v in rec.writes.items())
    lines.append(
      f"  try {writes}: expected {rec.expected_images_per_sec:.0f} img/s (x{rec.gain:.2f})"
    )
  if not e.recommendations:
    lines.append(
      "  no setting raises it on the costs measured here; python -m bench.doctor times each "
      "stage alone"
    )
  return lines
