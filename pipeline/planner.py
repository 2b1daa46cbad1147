"""The host plan: every number a dataset's stages run with, decided once (`plan`).

From a spec, its split's manifest and its opened shards: the records' order (the block order
when the shards are remote, the global shuffle otherwise), worker processes x decode threads
within the memory budget, one read measured at open, the record cache, the budget's split,
the read-ahead and the block reads. `dataset.build` and `pipeline.mixture` (one plan for a
whole mixture) make the stages from it, `announce` prints it; no stage plans.
"""

from __future__ import annotations

import dataclasses
import os

from pipeline.host import memory, parallelism, shm
from pipeline.host.parallelism import process_shard
from pipeline.image import nvdecode
from pipeline.order import blocks as blocks_lib
from pipeline.order import elastic
from pipeline.order.blocks import WINDOW_BATCHES, Blocks
from pipeline.order.sampling import Sampler
from pipeline.spec import Spec
from pipeline.stages import read as read_lib
from pipeline.storage import blockstore, budget, cache, fetch


@dataclasses.dataclass(frozen=True)
class HostPlan:
  """What `plan` decided for one dataset (or mixture) on this host."""

  sampler: Sampler  # this process's order of the records
  parallel: parallelism.Plan  # worker processes x decode threads
  memory: memory.Split  # performance.memory_mb's parts
  reads: read_lib.ReadPlan  # the read stage's numbers
  stream: dict  # what a state of the stream is checked against (`pipeline.stages.stream`)
  gpus: tuple | None = None  # decoding.on="device": its local GPUs (empty: nvImageCodec's CPU)

  @property
  def order(self) -> str:
    return "global" if self.sampler.blocks is None else "blocks"


def plan(
  spec: Spec,
  meta,
  source,
  *,
  image_size: int,
  arena_bytes: int = 0,
  sampler: Sampler | None = None,
  gpus: list[int] | None = None,
) -> HostPlan:
  """`spec`'s plan on this host for `meta`'s split opened as `source` (its first record read
  a few times: `fetch.probe`), images of `image_size`, decode arenas of `arena_bytes`;
  `sampler`: a mixture's (default: `sampler_of(spec, meta, source)`); `gpus`: decoding on them."""
  opened = fetch.probe(source, deadline_s=spec.performance.read_deadline_s)
  return decide(
    spec,
    meta,
    source,
    opened,
    image_size=image_size,
    arena_bytes=arena_bytes,
    sampler=sampler,
    gpus=gpus,
  )


def decide(
  spec: Spec,
  meta,
  source,
  opened: tuple[float, float],
  *,
  image_size: int,
  arena_bytes: int = 0,
  sampler: Sampler | None = None,
  gpus: list[int] | None = None,
) -> HostPlan:
  """`plan` for a read measured at open as `opened`, (seconds, bytes): a function of its
  arguments and of this host (cores, available memory, /dev/shm)."""
  perf = spec.performance
  sampler = sampler or sampler_of(spec, meta, source)
  chosen = workers(spec, image_size, WINDOW_BATCHES if sampler.blocks is not None else None)
  if gpus is not None:
    chosen = on_device(chosen, perf.num_workers, gpus)
  batch_bytes = spec.batch_size * image_size**2 * 3
  latency_s, record_bytes = opened
  wanted = cache_bytes(spec, meta, sampler, opened, chosen.workers)
  window_bytes = sampler.window_bytes(record_bytes)
  split = memory.fit(
    memory.budget(perf.memory_mb),
    workers=chosen.workers,
    read_ahead=int(perf.read_ahead_mb * 2**20),
    least_read_ahead=int(spec.batch_size * record_bytes),
    record_cache=wanted,
    blocks=2 * window_bytes,
    batches=memory.held_bytes(chosen.workers, batch_bytes, perf.prefetch),
    working=memory.working(chosen.threads, arena_bytes, spec.batch_size * record_bytes),
    worker_bytes=int(parallelism.worker_mb(perf.worker_jax) * memory.MB),
  )
  ahead_bytes = split.per_process("read_ahead")
  shared = sampler.shares_blocks(chosen.workers) and blockstore.available()
  block_records = sampler.block_pieces(chosen.workers, shared)
  per_s = perf.max_requests_per_s and perf.max_requests_per_s / max(1, chosen.workers)
  rate = parallelism.project(parallelism.available_cores(), parallelism.COSTS, chosen)
  rate_per_s = rate / max(1, chosen.workers)
  capped = per_s * (block_records or 1) if per_s and per_s < float("inf") else None
  reads = read_lib.ReadPlan(
    latency_s=latency_s,
    record_bytes=record_bytes,
    batch_size=spec.batch_size,
    rate_per_s=rate_per_s,
    ahead_bytes=ahead_bytes,
    max_depth=perf.read_ahead,
    depth=budget.depth_bounds(
      rate_per_s, capped, latency_s, record_bytes, spec.batch_size, ahead_bytes, perf.read_ahead
    ),
    cache_bytes=min(wanted, split.per_process("record_cache")),
    cache_wanted=wanted,
    cache_dir=os.fspath(perf.record_cache_dir) if perf.record_cache_dir else None,
    block_records=block_records,
    kept_bytes=ahead_bytes + 2 * window_bytes,
    # each worker publishes about 1/workers of the blocks: its share of two windows
    store_bytes=ahead_bytes + 2 * window_bytes // chosen.workers if shared else None,
    cuts=sampler.cuts,
    epoch_requests=sampler.epoch_requests(chosen.workers, shared),
    max_requests_per_s=per_s,
    deadline_s=perf.read_deadline_s,
  )
  shards = meta.splits[spec.split].shards
  gpus = tuple(gpus) if gpus is not None else None
  return HostPlan(sampler, chosen, split, reads, stream(spec, sampler, shards), gpus)


