"""`make_dataset`: ArrayRecord shards -> batches of uint8 images, as a Grain dataset.

The chain, in Grain terms: one stage per step of the data flow, each in its own module:

    MapDataset.range(num_batches)
      .map(PlanBatches)               plan: the (epoch, record) of each slot     stages/plan.py
      .to_iter_dataset()
    AheadIterDataset(ReadRecords)     read: next batches' records, many reads    stages/read.py
                                      in flight, record cache first              storage/cache.py
    AheadIterDataset(DecodeImages)    decode/augment: native crop-window decode  stages/decode.py
                                      + resize into the batch, on decode threads
      .map(FinishBatch)               ops: labels checked, features, your ops    stages/finish.py
      [.map(normalize)]
      .mp_prefetch(...) | ThreadPrefetchIterDataset    worker processes on many-core hosts,
                                      their batches in reused shared memory       stages/handoff.py
    StreamIterDataset                 validated, stream-tagged state; skip count stages/stream.py

`build` makes the stages and `chain` joins them, so you (or a benchmark) can change one stage
or add Grain steps between them. Every buffer sits inside the chain, whose state is the next
batch position, so `get_state()`/`set_state()` resume exactly; work started ahead is dropped.
"""

from __future__ import annotations

import dataclasses
import os

import grain
import numpy as np
from etils import epath

from pipeline import pp as pp_lib
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import tfds_folder
from pipeline.host import guards, lifecycle, parallelism
from pipeline.image import augment as augment_lib
from pipeline.options import Augment
from pipeline.order import blocks as blocks_lib
from pipeline.order import elastic
from pipeline.order.blocks import WINDOW_BATCHES, Blocks
from pipeline.order.sampling import Sampler
from pipeline.pp import features as features_lib
from pipeline.spec import SIGNATURE, Spec
from pipeline.stages import handoff, stats
from pipeline.stages.ahead import AheadIterDataset
from pipeline.stages.decode import DecodeImages, batch_decoder
from pipeline.stages.errors import BadRecordError
from pipeline.stages.finish import FinishBatch
from pipeline.stages.plan import PlanBatches, Sizes
from pipeline.stages.read import ReadRecords, describe, probe
from pipeline.stages.stream import StreamIterDataset
from pipeline.storage import remote
from pipeline.storage.cache import RecordCache, dataset_id
from pipeline.storage.source import ShardedSource

__all__ = ["BadRecordError", "Spec", "Stages", "build", "chain", "make_dataset"]

SLOW_READ_S = 0.002  # reads at least this slow get the record cache by default
CACHE_MEMORY_SHARE = 0.25  # of the available memory the default record cache may take


@dataclasses.dataclass
class Stages:
  """The stages of one dataset and how they are joined (`chain`)."""

  plan: PlanBatches
  sizes: Sizes
  manifest: manifest_lib.Manifest
  read: ReadRecords
  decode: DecodeImages
  finish: FinishBatch
  normalize: bool
  workers: int
  prefetch: int
  stream: dict
  stats_every_s: float | None = None


def make_dataset(data_dir, split: str = "train", **keywords) -> grain.IterDataset:
  """Batches {"image": uint8[B, S, S, 3], "label": int32[B]} (+ "mask": bool[B] in eval).

  The keywords (batch_size is required) are `pipeline.Spec`'s fields, documented there.
  """
  return chain(build(Spec.of(data_dir, split, **keywords)))


make_dataset.__signature__ = SIGNATURE.replace(return_annotation=grain.IterDataset)


def build(spec: Spec) -> Stages:
  """The stages `make_dataset` joins, for `spec`."""
  perf = spec.performance
  if perf.num_workers is None:  # this host may choose none; a host with more cores will not
    guards.check_main_guard("worker processes, which make_dataset starts on many-core hosts,")
  elif perf.num_workers:
    guards.check_main_guard()
  meta, source, pins = _open(spec)
  sampler = _sampler(spec, meta, source)
  head, image_ops, batch_ops = _transforms(spec, meta)
  features = spec.transforms.features
  if features:
    features = features_lib.parse_specs(features, sample=source.read([0])[0])
  chosen = _workers(spec, head.image_size, sampler.blocks is not None)
  read = _read(spec, meta, source, pins, sampler, chosen)
  keys = spec.keys or meta.keys
  return Stages(
    plan=PlanBatches(sampler, spec.batch_size),
    sizes=Sizes.of(sampler, spec.batch_size, spec.drop_remainder, repr(spec.split)),
    manifest=meta,
    read=read,
    decode=DecodeImages(
      head,
      keys=keys,
      seed=spec.seed,
      num_threads=chosen.threads,
      prefetch=perf.prefetch,
      on_error=spec.on_error,
      cache_mb=perf.cache_mb,
      decoder=None if perf.cache_mb else batch_decoder(head, keys, spec.seed),
    ),
    finish=FinishBatch(
      num_classes=meta.num_classes,
      seed=spec.seed,
      num_threads=chosen.threads,
      on_error=spec.on_error,
      with_mask=not spec.train,
      image_ops=image_ops,
      batch_ops=batch_ops,
      features=features or None,
    ),
    normalize=spec.transforms.normalize,
    workers=chosen.workers,
    prefetch=perf.prefetch,
    stream=_stream(spec, sampler, meta.splits[spec.split].shards),
    stats_every_s=perf.stats_every_s,
  )


