"""Mixtures: several datasets in one training stream, with weights, through one loader.

    ds = pipeline.make_dataset({"in1k": A, "extra": B}, "train", weights={"in1k": 0.3,
                               "extra": 0.7}, batch_size=64)
    ds = pipeline.make_dataset({"in1k": pipeline.Source(A, pp="..."), "extra": B}, ...)

The sources' shards are one merged index space (each source's records after the previous
sources') read by ONE read stage, decoded by ONE pool of threads, in ONE set of worker
processes, within ONE `performance.memory_mb`: nothing is per source but its order, its
decode head, its ops and features. Which source fills each slot is
`pipeline.order.mixture.Schedule` (a pure function of the position: a source's count over any
prefix within one slot of its weight's); each source has its own order, epochs and shuffle
(`planner.sampler_of`): in the global order all over the global stream, dealt out to the
processes as one dataset's global order; in the block order (where a source's storage asks
for it, or order="blocks") every source in its own blocks, over each process's positions.

Labels (`labels=`): "own" (default) each source's own label indices; "offset" source k's
after the classes of sources 0..k-1 (classes "name/class"); "joined" one class per distinct
class name. Every batch holds "source" (int32, the index into the mixture's names).

A state names each source's uses so far: restored into a mixture with other weights, or with
sources added or removed, each source continues from its own position (one line says so),
on any process count (`pipeline.order.elastic`; in the block order each source's interrupted
epoch is dealt out anew, `pipeline.mixing.stream`); a state of a mixture with no source in
common, or of a single dataset, is refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from pipeline import planner
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import split as split_lib
from pipeline.catalog.schema import Manifest, Split
from pipeline.host import guards
from pipeline.host.parallelism import process_shard
from pipeline.mixing.stages import MixDecode, MixPlan
from pipeline.mixing.stream import MixStreamIterDataset, Mixture
from pipeline.options import Augment
from pipeline.order import elastic
from pipeline.order.blocks import WINDOW_BATCHES
from pipeline.order.mixture import MixSampler, Schedule
from pipeline.pp import features as features_lib
from pipeline.pp import ops as ops_lib
from pipeline.pp.transforms import transforms
from pipeline.spec import Spec
from pipeline.stages.decode import DecodeImages, arena_bytes, batch_decoder
from pipeline.stages.finish import FinishBatch
from pipeline.stages.plan import Sizes
from pipeline.storage.source import ShardedSource

LABELS = ("own", "offset", "joined")
MIXTURE_KEYWORDS = ("weights", "labels")


@dataclasses.dataclass(frozen=True)
class Source:
  """One source of a mixture: its dataset, split (default: the mixture's), weight (or in
  `weights=`), and its own pp string, `Augment`, image_size, image ops or extra features
  (each by default the mixture's); every source's images and features must come out alike."""

  data_dir: str | os.PathLike
  split: str | None = None
  weight: float | None = None
  pp: str | None = None
  augment: Augment | Mapping | None = None
  image_size: int | None = None
  ops: str | Sequence | None = None
  features: Mapping | None = None


def is_mixture(data_dir) -> bool:
  return isinstance(data_dir, Mapping)


def signature(single: inspect.Signature) -> inspect.Signature:
  """make_dataset's: a single dataset's keywords (`single`), then the mixture's own."""
  keyword = inspect.Parameter.KEYWORD_ONLY
  return single.replace(
    parameters=[
      *single.parameters.values(),
      inspect.Parameter("weights", keyword, default=None, annotation=Mapping | None),
      inspect.Parameter("labels", keyword, default=None, annotation=str | None),
    ]
  )


def sources_of(data_dir: Mapping, weights: Mapping | None) -> tuple[list[str], list, Schedule]:
  """(names, `Source`s, schedule) of a `{name: dir or Source}` mapping and its weights."""
  if not data_dir:
    raise ValueError("a mixture needs at least one source: {name: data_dir or Source}")
  names = [str(n) for n in data_dir]
  sources = [s if isinstance(s, Source) else Source(s) for s in data_dir.values()]
  weights = dict(weights or {})
  unknown = sorted(set(map(str, weights)) - set(names))
  if unknown:
    raise ValueError(f"weights name {unknown[0]!r}, not a source of the mixture {names}")
  given = []
  for name, source in zip(names, sources):
    w = weights.get(name, source.weight)
    if w is None:
      raise ValueError(f"source {name!r} has no weight: give weights={{{name!r}: ...}}")
    given.append(float(w))
  return names, sources, Schedule(tuple(given))


def stages(data_dir: Mapping, split: str = "train", **keywords) -> dict:
  """The fields of the `dataset.Stages` of the mixture `data_dir` ({name: dir or `Source`})."""
  weights, labels = keywords.pop("weights", None), keywords.pop("labels", None) or "own"
  if labels not in LABELS:
    raise ValueError(f"labels must be one of {LABELS}, not {labels!r}")
  names, sources, schedule = sources_of(data_dir, weights)
  base = Spec.of(os.fspath(sources[0].data_dir), split, **keywords)
  _check_mixable(base, keywords)
  perf = base.performance
  if perf.num_workers is None:
    guards.check_main_guard("worker processes, which make_dataset starts on many-core hosts,")
  elif perf.num_workers:
    guards.check_main_guard()
  specs, opened, samplers = [], [], []
  for source in sources:
    spec = _source_spec(source, split, keywords)
    meta, src, pins = split_lib.open(spec.data_dir, spec.split, spec.verify)
    specs.append(spec)
    opened.append((meta, src, pins))
    samplers.append(planner.sampler_of(spec, meta, src))
  classes, tables = _classes(names, [m for m, _, _ in opened], labels)
  offsets = np.cumsum([0] + [len(src) for _, src, _ in opened])[:-1]
  shard = process_shard(base.shard_index, base.shard_count)
  order = base.order or ("blocks" if any(src.backends[0].remote for _, src, _ in opened) else None)
  if order == "blocks":
    samplers = _block_samplers(base, specs, opened, shard)
  local = order == "blocks"
  sampler = MixSampler(schedule, samplers, offsets.tolist(), *shard, base.batch_size, local)
  heads, features, image = _outputs(base, names, specs, opened)
  _, _, batch_ops = transforms(base, len(classes))  # the mixture's own: on the mixed batch
  merged, meta = _merged(names, specs, opened, classes, base.split)
  arena = max(arena_bytes(h) for h, _ in heads)
  host = planner.plan(
    base, meta, merged, image_size=heads[0][0].image_size, arena_bytes=arena, sampler=sampler
  )
  planner.announce(host)
  chosen = host.parallel
  read = planner.read_stage(host, meta, base.split, merged)
  decode = MixDecode(
    parts=[
      DecodeImages(
        head,
        keys=spec.keys or m.keys,
        seed=base.seed,
        num_threads=chosen.threads,
        prefetch=perf.prefetch,
        on_error=base.on_error,
        cache_mb=spec.decoding.cache_mb / len(names),  # one cache's bytes over all sources
        decoder=None
        if spec.decoding.cache_mb
        else batch_decoder(head, spec.keys or m.keys, base.seed),
      )
      for (head, _), spec, (m, _, _) in zip(heads, specs, opened)
    ],
    checks=[
      FinishBatch(
        num_classes=m.num_classes,
        seed=base.seed,
        num_threads=chosen.threads,
        on_error=base.on_error,
        with_mask=True,
        image_ops=image_ops,
        features=own or None,
      )
      for (_, image_ops), (m, _, _), own in zip(heads, opened, features)
    ],
    tables=tables,
    names=names,
    prefetch=perf.prefetch,
    image=image,
    features=features[0],
  )
  finish = FinishBatch(
    num_classes=len(classes),
    seed=base.seed,
    num_threads=chosen.threads,
    on_error=base.on_error,
    with_mask=False,
    batch_ops=batch_ops,
  )
  for check in decode.checks:  # the sources' ops run on the mixture's one ops pool
    check.threads = finish.threads
  digests = {
    n: elastic.shard_list([(s.file, s.num_records, s.sha256) for s in m.splits[spec.split].shards])
    for n, spec, (m, _, _) in zip(names, specs, opened)
  }
  stream = {**host.stream, "mixture": sorted(names)}
  if local:  # the blocks' size and the windows all sources share: not the weights or sources
    stream["order"] = (
      f"blocks of {samplers[0].blocks.block_records}, each source its own, each process its "
      f"own, in rounds over windows of {_windows(base, shard[1])} blocks shared by the sources"
    )
  windows = _windows(base, shard[1]) if local else None
  mixture = Mixture(names, schedule, sampler, chosen.workers, digests, windows)
  _announce(mixture, [len(src) for _, src, _ in opened], chosen, read)
  return dict(
    plan=MixPlan(sampler, base.batch_size),
    sizes=Sizes.of(sampler, base.batch_size, True, repr(split)),
    manifest=meta,
    read=read,
    decode=decode,
    finish=finish,
    workers=chosen.workers,
    prefetch=perf.prefetch,
    stream=stream,
    stats_every_s=perf.stats_every_s,
    worker_jax=perf.worker_jax,
    stream_type=lambda parent, *a: MixStreamIterDataset(parent, *a, mixture=mixture),
    host=host,
  )


def label_tables(data_dir: Mapping, labels: str | None = None) -> dict[str, np.ndarray]:
  """Each source's label -> the mixture's (`labels=` as `stages` maps them), by name: to
  evaluate a source on its own stream with the classes the mixture trained."""
  labels = labels or "own"
  if labels not in LABELS:
    raise ValueError(f"labels must be one of {LABELS}, not {labels!r}")
  names = [str(n) for n in data_dir]
  dirs = [s.data_dir if isinstance(s, Source) else s for s in data_dir.values()]
  metas = [manifest_lib.load(os.fspath(d)) for d in dirs]
  return dict(zip(names, _classes(names, metas, labels)[1]))


def _check_mixable(base: Spec, keywords: dict) -> None:
  """A mixture is a training stream in the global order over every process's records."""
  if not base.train:
    raise ValueError(
      "a mixture is a training stream (train=True): evaluate each source with its own make_dataset"
    )
  if keywords.get("num_epochs") is not None:
    raise ValueError("a mixture repeats each source on its own: leave num_epochs unset")
  if base.sharding != "records":
    raise ValueError(
      "a mixture deals each source's records out to the processes (sharding='records'): "
      "leave sharding unset"
    )


def _block_samplers(base: Spec, specs: list, opened: list, shard: tuple) -> list:
  """Each source's block order in this process (`planner.sampler_of`, order="blocks"): blocks of
  one size (the read stage reads one: the smallest of the sources' own, or block_records=),
  each source's windows 1/K of one dataset's (`window_blocks=`, or its default), so that the
  K sources' windows hold what one dataset's does."""
  p, n = shard
  own = [dataclasses.replace(s, order="blocks", shard_index=p, shard_count=n) for s in specs]
  size = base.block_records or min(
    planner.sampler_of(s, m, src).blocks.block_records for s, (m, src, _) in zip(own, opened)
  )
  windows = _windows(base, n)
  own = [
    dataclasses.replace(s, block_records=size, window_blocks=max(1, windows // len(own)))
    for s in own
  ]
  return [planner.sampler_of(s, m, src) for s, (m, src, _) in zip(own, opened)]


def _windows(base: Spec, processes: int) -> int:
  """The blocks of all sources' windows together: as one dataset's (`planner.sampler_of`)."""
  return base.window_blocks or WINDOW_BATCHES * base.batch_size * processes


def _source_spec(source: Source, split: str, keywords: dict) -> Spec:
  """A source's spec: the mixture's keywords, its own split, pp and augment over them."""
  own = dict(keywords, order="global", shard_index=0, shard_count=1)  # the global stream
  if source.pp is not None:
    for k in ("pp", "ops", "batch_ops", "image_size"):
      own.pop(k, None)
    own["pp"] = source.pp
  for k in ("augment", "image_size", "ops", "features"):
    if getattr(source, k) is not None:
      own[k] = getattr(source, k)
  return Spec.of(os.fspath(source.data_dir), source.split or split, **own)


def _outputs(base: Spec, names: list, specs: list, opened: list) -> tuple[list, list, tuple]:
  """Each source's (head, image ops) and features, and the (shape, dtype) of the images they
  all make: one line names a source whose images or features differ from the first's."""
  heads, features = [], []
  for name, spec, (meta, src, _) in zip(names, specs, opened):
    try:
      head, image_ops, batch_ops = transforms(spec, meta.num_classes)
      wanted = spec.transforms.features
      features.append(features_lib.parse_specs(wanted, src.read([0])[0] if wanted else None))
    except ValueError as e:
      raise ValueError(f"source {name!r}: {e}") from None
    if batch_ops and spec.transforms.pp is not None and spec.transforms.pp != base.transforms.pp:
      raise ValueError(
        f"source {name!r}: its pp's batch ops run on the whole mixed batch: give them in the "
        "mixture's pp= or batch_ops="
      )
    heads.append((head, image_ops))
  image = _check_alike(names, [_image(h, ops, base.seed) for h, ops in heads], "images")
  _check_alike(names, [_described(f) for f in features], "features")
  return heads, features, image


def _image(head, image_ops, seed: int) -> tuple[tuple, np.dtype] | None:
  """(shape, dtype) of the images a source's head and image ops make: its ops run on a blank
  image of the head's size (None where they cannot: its ops need a real example)."""
  blank = np.zeros((head.image_size, head.image_size, 3), np.uint8)
  try:
    out = ops_lib.apply(image_ops, blank, ops_lib.reused_example_rng(seed, 0, 0))
  except Exception:  # noqa: BLE001 - a user's op on a blank image: checked per batch instead
    return None
  return out.shape, out.dtype


def _described(features: dict) -> dict:
  """Each feature's dtype and shape per example: what a source's batch holds of it."""
  kind = lambda f: f.dtype if f.dtype == features_lib.BYTES else f.numpy_dtype
  return {n: f"{kind(f)}{[*f.example_shape]}" for n, f in features.items()}


def _check_alike(names: list[str], made: list, what: str):
  """The first source's `made` (its images' (shape, dtype), or its features); one line names
  a source whose differ from it."""
  for name, mine in zip(names, made):
    if mine is not None and made[0] is not None and mine != made[0]:
      raise ValueError(
        f"source {name!r} makes {_say(mine)} {what}, {names[0]!r} {_say(made[0])}: every "
        f"source's {what} must come out alike (its image_size=, pp=, ops= or features=)"
      )
  return made[0]


def _say(made) -> str:
  if isinstance(made, dict):
    return ", ".join(f"{n} {d}" for n, d in made.items()) or "no"
  (shape, dtype) = made
  if dtype == np.uint8 and len(shape) == 3 and shape[2] == 3:
    return f"{shape[0]}x{shape[1]}"
  return f"{dtype}{list(shape)}"


def _classes(names: list[str], metas: list, labels: str) -> tuple[list[str], list[np.ndarray]]:
  """The mixture's classes and, per source, its label -> the mixture's label."""
  if labels == "own":
    longest = max(metas, key=lambda m: m.num_classes)
    return list(longest.classes), [np.arange(m.num_classes) for m in metas]
  if labels == "offset":
    classes = [f"{n}/{c}" for n, m in zip(names, metas) for c in m.classes]
    starts = np.cumsum([0] + [m.num_classes for m in metas])
    return classes, [np.arange(m.num_classes) + s for m, s in zip(metas, starts)]
  classes = list(dict.fromkeys(c for m in metas for c in m.classes))
  at = {c: k for k, c in enumerate(classes)}
  return classes, [np.array([at[c] for c in m.classes], np.int64) for m in metas]


def _merged(names, specs, opened, classes, split) -> tuple[ShardedSource, Manifest]:
  """One source over every source's shards (named "name: shard") and its manifest."""
  paths, pins, shards = [], [], []
  for name, spec, (meta, src, p) in zip(names, specs, opened):
    paths += src.paths
    pins += p
    own = meta.splits[spec.split].shards
    shards += [dataclasses.replace(s, file=f"{name}: {s.file}") for s in own]
  merged = ShardedSource(paths, [s.num_records for s in shards], pins)
  merged.names = [s.file for s in shards]
  total = sum(s.num_records for s in shards)
  return merged, Manifest(list(classes), {split: Split(total, shards)})


def _announce(mixture: Mixture, records: list[int], chosen, read) -> None:
  listed = list(zip(mixture.names, mixture.schedule.weights, records))
  shares = ", ".join(f"{n} {w:.1%} of {r:,} records" for n, w, r in listed[:4])
  shares += f" and {len(listed) - 4} more" if len(listed) > 4 else ""
  print(
    f"pipeline: mixture of {len(mixture.names)} sources ({shares}) in one read stage, one "
    f"decode pool of {chosen.threads} threads, {chosen.workers} worker processes and one "
    f"memory budget ({read.memory.describe() if read.memory else 'none'})",
    file=sys.stderr,
    flush=True,
  )


__all__ = ["LABELS", "Source", "is_mixture", "label_tables", "signature", "stages"]