def order_of(spec: Spec, source) -> str:
  """`spec`'s order, by default "blocks" when the shards are remote, "global" otherwise."""
  return spec.order or ("blocks" if source.backends[0].remote else "global")


def sampler_of(spec: Spec, meta, source) -> Sampler:
  """`spec`'s order of the split's records in this process (`pipeline.order.sampling`): by
  default the block order (`pipeline.order.blocks`) when the shards are remote (a bucket or
  its mount), the global shuffle otherwise."""
  shard_index, shard_count = process_shard(spec.shard_index, spec.shard_count)
  split = meta.splits[spec.split]
  counts = tuple(s.num_records for s in split.shards)
  order = order_of(spec, source)
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


def workers(spec: Spec, image_size: int, window_batches: int | None = None) -> parallelism.Plan:
  """`spec`'s worker processes and threads on this host (`parallelism.plan`) within its
  budget: in the block order (`window_batches` a window's batches) without /dev/shm to share
  blocks, a number of workers that divides `window_batches` (each then reads its blocks
  whole); no workers when /dev/shm cannot hold their rings of batches (a SIGBUS later)."""
  perf, batch_size = spec.performance, spec.batch_size
  chosen = parallelism.plan(
    num_workers=perf.num_workers,
    num_threads=perf.num_threads,
    batch_size=batch_size,
    image_bytes=image_size**2 * 3,
    prefetch=perf.prefetch,
    memory_bytes=memory.budget(perf.memory_mb),
    costs=dataclasses.replace(parallelism.COSTS, worker_mb=parallelism.worker_mb(perf.worker_jax)),
    divide=window_batches if not shm.available() else None,
  )
  if chosen.workers and shm.available():
    batch_bytes = batch_size * image_size**2 * 3
    needed = shm.needed(chosen.workers, batch_bytes, perf.prefetch, parallelism.WORKER_BATCHES)
    short = shm.check(chosen.workers, needed)
    if short:
      chosen = parallelism.plan(num_workers=0, batch_size=batch_size, prefetch=perf.prefetch)
      chosen = dataclasses.replace(chosen, why=short)
  return chosen


def on_device(chosen: parallelism.Plan, num_workers: int | None, gpus: list[int]):
  """`chosen` with decoding in this process, which owns the devices: no worker processes;
  refuses `performance.num_workers` > 0 in one line."""
  if num_workers:
    raise ValueError(
      f"decoding.on='device' decodes in the process that owns the devices, so it runs no worker "
      f"processes: set performance.num_workers=0 or None, got {num_workers}"
    )
  threads = chosen.threads if chosen.workers == 0 else chosen.workers * chosen.threads
  threads = min(threads, parallelism.available_cores())
  return parallelism.Plan(0, max(1, threads), f"windows decoded by {nvdecode.describe(gpus)}")


def cache_bytes(spec: Spec, meta, sampler, opened: tuple[float, float], workers: int) -> int:
  """The record cache's RAM `spec` asks for (`performance.record_cache_mb`); by default the
  whole split when storage is slow (>= `cache.SLOW_READ_S` a read) and every process's copy
  fits `cache.CACHE_MEMORY_SHARE` of memory, `sampler`'s share when it reads one (owned
  shards, its share of the blocks)."""
  ram_mb = spec.performance.record_cache_mb
  if ram_mb is None:
    split = meta.splits[spec.split]
    split_bytes = sum(s.bytes or 0 for s in split.shards)
    if any(s.bytes is None for s in split.shards):  # sizes not recorded (a TFDS build): estimated
      split_bytes = int(opened[1] * split.num_records)
    split_bytes = int(split_bytes * sampler.kept_fraction)
    room = cache.CACHE_MEMORY_SHARE * parallelism.available_memory()
    fits = max(1, workers) * split_bytes <= room
    ram_mb = split_bytes * 1.05 / 2**20 if opened[0] >= cache.SLOW_READ_S and fits else 0.0
  return int(ram_mb * 2**20)


def stream(spec: Spec, sampler, shards: list) -> dict:
  """The stream a state indexes, which it is checked against when restored: the process's
  slice, seed, batch size, the split's records and `shards`, and what changes the order."""
  described = {
    "shard_index": sampler.shard_index,
    "shard_count": sampler.shard_count,
    "seed": spec.seed,
    "batch_size": spec.batch_size,
    "num_records": sampler.num_records,
    "shards": elastic.shard_list([(s.file, s.num_records, s.sha256) for s in shards]),
  }
  if spec.sharding != "records":
    described["sharding"] = spec.sharding
  if not spec.train:  # padded per epoch: the order depends on shard_count (pipeline.order.elastic)
    described["remainder"] = "pad"
  if sampler.blocks is not None:
    described["order"] = elastic.order_tag(sampler)
  return described


def read_stage(host: HostPlan, meta, split: str, source) -> read_lib.ReadRecords:
  """The read stage `host` plans over `source`, its record cache tied to `meta`'s shards of
  `split` as opened."""
  r = host.reads
  kept = None
  if r.cache_bytes or r.cache_dir:
    shards = meta.splits[split].shards
    kept = cache.record_cache(shards, meta.created_by, r.cache_bytes, r.cache_dir, source.pins)
  return read_lib.stage(source, r, host.memory, kept)


def announce(host: HostPlan) -> None:
  """Prints `host`'s plan line once per process (`parallelism.announce`)."""
  parallelism.announce(host.parallel, host.reads.describe(), host.memory.describe())
