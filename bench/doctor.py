"""The pipeline doctor: why is my step input-bound, and what setting fixes it?

    python -m pipeline.doctor data/photos --batch-size 128 --step-ms 100
    python -m pipeline.doctor --config configs/default.py --apply configs/default_tuned.py

Times each stage of the configured pipeline alone on one thread (read, parse, decode,
augment, batch: wall and CPU milliseconds per image), then runs the whole pipeline for a
few seconds (and, with --step-ms, beside a simulated train step to measure the input wait).
A small model of `make_dataset` turns the stage costs into the rate each resource allows:

    threads:  T / W_wall              T decode threads share the per-image work W
    cores:    C / (R_cpu + W_cpu)     all C cores busy
    prefetch: P / (R_wall + W_wall/T) each of P prefetch threads reads its batch, then waits
                                      for the decode threads to finish it

where R is the read and W = parse + decode + augment + batch per image. The smallest names
the limit, its largest stage the bottleneck, and re-evaluating the model with other
settings gives each recommendation's expected gain. `--apply` writes them as a config file.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator

import grain
import ml_collections
import numpy as np
import psutil

from bench import timeline
from pipeline import augment, decode, records
from bench import measure
from pipeline.dataset import BatchLoader, Transform, default_threads, make_dataset

MAP_STAGES = ("parse", "decode", "augment", "batch")
LIMITS = ("cores", "threads", "prefetch")  # tie order: the hardware limit first
CONFIG_FIELDS = ("data_dir", "train_split", "batch_size", "image_size", "num_threads",
                 "prefetch", "cache_mb", "area_range", "flip", "seed")
MAX_PREFETCH = 16


@dataclasses.dataclass
class Settings:
  """The data fields of a config (same names), plus `dct_scaling` (make_dataset's default)."""

  data_dir: str
  train_split: str = "train"
  batch_size: int = 128
  image_size: int = 224
  num_threads: int = 0  # 0: one per core
  prefetch: int = 2
  cache_mb: float = 0.0
  area_range: tuple[float, float] = (0.08, 1.0)
  flip: bool = True
  seed: int = 0
  dct_scaling: bool = True

  @property
  def threads(self) -> int:
    return self.num_threads or default_threads()

  def dataset(self) -> grain.IterDataset:
    return make_dataset(self.data_dir,
                        self.train_split,
                        batch_size=self.batch_size,
                        train=True,
                        seed=self.seed,
                        image_size=self.image_size,
                        shard_index=0,
                        shard_count=1,
                        performance=dict(num_threads=self.threads, prefetch=self.prefetch, cache_mb=self.cache_mb, dct_scaling=self.dct_scaling),
                        augment=dict(area_range=tuple(self.area_range), flip=self.flip))


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
class Run:
  """The whole pipeline, steady state (after the first batch)."""

  images_per_sec: float
  first_batch_s: float
  images: int
  seconds: float
  cores_busy: float  # process CPU time / (wall time x cores)
  wait_share: float | None = None  # with a simulated step: time blocked in next() / total


@dataclasses.dataclass
class Recommendation:
  field: str
  current: object
  proposed: object
  expected_images_per_sec: float
  gain: float
  why: str


@dataclasses.dataclass
class Diagnosis:
  settings: Settings
  cores: int
  load_average: float
  num_records: int
  num_shards: int
  costs: dict[str, Cost]
  limits: dict[str, float]  # images/s each resource allows (see the module docstring)
  predicted: float
  run: Run
  consumer_run: Run | None
  step_ms: float | None
  bottleneck: str  # a stage, or "train step" when the input keeps up
  input_stage: str  # the stage limiting the input pipeline itself
  limit: str  # which resource binds, in words
  recommendations: list[Recommendation]
  notes: list[str]
  cache_estimate_mb: float
  dct_share: float  # share of crops decoded with DCT scaling


# ---------------------------------------------------------------- stage costs


def _decode(t: Transform, data: bytes, rng: np.random.Generator
            ) -> tuple[np.ndarray, augment.Box]:
  """The transform's first half: header, crop window, crop-aware decode."""
  box = t.box(*decode.image_size(data), rng)
  return t.decode(data, box), box


def _queued_s() -> float:
  """Seconds this thread has waited on a run queue (Linux schedstat; 0 where missing)."""
  try:
    with open("/proc/thread-self/schedstat") as f:
      return int(f.read().split()[1]) / 1e9
  except (OSError, IndexError, ValueError):
    return 0.0


class _Clock:
  """Accumulates wall, CPU and run-queue time of timed blocks (run alone, so the process's
  CPU time is this work's, helper threads included)."""

  def __init__(self):
    self.wall = self.cpu = self.queued = 0.0

  def time(self, fn: Callable, *args):
    w, c, q = time.perf_counter(), time.process_time(), _queued_s()
    out = fn(*args)
    self.wall += time.perf_counter() - w
    self.cpu += time.process_time() - c
    self.queued += _queued_s() - q
    return out


def find_loader(ds) -> BatchLoader:
  """The BatchLoader inside a dataset made by `make_dataset` (walks Grain's parents)."""
  todo = [ds]
  while todo:
    node = todo.pop()
    for value in vars(node).values():
      if isinstance(value, BatchLoader):
        return value
    todo.extend(getattr(node, "parents", ()))
  raise ValueError("no BatchLoader in this dataset: the doctor diagnoses make_dataset's chain")


def measure_costs(loader: BatchLoader, sample: int) -> tuple[dict[str, Cost], dict]:
  """Each stage alone on one thread over the first `sample` images of the stream.

  Returns the costs and facts: the decoded-cache size per image and the share of crops
  that DCT scaling shrinks. With dct_scaling off, "decode_dct" prices turning it on.
  """
  n = min(sample, len(loader.sampler))
  indices = [loader.sampler.record_index(p) for p in range(n)]
  t = loader.transform
  extra = () if t.dct_scaling else ("decode_dct",)
  clocks = {s: _Clock() for s in ("read", *MAP_STAGES, *extra, "cache_fill", "augment_cached")}
  recs = []
  for k in range(0, n, loader.batch_size):
    recs += clocks["read"].time(loader.source.read, indices[k:k + loader.batch_size])
  images = np.zeros((min(n, loader.batch_size), t.image_size, t.image_size, 3), np.uint8)
  cache_bytes, scaled = [], 0
  side = round(t.image_size / t.crop_fraction)  # the cache's shorter side
  for k, (index, rec) in enumerate(zip(indices, recs)):
    data = clocks["parse"].time(lambda r: records.parse(r, loader.keys)[0], rec)
    rng = np.random.default_rng([loader.seed, 0, index])
    crop, box = clocks["decode"].time(_decode, t, data, rng)
    out = clocks["augment"].time(t.finish, crop, rng)
    clocks["batch"].time(images.__setitem__, k % len(images), out)
    scale = augment.dct_scale(box, t.image_size)
    scaled += scale > 1
    if extra:
      clocks["decode_dct"].time(decode.decode_crop, data, box, scale)
    if k < 32:  # enough to price the cache without paying a full decode for every image
      cached = clocks["cache_fill"].time(
          lambda d: augment.resize_shorter(decode.decode(d), side), data)
      clocks["augment_cached"].time(t.from_cache, cached, rng)
      cache_bytes.append(cached.nbytes)
  costs = {}
  for name, c in clocks.items():
    count = min(n, 32) if name in ("cache_fill", "augment_cached") else n
    costs[name] = Cost(*(round(x / count * 1e3, 4) for x in (c.wall, c.cpu, c.queued)))
  return costs, {"cache_bytes_per_image": float(np.mean(cache_bytes)), "dct_share": scaled / n}


# ---------------------------------------------------------------- the model


def _work(costs: dict[str, Cost], cached: bool) -> tuple[float, float]:
  """Per-image (wall, cpu) seconds of the decode threads' work W."""
  stages = ("parse", "augment_cached", "batch") if cached else MAP_STAGES
  return (sum(costs[s].active_ms for s in stages) / 1e3,
          sum(costs[s].cpu_ms for s in stages) / 1e3)


def model(costs: dict[str, Cost], threads: int, prefetch: int, cores: int,
          cached: bool = False) -> dict[str, float]:
  """Images/s each resource allows (the module docstring has the formulas)."""
  w_wall, w_cpu = _work(costs, cached)
  r_wall, r_cpu = costs["read"].active_ms / 1e3, costs["read"].cpu_ms / 1e3
  tiny = 1e-9
  return {"cores": cores / max(r_cpu + w_cpu, tiny),
          "threads": threads / max(w_wall, tiny),
          "prefetch": prefetch / max(r_wall + w_wall / threads, tiny)}


def binding(limits: dict[str, float]) -> str:
  """The limit with the lowest rate; near ties (2%) go to the hardware first."""
  low = min(limits.values())
  return next(k for k in LIMITS if limits[k] <= low * 1.02)


def _stage_of(limit: str, costs: dict[str, Cost], threads: int, cached: bool) -> str:
  """The stage to blame under `limit`: the largest share of the bound resource."""
  map_stages = ("parse", "augment_cached", "batch") if cached else MAP_STAGES
  if limit == "cores":
    return max(("read", *map_stages), key=lambda s: costs[s].cpu_ms)
  heaviest = max(map_stages, key=lambda s: costs[s].active_ms)
  if limit == "prefetch" and costs["read"].active_ms >= _work(costs, cached)[0] * 1e3 / threads:
    return "read"
  return heaviest


def _smallest(values: range, rate: Callable[[int], float], share: float = 0.95) -> int:
  """The smallest value whose rate reaches `share` of the best rate over `values`."""
  best = max(rate(v) for v in values)
  return next(v for v in values if rate(v) >= share * best)


# ---------------------------------------------------------------- whole pipeline


class _TimedSource:
  """The loader's source, each batched read recorded on the timeline."""

  def __init__(self, source, recorder: timeline.Recorder):
    self.source, self.recorder = source, recorder

  def __len__(self) -> int:
    return len(self.source)

  def __getattr__(self, name):
    if name.startswith("__") or name in ("source", "recorder"):
      raise AttributeError(name)
    return getattr(self.source, name)

  def read(self, indices):
    with self.recorder.span("read"):
      return self.source.read(indices)


class _TimedTransform:
  """The loader's transform, each image's decode and augment recorded on the timeline."""

  def __init__(self, transform: Transform, recorder: timeline.Recorder):
    self.transform, self.recorder = transform, recorder

  def __getattr__(self, name):
    if name.startswith("__") or name in ("transform", "recorder"):
      raise AttributeError(name)
    return getattr(self.transform, name)

  def __call__(self, data: bytes, rng: np.random.Generator, out=None) -> np.ndarray:
    with self.recorder.span("decode"):
      crop, _ = _decode(self.transform, data, rng)
    with self.recorder.span("augment"):
      return self.transform.finish(crop, rng, out)

  def from_cache(self, image: np.ndarray, rng: np.random.Generator, out=None) -> np.ndarray:
    with self.recorder.span("augment (cached)"):
      return self.transform.from_cache(image, rng, out)


def instrument(ds, recorder: timeline.Recorder) -> None:
  """Records the read, decode and augment of `ds`'s BatchLoader on `recorder`."""
  loader = find_loader(ds)
  loader.source = _TimedSource(loader.source, recorder)
  loader.transform = _TimedTransform(loader.transform, recorder)


def measure_run(ds, seconds: float, step_s: float = 0.0,
                recorder: timeline.Recorder | None = None, min_batches: int = 3) -> Run:
  """Iterates `ds` for `seconds` after the first batch; sleeps `step_s` per batch if > 0."""
  recorder = recorder or timeline.Recorder()
  proc = psutil.Process()
  cpu0, start = proc.cpu_times(), time.perf_counter()
  it: Iterator = iter(ds)
  with recorder.span("wait for batch"):
    next(it)
  first = time.perf_counter()
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
  cpu1 = proc.cpu_times()
  close = getattr(it, "close", None)
  if close:
    close()
  busy = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / ((end - start) * default_threads())
  return Run(round(images / (end - first), 1), round(first - start, 3), images,
             round(end - first, 3), round(busy, 3),
             round(waited / (end - first), 3) if step_s else None)


# ---------------------------------------------------------------- diagnosis


def diagnose(settings: Settings, seconds: float = 5.0, step_ms: float | None = None,
             sample: int = 128, recorder: timeline.Recorder | None = None) -> Diagnosis:
  """Measures `settings`' pipeline (stages alone, then whole), names the bottleneck and
  recommends settings; `recorder` receives the timeline of the run with the step."""
  cores, load = default_threads(), os.getloadavg()[0]
  ds = settings.dataset()
  loader = find_loader(ds)
  costs, facts = measure_costs(loader, sample)
  num_records = loader.sampler.num_records
  cache_mb = facts["cache_bytes_per_image"] * num_records / 2**20
  cached = 0 < cache_mb <= settings.cache_mb
  T, P = settings.threads, settings.prefetch
  limits = model(costs, T, P, cores, cached)
  predicted = min(limits.values())
  limit = binding(limits)
  input_stage = _stage_of(limit, costs, T, cached)

  recorder = recorder or timeline.Recorder()
  instrument(ds, timeline.Recorder() if step_ms else recorder)
  run = measure_run(ds, seconds, recorder=None if step_ms else recorder)
  consumer_run = None
  if step_ms:  # the timeline shows this run: input waits beside train steps
    ds = settings.dataset()
    instrument(ds, recorder)
    consumer_run = measure_run(ds, max(seconds / 2, 3 * step_ms / 1e3), step_ms / 1e3,
                               recorder)

  need = settings.batch_size / (step_ms / 1e3) if step_ms else None
  bottleneck = "train step" if need and run.images_per_sec >= 1.05 * need else input_stage
  w_wall, w_cpu = _work(costs, cached)
  words = {
      "cores": f"all {cores} cores busy: {limits['cores']:.0f} img/s at most",
      "threads": f"num_threads={T} decode threads: {limits['threads']:.0f} img/s at most",
      "prefetch": f"prefetch={P} batches in flight, each read then decoded in turn: "
                  f"{limits['prefetch']:.0f} img/s at most"}
  diag = Diagnosis(
      settings=settings, cores=cores, load_average=round(load, 2), num_records=num_records,
      num_shards=len(loader.source.names), costs=costs,
      limits={k: round(v, 1) for k, v in limits.items()}, predicted=round(predicted, 1),
      run=run, consumer_run=consumer_run, step_ms=step_ms, bottleneck=bottleneck,
      input_stage=input_stage, limit=words[limit], recommendations=[], notes=[],
      cache_estimate_mb=round(cache_mb, 1), dct_share=round(facts["dct_share"], 3))
  _recommend(diag, cached, w_wall, w_cpu, need)
  return diag


def _recommend(d: Diagnosis, cached: bool, w_wall: float, w_cpu: float,
               need: float | None) -> None:
  """Fills d.recommendations and d.notes. Changes are proposed in turn, each on top of the
  ones before; its gain is the model's rate with it over without it, and its expected
  rate the measured one scaled by the model's rate with all changes so far."""
  s, C = d.settings, d.cores
  state = {"threads": s.threads, "prefetch": s.prefetch, "cached": cached,
           "costs": d.costs}

  def rate(**change) -> float:
    x = {**state, **change}
    return min(model(x["costs"], x["threads"], x["prefetch"], C, x["cached"]).values())

  start = rate()

  def propose(field, current, proposed, why, **change):
    gain = rate(**change) / rate()
    if gain >= 1.05:
      state.update(change)
      d.recommendations.append(Recommendation(
          field, current, proposed, round(d.run.images_per_sec * rate() / start, 1),
          round(gain, 3), why))

  if d.bottleneck == "train step":
    d.notes.append(f"the input ({d.run.images_per_sec:.0f} img/s alone) keeps up with a "
                   f"{d.step_ms:g} ms step ({need:.0f} img/s): no input change will speed up "
                   "training")
  else:
    c = d.costs
    if not s.dct_scaling and "decode_dct" in c:
      propose("dct_scaling", False, True,
              f"{d.dct_share:.0%} of the crops are at least twice image_size and decode at "
              f"1/2 to 1/8 resolution ({c['decode'].cpu_ms:.2f} -> "
              f"{c['decode_dct'].cpu_ms:.2f} ms per image)",
              costs={**c, "decode": c["decode_dct"]})
    # Threads beyond the cores only when the work waits (I/O, sleeps) rather than computes.
    waits = w_wall > 1.5 * w_cpu
    t_range = range(1, (8 * C if waits else max(C, s.threads)) + 1)
    threads = max(s.threads, _smallest(t_range, lambda t: rate(threads=t, prefetch=MAX_PREFETCH)))
    propose("num_threads", s.threads, threads,
            f"the decode threads' work takes {w_wall * 1e3:.2f} ms per image "
            + (f"of which only {w_cpu * 1e3:.2f} ms on a CPU: more threads than the {C} cores "
               "overlap the waiting" if waits else f"on {C} cores: one thread per core"),
            threads=threads)
    prefetch = max(s.prefetch, _smallest(range(1, MAX_PREFETCH + 1),
                                         lambda p: rate(prefetch=p)))
    batch_mb = s.batch_size * s.image_size**2 * 3 / 2**20
    propose("prefetch", s.prefetch, prefetch,
            f"each prefetch thread reads a batch ({c['read'].active_ms * s.batch_size:.0f} ms) "
            f"and then waits for its decode; {prefetch} in flight overlap the reads "
            f"(+{(prefetch - s.prefetch) * batch_mb:.0f} MB of batches held)",
            prefetch=prefetch)
    # Cache: decode once, then crop and flip the cached pixels in every later epoch.
    fits = d.cache_estimate_mb <= 0.5 * psutil.virtual_memory().available / 2**20
    if not cached and fits:
      propose("cache_mb", s.cache_mb, float(math.ceil(d.cache_estimate_mb * 1.2)),
              f"decoded images (shorter side {round(s.image_size / Transform.crop_fraction)}) "
              f"take ~{d.cache_estimate_mb:.0f} MB and fit in RAM: after the first epoch the "
              f"decode ({c['decode'].cpu_ms:.2f} ms CPU) becomes a crop of cached pixels "
              f"({c['augment_cached'].cpu_ms:.2f} ms); small crops then come from the cached "
              "resolution", cached=True)
    elif not cached:
      d.notes.append(f"caching decoded images would need ~{d.cache_estimate_mb:.0f} MB, more "
                     "than half the free RAM: no cache recommended")
    if need:
      d.notes.append(f"the input ({d.run.images_per_sec:.0f} img/s alone) is slower than a "
                     f"{d.step_ms:g} ms step needs ({need:.0f} img/s)")
  d.notes.append(f"DCT scaling {'applies' if s.dct_scaling else 'would apply'} to "
                 f"{d.dct_share:.0%} of the crops at image_size {s.image_size} (those at least "
                 "twice the output size)")
  if d.input_stage == "read" and d.num_shards < 16:
    d.notes.append(f"reading is slow and the split has {d.num_shards} shard(s): "
                   "ArrayRecordDataSource reads a batch with one thread per shard, so more "
                   "shards (a smaller shard_size_mb at conversion) read more records at once")
  if d.load_average > C:
    d.notes.append(f"load average {d.load_average:.1f} on {C} cores: other work shares the "
                   "CPUs, so rates are noisy; run again on a quiet machine")


# ---------------------------------------------------------------- report and --apply


def report(d: Diagnosis) -> str:
  s, r = d.settings, d.run
  lines = [
      (f"pipeline doctor: {s.data_dir} ({s.train_split}, {d.num_records} records, "
       f"{d.num_shards} shards), batch {s.batch_size}, image {s.image_size}, "
       f"num_threads {s.threads}, prefetch {s.prefetch}, cache_mb {s.cache_mb:g}, "
       f"dct_scaling {s.dct_scaling}"),
      f"machine: {measure.machine()}, load average {d.load_average}",
      "",
      "stages alone, one thread, per image:   wall ms    cpu ms  queued ms",
  ]
  for name, c in d.costs.items():
    note = {"cache_fill": "  (once per image with cache_mb)",
            "augment_cached": "  (every image after the first epoch with cache_mb)"}.get(name, "")
    lines.append(f"  {name:16s}                    {c.wall_ms:8.3f}  {c.cpu_ms:8.3f}  "
                 f"{c.queued_ms:8.3f}{note}")
  lines += [
      "",
      "what each resource allows: " + ", ".join(f"{k} {v:.0f} img/s" for k, v in d.limits.items()),
      (f"whole pipeline: {r.images_per_sec:.0f} img/s measured vs {d.predicted:.0f} "
       f"predicted ({r.images_per_sec / d.predicted:.0%}); first batch "
       f"{r.first_batch_s:.2f} s; cores {r.cores_busy:.0%} busy ({r.images} images in "
       f"{r.seconds:.1f} s)"),
  ]
  if d.consumer_run:
    w = d.consumer_run.wait_share
    level = "highly" if w >= 0.2 else "moderately" if w >= 0.05 else "not"
    lines.append(f"with a {d.step_ms:g} ms train step: {d.consumer_run.images_per_sec:.0f} "
                 f"img/s, waiting for input {w:.0%} of the time: {level} input-bound")
  if d.bottleneck == "train step":
    lines.append(f"\nbottleneck: the train step; the input's own limit is {d.input_stage} "
                 f"({d.limit})")
  else:
    lines.append(f"\nbottleneck: {d.bottleneck} ({d.limit})")
  lines.append("recommendations (expected rates include the changes above them):"
               if d.recommendations else "recommendations: none")
  for k, rec in enumerate(d.recommendations, 1):
    lines.append(f"  {k}. {rec.field} {rec.current} -> {rec.proposed}: x{rec.gain:.2f}, "
                 f"expected {rec.expected_images_per_sec:.0f} img/s; {rec.why}")
  lines += [f"  - {n}" for n in d.notes]
  return "\n".join(lines)


def load_config(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file; one inside a package imports as that package."""
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


def settings_from_config(config, **overrides) -> Settings:
  """Settings from a config's data fields; `overrides` that are not None win."""
  fields = {f: config[f] for f in CONFIG_FIELDS if f in config}
  fields.update({k: v for k, v in overrides.items() if v is not None})
  if "area_range" in fields:
    fields["area_range"] = tuple(fields["area_range"])
  return Settings(**fields)


def write_config(path: str, d: Diagnosis, base_module: str, base, command: str) -> list[str]:
  """Writes a config that imports `base_module` and sets the diagnosed data fields that
  differ from `base` plus the recommendations; returns fields it could not set."""
  tuned = {f: getattr(d.settings, f) for f in CONFIG_FIELDS
           if f in base and getattr(d.settings, f) != _plain(base[f])}
  why = {}
  skipped = []
  for rec in d.recommendations:
    if rec.field in base:
      tuned[rec.field] = rec.proposed
      why[rec.field] = f"was {rec.current}: x{rec.gain:.2f} expected"
    else:
      skipped.append(rec.field)
  best = max([d.run.images_per_sec] + [r.expected_images_per_sec for r in d.recommendations])
  module, _, name = base_module.rpartition(".")
  body = "\n".join(f"  c.{k} = {v!r}" + (f"  # {why[k]}" if k in why else "")
                   for k, v in tuned.items()) or "  pass  # nothing to change"
  pathlib.Path(path).write_text(
      f'"""{base_module}, tuned by the pipeline doctor on {measure.machine()}.\n\n'
      f"    {command}\n\n"
      f"Measured {d.run.images_per_sec:.0f} img/s (bottleneck: {d.bottleneck}); expected "
      f"{best:.0f} img/s with these settings.\n"
      f'"""\n\nfrom {module} import {name} as base\n\n\n'
      f"def get_config():\n  c = base.get_config()\n{body}\n  return c\n")
  return skipped


def _plain(value):
  return tuple(value) if isinstance(value, (list, tuple)) else value


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m pipeline.doctor", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("data_dir", nargs="?", help="converted dataset (default: the config's)")
  p.add_argument("--config", help="an ml_collections config file; its data fields are used")
  p.add_argument("--split", dest="train_split", help="split to read (default: train)")
  p.add_argument("--batch-size", type=int, help="per-process batch size")
  p.add_argument("--image-size", type=int)
  p.add_argument("--num-threads", type=int, help="decode threads (0: one per core)")
  p.add_argument("--prefetch", type=int, help="batches in flight")
  p.add_argument("--cache-mb", type=float, help="decoded-image cache budget")
  p.add_argument("--no-dct-scaling", dest="dct_scaling", action="store_false", default=None)
  p.add_argument("--seconds", type=float, default=5.0, help="length of the whole-pipeline run")
  p.add_argument("--sample", type=int, default=128, help="images timed per stage")
  p.add_argument("--step-ms", type=float, help="your train step: measure the input wait")
  p.add_argument("--timeline", default="doctor_timeline.png",
                 help="timeline picture of the run ('' to skip)")
  p.add_argument("--apply", metavar="OUT.py", help="write the tuned settings to this config")
  p.add_argument("--json", help="write the diagnosis to this file")
  return p


def main(argv: list[str] | None = None) -> Diagnosis:
  argv = sys.argv[1:] if argv is None else argv
  args = parser().parse_args(argv)
  overrides = {f: getattr(args, f) for f in (
      "data_dir", "train_split", "batch_size", "image_size", "num_threads", "prefetch",
      "cache_mb", "dct_scaling")}
  if args.config:
    base_module = _module_name(args.config)[0]
    base = load_config(args.config)
  else:
    if not args.data_dir:
      parser().error("give DATA_DIR or --config")
    base_module, base = "configs.default", None
  settings = (settings_from_config(base, **overrides) if base is not None
              else Settings(**{k: v for k, v in overrides.items() if v is not None}))
  if args.apply and not base_module:
    parser().error(f"--apply needs a --config inside a package (like configs/); "
                   f"{args.config} is not")
  recorder = timeline.Recorder()
  d = diagnose(settings, args.seconds, args.step_ms, args.sample, recorder)
  print(report(d))
  if args.timeline:
    events = recorder.events()
    start = min(e.start for e in events)
    shown = d.consumer_run or d.run  # the recorded run: start-up, then 1.5 s of it
    window = [e for e in events if e.start < start + shown.first_batch_s + 1.5]
    timeline.draw(window, args.timeline,
                  f"{settings.data_dir}: {d.run.images_per_sec:.0f} img/s, "
                  f"bottleneck {d.bottleneck}")
    print(f"timeline: {args.timeline}")
  command = "python -m pipeline.doctor " + " ".join(argv)
  if args.apply:
    if base is None:
      base = importlib.import_module(base_module).get_config()
    skipped = write_config(args.apply, d, base_module, base, command)
    print(f"wrote {args.apply}" + (f" (not config fields, set them in make_dataset: "
                                   f"{', '.join(skipped)})" if skipped else ""))
  if args.json:
    measure.write_json(args.json, {**dataclasses.asdict(d), "machine": measure.machine(),
                                   "command": command})
  return d


if __name__ == "__main__":
  main()
