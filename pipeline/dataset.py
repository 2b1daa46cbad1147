"""`make_dataset`: ArrayRecord shards -> batches of uint8 images, as a Grain dataset.

The chain, in Grain terms: one stage per step of the data flow, each in its own module:

    BatchIndices(num_batches)         the batch indices (a range; stop_after cuts it)
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

from pipeline import mixture, planner
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import split as split_lib
from pipeline.host import guards, lifecycle, shm
from pipeline.image import nvdecode
from pipeline.pp import features as features_lib
from pipeline.pp.transforms import transforms
from pipeline.spec import SIGNATURE, Spec
from pipeline.stages import device_decode, handoff, stats
from pipeline.stages.ahead import AheadIterDataset
from pipeline.stages.decode import DecodeImages, arena_bytes, batch_decoder
from pipeline.stages.errors import BadRecordError
from pipeline.stages.finish import FinishBatch
from pipeline.stages.plan import PlanBatches, Sizes
from pipeline.stages.read import ReadRecords
from pipeline.stages.stream import BatchIndices, StreamIterDataset

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
  worker_jax: bool = False
  stream_type: type = StreamIterDataset  # a mixture's keeps its sources' positions
  host: planner.HostPlan | None = None  # the plan they were made by
  spec: Spec | None = None  # what they were built from, its image size resolved (not a mixture's)


def make_dataset(data_dir, split: str = "train", **keywords) -> grain.IterDataset:
  """Batches {"image": uint8[B, S, S, 3], "label": int32[B]} (+ "mask": bool[B] in eval).

  The keywords (batch_size is required) are `pipeline.Spec`'s fields, documented there.
  `data_dir` may be a mixture, {name: data_dir or `pipeline.Source`} with `weights=` (and
  `labels=`): `pipeline.mixture`.
  """
  if mixture.is_mixture(data_dir):
    return chain(Stages(**mixture.stages(data_dir, split, **keywords)))
  return chain(build(Spec.of(data_dir, split, **keywords)))


make_dataset.__signature__ = mixture.signature(SIGNATURE).replace(
  return_annotation=grain.IterDataset
)


def build(spec: Spec) -> Stages:
  """The stages `make_dataset` joins, for `spec`: planned once (`pipeline.planner`), then made."""
  perf = spec.performance
  if perf.num_workers is None:  # this host may choose none; a host with more cores will not
    guards.check_main_guard("worker processes, which make_dataset starts on many-core hosts,")
  elif perf.num_workers:
    guards.check_main_guard()
  gpus = None  # decoding.on="device": nvImageCodec on these local GPUs ([]: its CPU backend)
  if spec.decoding.on == "device":
    device_decode.check(spec.decoding)
    gpus = nvdecode.local_gpus()
  meta, source, _ = split_lib.open(spec.data_dir, spec.split, spec.verify, perf.read_deadline_s)
  source.by_ranges = planner.order_of(spec, source) == "blocks"  # before its first read
  features = spec.transforms.features
  if features:
    first = source.backends[0].guard(
      lambda: source.read([0]), source.paths[0], perf.read_deadline_s
    )
    features = features_lib.parse_specs(features, sample=first[0])
  head, image_ops, batch_ops = transforms(spec, meta.num_classes)
  host = planner.plan(
    spec, meta, source, image_size=head.image_size, arena_bytes=arena_bytes(head), gpus=gpus
  )
  planner.announce(host)
  read = planner.read_stage(host, meta, spec.split, source)
  keys, threads = spec.keys or meta.keys, host.parallel.threads
  stages = Stages(
    plan=PlanBatches(host.sampler, spec.batch_size),
    sizes=Sizes.of(host.sampler, spec.batch_size, spec.drop_remainder, repr(spec.split)).up_to(
      spec.num_batches
    ),
    manifest=meta,
    read=read,
    decode=DecodeImages(
      head,
      keys=keys,
      seed=spec.seed,
      num_threads=threads,
      prefetch=perf.prefetch,
      on_error=spec.on_error,
      cache_mb=spec.decoding.cache_mb,
      decoder=None if spec.decoding.cache_mb else batch_decoder(head, keys, spec.seed),
    ),
    finish=FinishBatch(
      num_classes=meta.num_classes,
      seed=spec.seed,
      num_threads=threads,
      on_error=spec.on_error,
      with_mask=not spec.train,
      image_ops=image_ops,
      batch_ops=batch_ops,
      features=features or None,
    ),
    workers=host.parallel.workers,
    prefetch=perf.prefetch,
    stream=host.stream,
    stats_every_s=perf.stats_every_s,
    worker_jax=perf.worker_jax,
    host=host,
    spec=dataclasses.replace(spec, image_size=head.image_size),
  )
  if gpus is not None:
    stages.decode = device_decode.stage(stages.decode, gpus)
  return stages


def chain(stages: Stages) -> grain.IterDataset:
  """The Grain dataset of `stages`: plan -> read -> decode/augment -> ops -> prefetch."""
  decode_stage, writer = stages.decode, None
  if stages.workers:
    guards.check_main_guard()
    lifecycle.ensure_absl_flags_parsed()
    if shm.available():  # images resized straight into shared memory (pipeline.host.shm)
      writer = shm.Writer.new()
      decode_stage = dataclasses.replace(decode_stage, allocate=writer.empty)
  recorder = stats.Recorder()  # every stage's counters (`pipeline.stages.stats`), per process
  stages.read.threads.timed(recorder, "read")
  decode_stage.threads.timed(recorder, "decode")
  plan = stats.Timed(stages.plan, recorder, "plan")
  batches = BatchIndices(stages.sizes.num_batches)
  ds = batches.map(plan)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  it = AheadIterDataset(it, stages.read, (recorder, "read"))
  it = AheadIterDataset(it, decode_stage, (recorder, "decode"))
  it = it.map(stats.Timed(stages.finish, recorder, "finish", stages.read))
  if stages.workers:
    lifecycle.exit_on_sigterm()
    if writer is not None:
      it = handoff.SendIterDataset(it, writer)
    it = it.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=stages.workers), worker_init_fn=lifecycle.worker_init
    )
    if not stages.worker_jax:
      lifecycle.start_light(it)
    if writer is not None:
      it = handoff.ReceiveIterDataset(it)
  else:
    it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=1)
  return lifecycle.ClosedAtExit(
    stages.stream_type(
      it, stages.stream, recorder, stages.stats_every_s, stages.read, plan, batches
    )
  )