def _open(spec: Spec):
  """(manifest, source, pins): the split's shards, checked against the manifest (`verify`)."""
  data_dir = tfds_folder.resolve(spec.data_dir)
  remote.check(data_dir, probe=False)  # manifest_lib.load probes it
  data_dir = epath.Path(data_dir)
  meta = manifest_lib.load(data_dir)
  paths, pins = manifest_lib.pinned_shards(data_dir, meta, spec.split, verify=spec.verify)
  counts = [s.num_records for s in meta.splits[spec.split].shards]
  source = ShardedSource(paths, counts, pins)
  guards.check_address_space(f"split {spec.split!r} of {data_dir}")
  return meta, source, pins


def _sampler(spec: Spec, meta: manifest_lib.Manifest, source: ShardedSource) -> Sampler:
  """This process's order of the split's records (`pipeline.order.sampling`): by default the block
  order (`pipeline.order.blocks`) when the shards are in a bucket, the global shuffle otherwise."""
  shard_index, shard_count = _process_shard(spec.shard_index, spec.shard_count)
  split = meta.splits[spec.split]
  counts = tuple(s.num_records for s in split.shards)
  order = spec.order or ("blocks" if remote.in_bucket(source.paths[0]) else "global")
  return Sampler(
    num_records=split.num_records,
    seed=spec.seed,
    shuffle=spec.shuffle,
    num_epochs=spec.num_epochs,
    shard_index=shard_index,
    shard_count=shard_count,
    remainder="drop" if spec.train else "pad",
    shard_records=counts if spec.sharding == "shards" else None,
    blocks=_blocks(spec, split.shards, shard_count) if order == "blocks" else None,
    block=spec.batch_size,
  )


def _blocks(spec: Spec, shards: list, shard_count: int) -> Blocks:
  """The block order: blocks of 2 MiB or more by default (`blocks_lib.block_records`, from
  the manifest's shard sizes), windows of `WINDOW_BATCHES` global batches of blocks (a
  process's own batches when it owns its shards)."""
  counts = tuple(s.num_records for s in shards)
  known = all(s.bytes is not None for s in shards)
  record_bytes = sum(s.bytes for s in shards) / max(1, sum(counts)) if known else None
  size = spec.block_records or blocks_lib.block_records(record_bytes)
  batch = spec.batch_size * (shard_count if spec.sharding == "records" else 1)
  return Blocks(counts, size, spec.window_blocks or WINDOW_BATCHES * batch)


def _transforms(spec: Spec, meta: manifest_lib.Manifest) -> tuple[augment_lib.Head, tuple, tuple]:
  """(head, image ops, batch ops): the built-in head and the ops after it, pp's merged in."""
  aug, image_size, group = spec.augment, spec.image_size, spec.transforms
  ops, batch_ops = group.ops, group.batch_ops
  if group.pp is not None:
    aug, image_size, ops, batch_ops = _compile_pp(
      group.pp, meta, spec.train, image_size, aug, ops, batch_ops, group.normalize
    )
  image_size = 224 if image_size is None else image_size
  if (ops or batch_ops) and group.pp is None:
    context = dict(image_size=image_size, num_classes=meta.num_classes)
    ops = pp_lib.build(ops, "image", **context)
    batch_ops = pp_lib.build(batch_ops, "batch", **context)
  head = augment_lib.Head(
    image_size=image_size,
    train=spec.train,
    area_range=aug.area_range,
    aspect_range=aug.aspect_range,
    flip=aug.flip,
    crop_fraction=aug.eval_fraction(image_size),
    bicubic=aug.interpolation == "bicubic",
    crop=aug.crop,
    eval_order=aug.eval_order,
    dct_scaling=spec.performance.dct_scaling,
    fast_dct=spec.performance.fast_dct,
  )
  return head, ops, batch_ops


def _workers(spec: Spec, image_size: int, blocks: bool) -> parallelism.Plan:
  """Worker processes and threads for this host (`pipeline.host.parallelism`): in the block order
  a number of workers that divides WINDOW_BATCHES (each then reads its blocks whole);
  no workers when /dev/shm cannot hold their ring of batches (a SIGBUS later)."""
  perf, batch_size = spec.performance, spec.batch_size
  chosen = parallelism.plan(
    num_workers=perf.num_workers,
    num_threads=perf.num_threads,
    batch_size=batch_size,
    image_bytes=image_size**2 * 3,
    prefetch=perf.prefetch,
    divide=WINDOW_BATCHES if blocks else None,
  )
  if chosen.workers and handoff.available():
    normalize = spec.transforms.normalize
    batch_bytes = batch_size * image_size**2 * 3 * (5 if normalize else 1)  # + float32 copy
    needed = handoff.shm_needed(
      chosen.workers, batch_bytes, perf.prefetch, parallelism.WORKER_BATCHES
    )
    short = handoff.shm_check(chosen.workers, needed)
    if short:
      chosen = parallelism.plan(num_workers=0, batch_size=batch_size, prefetch=perf.prefetch)
      chosen = dataclasses.replace(chosen, why=short)
  return chosen


