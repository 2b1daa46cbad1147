"""`make_dataset`: ArrayRecord shards -> batches of uint8 images, as a Grain dataset.

The chain, in Grain terms: one stage per step of the data flow, each in its own module:

    MapDataset.range(num_batches)
      .map(PlanBatches)               plan: the (epoch, record) of each slot     pipeline.plan
      .to_iter_dataset()
    AheadIterDataset(ReadRecords)     read: next batches' records, many reads    pipeline.reads
                                      in flight, record cache first              pipeline.cache
    AheadIterDataset(DecodeImages)    decode/augment: native crop-window decode  pipeline.images
                                      + resize into the batch, on decode threads
      .map(FinishBatch)               ops: labels checked, features, your ops    pipeline.finish
      [.map(normalize)]
      .mp_prefetch(...) | ThreadPrefetchIterDataset    worker processes on many-core hosts,
                                      their batches in reused shared memory       pipeline.handoff
    StreamIterDataset                 validated, stream-tagged state; skip count pipeline.stream

`build` makes the stages and `chain` joins them, so you (or a benchmark) can change one stage
or add Grain steps between them. Every buffer sits inside the chain, whose state is the next
batch position, so `get_state()`/`set_state()` resume exactly; work started ahead is dropped.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence

import grain
import numpy as np
from etils import epath

from pipeline import augment as augment_lib
from pipeline import (
  guards,
  handoff,
  lifecycle,
  options,
  parallelism,
  reads,
  records,
  remote,
  tfds_folder,
)
from pipeline import manifest as manifest_lib
from pipeline.ahead import AheadIterDataset
from pipeline.cache import RecordCache, dataset_id
from pipeline.errors import BadRecordError
from pipeline.finish import FinishBatch
from pipeline.images import DecodeImages
from pipeline.options import Augment, Performance
from pipeline.plan import PlanBatches
from pipeline.sampling import Sampler
from pipeline.source import ShardedSource
from pipeline.stream import StreamIterDataset

__all__ = ["BadRecordError", "Stages", "build", "chain", "make_dataset"]

SLOW_READ_S = 0.002  # reads at least this slow get the record cache by default
CACHE_MEMORY_SHARE = 0.25  # of the available memory the default record cache may take


@dataclasses.dataclass
class Stages:
  """The stages of one dataset and how they are joined (`chain`)."""

  plan: PlanBatches
  num_batches: int
  read: reads.ReadRecords
  decode: DecodeImages
  finish: FinishBatch
  normalize: bool
  workers: int
  prefetch: int
  stream: dict


def make_dataset(
  data_dir,
  split: str = "train",
  *,
  batch_size: int,
  train: bool = True,
  seed: int = 0,
  image_size: int | None = None,
  num_epochs: int | None = None,
  shuffle: bool | None = None,
  drop_remainder: bool | None = None,
  shard_index: int | None = None,
  shard_count: int | None = None,
  sharding: str = "records",
  augment: Augment | Mapping | None = None,
  pp: str | None = None,
  ops: str | Sequence = (),
  batch_ops: str | Sequence = (),
  features: Mapping | None = None,
  keys: records.Keys | None = None,
  normalize: bool = False,
  on_error: str = "raise",
  verify: str = "size",
  performance: Performance | Mapping | None = None,
) -> grain.IterDataset:
  """Batches {"image": uint8[B, S, S, 3], "label": int32[B]} (+ "mask": bool[B] in eval).

  Args:
    data_dir: a converted dataset (holds manifest.json), or a TFDS ArrayRecord build read in
      place (its version folder, or "tfds://name[:version]"); local, gs:// or mounted.
    split: the manifest split to read.
    batch_size: examples per batch *of this process*.
    train: random-resized-crop + flip, shuffled, repeated forever, drops the remainder;
      otherwise centre crop, in order, one epoch, padded with mask=False examples so every
      process yields the same number of batches and every record counts exactly once.
    seed: seeds the shuffle (a new order per epoch) and the augmentation.
    image_size: S, the side of the square output images (default 224, or pp's size).
    num_epochs: None repeats forever (train default); eval default is 1.
    shuffle: default `train`.
    drop_remainder: drop the last partial batch of a finite stream (default: train).
    shard_index, shard_count: this process's slice; default jax.process_index()/count(). A
      train stream's global batches, and its states, are the same on any count (pipeline.elastic).
    sharding: "records" (default): each epoch's global shuffle is dealt out to the processes;
      "shards": each process owns whole shards (shard k: process k % shard_count) and
      shuffles within them, so a host reads and caches 1/shard_count of the dataset (the
      shuffle then never mixes records across processes' shards).
    augment: the crop, flip and resize filter (`pipeline.Augment` or a dict of its fields).
    pp: a big_vision pp string, e.g. "decode_jpeg_and_inception_crop(224)|flip_lr|
      value_range(-1, 1)|onehot(1000, key='label', key_result='labels')|keep('image',
      'labels')": its decode/crop/resize/flip ops set the fused head (train must match its
      head, augment may not set what it sets), the rest become ops and batch ops (so not
      with ops= / batch_ops=); see `pipeline.pp`.
    ops: your per-image ops, run after the built-in head on each image with a per-example
      RNG: callables or registered names ("color_jitter(0.4)"; see `pipeline.ops`);
      batch_ops: the same for whole batches (e.g. "mixup(0.2)").
    features: extra Example features to pass through, {name: key or pipeline.Feature}.
    keys: feature keys of the records (default: the manifest's).
    normalize: host-side float32 in [-1, 1] (default: uint8; normalize on device instead).
    on_error: "raise" (default) or "skip" a bad record; errors name the shard and record.
      The skip count is `iterator.skipped`, also in `get_state()["skipped"]`.
    verify: what is checked of the shards at open against the manifest: "size" (regular
      files, sizes, record counts), "sha256" (also every byte), or "none".
    performance: threads, worker processes, prefetch, read-ahead, caches, DCT scaling
      (`pipeline.Performance` or a dict of its fields); never changes what a batch holds.
      Threads and workers left None are chosen for this host (`pipeline.parallelism`; 2
      cores: no workers, a thread per core), the read-ahead for the read latency measured at
      open (`pipeline.reads`), and the choice is printed once.
  """
  return chain(build(**locals()))


def build(
  data_dir,
  split: str = "train",
  *,
  batch_size: int,
  train: bool = True,
  seed: int = 0,
  image_size: int | None = None,
  num_epochs: int | None = None,
  shuffle: bool | None = None,
  drop_remainder: bool | None = None,
  shard_index: int | None = None,
  shard_count: int | None = None,
  sharding: str = "records",
  augment: Augment | Mapping | None = None,
  pp: str | None = None,
  ops: str | Sequence = (),
  batch_ops: str | Sequence = (),
  features: Mapping | None = None,
  keys: records.Keys | None = None,
  normalize: bool = False,
  on_error: str = "raise",
  verify: str = "size",
  performance: Performance | Mapping | None = None,
) -> Stages:
  """The stages `make_dataset` joins, for the same arguments (see there)."""
  if on_error not in ("raise", "skip"):
    raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  if sharding not in ("records", "shards"):
    raise ValueError(f"sharding must be 'records' or 'shards', not {sharding!r}")
  perf = options.coerce(Performance, performance)
  if perf.num_workers is None:  # this host may choose none; a host with more cores will not
    guards.check_main_guard("worker processes, which make_dataset starts on many-core hosts,")
  elif perf.num_workers:
    guards.check_main_guard()
  data_dir = tfds_folder.resolve(data_dir)
  remote.check(data_dir, probe=False)  # manifest_lib.load probes it
  data_dir = epath.Path(data_dir)
  meta = manifest_lib.load(data_dir)
  paths, pins = manifest_lib.pinned_shards(data_dir, meta, split, verify=verify)
  counts = [s.num_records for s in meta.splits[split].shards]
  shard_index, shard_count = _process_shard(shard_index, shard_count)
  sampler = Sampler(
    num_records=meta.splits[split].num_records,
    seed=seed,
    shuffle=train if shuffle is None else shuffle,
    num_epochs=num_epochs if num_epochs is not None else (None if train else 1),
    shard_index=shard_index,
    shard_count=shard_count,
    remainder="drop" if train else "pad",
    shard_records=tuple(counts) if sharding == "shards" else None,
    block=batch_size,
  )
  aug = options.coerce(Augment, augment)
  if pp is not None:
    aug, image_size, ops, batch_ops = _compile_pp(
      pp, meta, train, image_size, aug, ops, batch_ops, normalize
    )
  image_size = 224 if image_size is None else image_size
  if image_size < 1:
    raise ValueError(f"image_size must be positive, got {image_size}")
  head = augment_lib.Head(
    image_size=image_size,
    train=train,
    area_range=aug.area_range,
    aspect_range=aug.aspect_range,
    flip=aug.flip,
    crop_fraction=aug.eval_fraction(image_size),
    bicubic=aug.interpolation == "bicubic",
    crop=aug.crop,
    eval_order=aug.eval_order,
    dct_scaling=perf.dct_scaling,
    fast_dct=perf.fast_dct,
  )
  source = ShardedSource(paths, counts, pins)
  guards.check_address_space(f"split {split!r} of {data_dir}")
  if features:
    from pipeline import features as features_lib

    features = features_lib.parse_specs(features, sample=source.read([0])[0])
  if (ops or batch_ops) and pp is None:
    from pipeline import ops as ops_lib

    ops = ops_lib.build(ops, "image", image_size=image_size, num_classes=meta.num_classes)
    batch_ops = ops_lib.build(
      batch_ops, "batch", image_size=image_size, num_classes=meta.num_classes
    )
  chosen = parallelism.plan(
    num_workers=perf.num_workers,
    num_threads=perf.num_threads,
    batch_size=batch_size,
    image_bytes=image_size**2 * 3,
    prefetch=perf.prefetch,
  )
  if chosen.workers and handoff.available():  # a ring /dev/shm cannot hold: SIGBUS later
    batch_bytes = batch_size * image_size**2 * 3 * (5 if normalize else 1)  # + float32 copy
    needed = handoff.shm_needed(
      chosen.workers, batch_bytes, perf.prefetch, parallelism.WORKER_BATCHES
    )
    short = handoff.shm_check(chosen.workers, needed)
    if short:
      chosen = parallelism.plan(num_workers=0, batch_size=batch_size, prefetch=perf.prefetch)
      chosen = dataclasses.replace(chosen, why=short)
  latency_s, record_bytes = reads.probe(source)
  cache = _record_cache(meta, split, perf, latency_s, record_bytes, chosen, sampler, pins)
  read = reads.ReadRecords(
    source,
    batch_size=batch_size,
    rate_per_s=parallelism.project(parallelism.available_cores(), parallelism.COSTS, chosen)
    / max(1, chosen.workers),
    latency_s=latency_s,
    record_bytes=record_bytes,
    ahead_bytes=int(perf.read_ahead_mb * 2**20),
    cache=cache,
    max_depth=perf.read_ahead,
  )
  parallelism.announce(chosen, reads.describe(read, cache))
  drop = train if drop_remainder is None else drop_remainder
  num_batches = (
    len(sampler) // batch_size
    if drop or sampler.num_epochs is None
    else -(-len(sampler) // batch_size)
  )
  guards.check_batch_fits(batch_size, sampler.per_epoch, drop_remainder=drop, split=repr(split))
  stream = {
    "shard_index": shard_index,
    "shard_count": shard_count,
    "seed": seed,
    "batch_size": batch_size,
    "num_records": sampler.num_records,
  }
  if sharding != "records":
    stream["sharding"] = sharding
  if not train:  # padded per epoch: the order depends on shard_count (pipeline.elastic)
    stream["remainder"] = "pad"
  return Stages(
    plan=PlanBatches(sampler, batch_size),
    num_batches=num_batches,
    read=read,
    decode=DecodeImages(
      head,
      keys=keys or meta.keys,
      seed=seed,
      num_threads=chosen.threads,
      prefetch=perf.prefetch,
      on_error=on_error,
      cache_mb=perf.cache_mb,
    ),
    finish=FinishBatch(
      num_classes=meta.num_classes,
      seed=seed,
      num_threads=chosen.threads,
      on_error=on_error,
      with_mask=not train,
      image_ops=ops,
      batch_ops=batch_ops,
      features=features or None,
    ),
    normalize=normalize,
    workers=chosen.workers,
    prefetch=perf.prefetch,
    stream=stream,
  )


def _compile_pp(pp, meta, train, image_size, aug, ops, batch_ops, normalize):
  """`pp`'s head settings merged into `aug` and its ops; any setting it conflicts with is an
  error naming both."""
  from pipeline import pp as pp_lib

  if ops or batch_ops:
    raise ValueError(
      "pass either pp= or ops= / batch_ops=: a pp string holds the ops (name yours in it "
      "after ops.register)"
    )
  compiled = pp_lib.compile(pp, num_classes=meta.num_classes, image_size=image_size)
  if compiled.train != train:
    head = "an inception-crop (train)" if compiled.train else "a resize_small|central_crop (eval)"
    raise ValueError(
      f"pp {pp!r} has {head} head but train={train}: pass train={compiled.train} "
      "(train also decides shuffle, repeat and the eval mask)"
    )
  if image_size is not None and image_size != compiled.image_size:
    raise ValueError(
      f"image_size={image_size} but pp {pp!r} makes {compiled.image_size}: leave image_size out"
    )
  scales = [op for op in compiled.batch_ops if type(op).__name__ == "ValueRange"]
  if normalize and scales:
    raise ValueError(
      "normalize=True and pp's value_range both scale the pixels: drop one (normalizing on "
      "the device, pipeline.input(normalize=...), moves uint8 and is faster)"
    )
  mixes = [op for op in compiled.batch_ops if type(op).__name__ == "BigVisionMixup"]
  if mixes and not train:
    raise ValueError(f"pp {pp!r} mixes (mixup) in an eval stream: big_vision mixes training only")
  defaults = Augment()
  for field, value in compiled.augment.items():
    mine = getattr(aug, field)
    if mine != getattr(defaults, field) and mine != value:
      raise ValueError(
        f"augment.{field}={mine!r} conflicts with pp {pp!r}, which sets {field}={value!r}: "
        "set it in one place"
      )
  aug = dataclasses.replace(aug, **compiled.augment)
  return aug, compiled.image_size, compiled.image_ops, compiled.batch_ops


def chain(stages: Stages) -> grain.IterDataset:
  """The Grain dataset of `stages`: plan -> read -> decode/augment -> ops -> prefetch."""
  decode, writer = stages.decode, None
  if stages.workers:
    guards.check_main_guard()
    _ensure_absl_flags_parsed()
    if handoff.available():  # images resized straight into shared memory (pipeline.handoff)
      writer = handoff.Writer.new()
      decode = copy.copy(decode)
      decode.images_in = writer
  ds = grain.MapDataset.range(stages.num_batches).map(stages.plan)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  it = AheadIterDataset(it, stages.read)
  it = AheadIterDataset(it, decode)
  it = it.map(stages.finish)
  if stages.normalize:
    it = it.map(_normalize_host)
  if stages.workers:
    if writer is not None:
      it = handoff.SendIterDataset(it, writer)
    it = it.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=stages.workers), worker_init_fn=_worker_init
    )
    if writer is not None:
      it = handoff.ReceiveIterDataset(it)
  else:
    it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=1)
  return lifecycle.ClosedAtExit(StreamIterDataset(it, stages.stream))


def _record_cache(
  meta, split, perf, latency_s, record_bytes, chosen, sampler, pins
) -> RecordCache | None:
  """The record cache `perf` asks for; by default the whole split in RAM when storage is
  slow (>= SLOW_READ_S a read) and every process's copy fits CACHE_MEMORY_SHARE of memory.
  Its entries are tied to the shards as opened (`pins`)."""
  shards = meta.splits[split].shards
  ram_mb = perf.record_cache_mb
  if ram_mb is None:
    split_bytes = sum(s.bytes or 0 for s in shards)
    if any(s.bytes is None for s in shards):  # sizes not recorded (a TFDS build): estimated
      split_bytes = int(record_bytes * meta.splits[split].num_records)
    if sampler.shard_records is not None:
      split_bytes //= sampler.shard_count
    copies = max(1, chosen.workers)
    fits = copies * split_bytes <= CACHE_MEMORY_SHARE * parallelism.available_memory()
    ram_mb = split_bytes * 1.05 / 2**20 if latency_s >= SLOW_READ_S and fits else 0.0
  if not ram_mb and not perf.record_cache_dir:
    return None
  names = [s.file for s in shards]
  directory = os.fspath(perf.record_cache_dir) if perf.record_cache_dir else None
  return RecordCache(
    int(ram_mb * 2**20),
    directory,
    # a TFDS build records no digests: its dataset info's fingerprint names it instead
    dataset_id([s.sha256 or meta.created_by.get("fingerprint", "") for s in shards], names),
    names,
    [manifest_lib.cache_key(p) for p in pins],
  )


def _normalize_host(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  if batch["image"].dtype != np.uint8:
    raise ValueError(
      f"normalize=True scales uint8 pixels, but the ops made {batch['image'].dtype} images: "
      "normalize in your op, or drop normalize="
    )
  return {**batch, "image": batch["image"].astype(np.float32) / 127.5 - 1.0}


def _process_shard(shard_index, shard_count) -> tuple[int, int]:
  if shard_index is None or shard_count is None:
    import jax

    return jax.process_index(), jax.process_count()
  return shard_index, shard_count


def _worker_init(worker_index: int, worker_count: int) -> None:
  """Ctrl-C is the main process's to handle (the trainer saves a checkpoint); workers that
  also received it would die with tracebacks mid-save. Workers end with the main process."""
  del worker_index, worker_count
  import signal

  signal.signal(signal.SIGINT, signal.SIG_IGN)
  lifecycle.die_with_parent()


def _ensure_absl_flags_parsed() -> None:
  """Grain workers read absl flags; unparsed flags crash them (grain #1355)."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
