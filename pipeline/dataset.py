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
      .mp_prefetch(...) | ThreadPrefetchIterDataset    worker processes on many-core hosts,
                                      their batches in reused shared memory       stages/handoff.py
    StreamIterDataset                 validated, stream-tagged state; skip count stages/stream.py

`build` makes the stages and `chain` joins them, so you (or a benchmark) can change one stage
or add Grain steps between them. Every buffer sits inside the chain, whose state is the next
batch position, so `get_state()`/`set_state()` resume exactly; work started ahead is dropped.
"""

from __future__ import annotations

import dataclasses

import grain

from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import split as split_lib
from pipeline.host import guards, lifecycle, parallelism
from pipeline.host.parallelism import process_shard as _process_shard
from pipeline.order import blocks as blocks_lib
from pipeline.order.blocks import WINDOW_BATCHES, Blocks
from pipeline.order.sampling import Sampler
from pipeline.pp import features as features_lib
from pipeline.pp.transforms import transforms
from pipeline.spec import SIGNATURE, Spec
from pipeline.stages import handoff, stats
from pipeline.stages import stream as stream_lib
from pipeline.stages.ahead import AheadIterDataset
from pipeline.stages.decode import DecodeImages, batch_decoder
from pipeline.stages.errors import BadRecordError
from pipeline.stages.finish import FinishBatch
from pipeline.stages.plan import PlanBatches, Sizes
from pipeline.stages.read import ReadRecords, describe, probe
from pipeline.stages.stream import StreamIterDataset
from pipeline.storage import remote
from pipeline.storage.cache import record_cache as _record_cache
from pipeline.storage.source import ShardedSource

__all__ = ["BadRecordError", "Spec", "Stages", "build", "chain", "make_dataset"]


@dataclasses.dataclass
class Stages:
  """The stages of one dataset and how they are joined (`chain`)."""

  plan: PlanBatches
  sizes: Sizes
  manifest: manifest_lib.Manifest
  read: ReadRecords
  decode: DecodeImages
  finish: FinishBatch
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
  meta, source, pins = split_lib.open(spec.data_dir, spec.split, spec.verify)
  sampler = _sampler(spec, meta, source)
  head, image_ops, batch_ops = transforms(spec, meta.num_classes)
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
      cache_mb=spec.decoding.cache_mb,
      decoder=None if spec.decoding.cache_mb else batch_decoder(head, keys, spec.seed),
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
    workers=chosen.workers,
    prefetch=perf.prefetch,
    stream=stream_lib.describe(spec, sampler, meta.splits[spec.split].shards),
    stats_every_s=perf.stats_every_s,
  )


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


def chain(stages: Stages) -> grain.IterDataset:
  """The Grain dataset of `stages`: plan -> read -> decode/augment -> ops -> prefetch."""
  decode_stage, writer = stages.decode, None
  if stages.workers:
    guards.check_main_guard()
    lifecycle.ensure_absl_flags_parsed()
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
  if stages.workers:
    if writer is not None:
      it = handoff.SendIterDataset(it, writer)
    it = it.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=stages.workers), worker_init_fn=lifecycle.worker_init
    )
    if writer is not None:
      it = handoff.ReceiveIterDataset(it)
  else:
    it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=1)
  return lifecycle.ClosedAtExit(
    StreamIterDataset(it, stages.stream, recorder, stages.stats_every_s, stages.read)
  )