def _read(spec: Spec, meta, source, pins, sampler, chosen) -> ReadRecords:
  """The read stage: read-ahead for the latency measured now, the record cache first; the
  choices printed once."""
  perf = spec.performance
  latency_s, record_bytes = probe(source, deadline_s=perf.read_deadline_s)
  cache = _record_cache(meta, spec.split, perf, latency_s, record_bytes, chosen, sampler, pins)
  read = ReadRecords(
    source,
    batch_size=spec.batch_size,
    rate_per_s=parallelism.project(parallelism.available_cores(), parallelism.COSTS, chosen)
    / max(1, chosen.workers),
    latency_s=latency_s,
    record_bytes=record_bytes,
    ahead_bytes=int(perf.read_ahead_mb * 2**20),
    cache=cache,
    max_depth=perf.read_ahead,
    block_records=_pieces(sampler, chosen.workers),
    window_bytes=_window_bytes(sampler, record_bytes),
    epoch_requests=_epoch_requests(sampler, chosen.workers),
    max_requests_per_s=perf.max_requests_per_s and perf.max_requests_per_s / max(1, chosen.workers),
    deadline_s=perf.read_deadline_s,
  )
  parallelism.announce(chosen, describe(read, cache))
  return read


def _pieces(sampler: Sampler, workers: int) -> int | None:
  """Records per block read in each process: a worker process reads its part of a block."""
  if sampler.blocks is None:
    return None
  batch = sampler.block * _dealt_to(sampler)
  return blocks_lib.pieces(sampler.blocks, batch, workers)


def _dealt_to(sampler: Sampler) -> int:
  """The processes the blocks are dealt out to (each process that owns shards has its own)."""
  return sampler.shard_count if sampler.shard_records is None else 1


def _epoch_requests(sampler: Sampler, workers: int) -> float | None:
  """The block reads this process makes in an epoch, on average: its share of the blocks,
  each in block_records / pieces requests."""
  if sampler.blocks is None:
    return None
  b = sampler.blocks
  return b.count / sampler.shard_count * (b.block_records // _pieces(sampler, workers))


def _window_bytes(sampler: Sampler, record_bytes: float) -> int:
  """The bytes of the blocks one window of the block order holds in this process (at most
  the split's)."""
  if sampler.blocks is None:
    return 0
  b = sampler.blocks
  lanes = blocks_lib.lanes_per_host(b, _dealt_to(sampler))
  return int(min(lanes * b.largest, sampler.num_records) * record_bytes)


def _stream(spec: Spec, sampler: Sampler, shards: list) -> dict:
  """What the iterator's state is checked against when it is restored (`pipeline.stages.stream`)."""
  stream = {
    "shard_index": sampler.shard_index,
    "shard_count": sampler.shard_count,
    "seed": spec.seed,
    "batch_size": spec.batch_size,
    "num_records": sampler.num_records,
    "shards": elastic.shard_list([(s.file, s.num_records) for s in shards]),
  }
  if spec.sharding != "records":
    stream["sharding"] = spec.sharding
  if not spec.train:  # padded per epoch: the order depends on shard_count (pipeline.order.elastic)
    stream["remainder"] = "pad"
  if sampler.blocks is not None:
    b = sampler.blocks
    stream["order"] = (
      f"blocks of {b.block_records}, each process its own, in rounds over windows of "
      f"{b.window_blocks}"
    )
  return stream


def _compile_pp(pp, meta, train, image_size, aug, ops, batch_ops, normalize):
  """`pp`'s head settings merged into `aug` and its ops; any setting it conflicts with is an
  error naming both."""
  if ops or batch_ops:
    raise ValueError(
      "pass either pp= or ops= / batch_ops=: a pp string holds the ops (name yours in it "
      "after pipeline.pp.registry.register)"
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
  decode_stage, writer = stages.decode, None
  if stages.workers:
    guards.check_main_guard()
    _ensure_absl_flags_parsed()
    if handoff.available():  # images resized straight into shared memory (pipeline.stages.handoff)
      writer = handoff.Writer.new()
      decode_stage = dataclasses.replace(decode_stage, allocate=writer.empty)
  recorder = stats.Recorder()  # every stage's counters (`pipeline.stages.stats`), per process
  stages.read.threads.timed(recorder, "read")
  decode_stage.threads.timed(recorder, "decode")
  plan = stats.Timed(stages.plan, recorder, "plan")
  ds = grain.MapDataset.range(stages.sizes.num_batches).map(plan)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  it = AheadIterDataset(it, stages.read, (recorder, "read"))
  it = AheadIterDataset(it, decode_stage, (recorder, "decode"))
  it = it.map(stats.Timed(stages.finish, recorder, "finish", stages.read))
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
  return lifecycle.ClosedAtExit(
    StreamIterDataset(it, stages.stream, recorder, stages.stats_every_s, stages.read)
  )


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
