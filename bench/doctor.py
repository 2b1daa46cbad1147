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
each image holds it ("python"). `pipeline.explain` turns these costs into what each
resource allows (`pipeline.host.parallelism`'s host model: threads, GIL, cores, the main
process; plus the loader's reads, prefetch and storage requests): the smallest limit names
the resource, its largest stage the bottleneck, and re-evaluating the model with other
settings gives each recommendation's expected gain; `--cores N` evaluates it for a host of
N cores. `--apply` writes the settings into a config's `input` block (`make_dataset`'s
keywords).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Iterator

import ml_collections

from bench import costs as costs_lib
from bench import measure, recipe, storage_check, timeline
from bench.recipe import (
  Settings,
  UsageError,
  find_config,
  load_config,
  override,
  settings_from_config,
)
from pipeline import dataset, explain
from pipeline.catalog import manifest as manifest_lib
from pipeline.explain import Cost, Explanation, Requests, Run
from pipeline.host import parallelism
from pipeline.image import decode
from pipeline.stages import read as read_lib
from pipeline.stages.stats import Stats

CEILING_THREADS = 16  # threads of the emulated run that measures the GIL-held time


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

  def evidence(self) -> explain.Measured:
    """What `pipeline.explain` reads of these measurements."""
    check, ceiling = self.storage, None
    if check:
      alone, most = check.levels[0], check.levels[-1]
      ceiling = explain.Storage(
        check.request_budget_per_s(self.cores), alone.median_ms, most.median_ms, most.concurrency
      )
    cache_mb = self.cache_bytes_per_image * self.num_records / 2**20
    return explain.Measured(
      self.cores,
      self.costs,
      self.run,
      cache_mb,
      self.dct_share,
      self.load_average,
      self.python_us,
      ceiling,
    )


@dataclasses.dataclass
class Diagnosis(Explanation):
  """`pipeline.explain`'s explanation of what the doctor measured, with the settings."""

  settings: Settings
  measured: Measurements
  run: Run
  step_ms: float | None


def diagnose(
  s: Settings, m: Measurements, step_ms: float | None = None, cores: int | None = None
) -> Diagnosis:
  """Names the bottleneck of `s` on a host of `cores` cores (default: this machine, where
  `m` was measured) and recommends settings (`pipeline.explain`)."""
  e = explain.explain(s.spec(), m.evidence(), cores, step_ms)
  return Diagnosis(**vars(e), settings=s, measured=m, run=m.run, step_ms=step_ms)


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
  if decode.native() is not None and explain.request_budget(m.evidence()) is None:
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
  s, r, m, spec = d.settings, d.run, d.measured, d.settings.spec()
  plan = parallelism.Plan(d.plan["workers"], d.plan["threads"])
  source = f"from {s.recipe}" if s.recipe else "defaults: --config RECIPE takes the run's"
  lines = [
    (
      f"pipeline doctor: {s.data_dir} ({s.split}, {m.num_records} records, {m.num_shards} "
      f"shards), batch {s.batch_size}, image {s.image_size} ({source}), performance "
      f"{dataclasses.asdict(spec.performance)}, decoding {dataclasses.asdict(spec.decoding)}"
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
  return "\n".join(lines + explain.advice(d))


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
    base_module = recipe.module_name(args.config)[0]
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
  s.spec()  # checks the settings
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
