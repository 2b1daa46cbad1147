"""`make_dataset`: ArrayRecord shards -> batches of uint8 images, as a Grain dataset.

The chain, in Grain terms:

    MapDataset of batch indices
      .map(BatchLoader)        sampler -> one batched read -> native parse + crop-window decode
                               + resize into the batch, a chunk per GIL release (pipeline.loader)
      .to_iter_dataset(...)    `prefetch` batches in flight on Grain's prefetch threads
      [.mp_prefetch(...)]      worker processes on many-core hosts (pipeline.parallelism)
      StreamIterDataset        validated, stream-tagged iterator state; skip count

Every buffer sits inside Grain's iterator, whose state is the next batch position, so
`get_state()`/`set_state()` resume exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grain
import numpy as np
from etils import epath

from pipeline import augment as augment_lib
from pipeline import lifecycle, options, parallelism, records
from pipeline import manifest as manifest_lib
from pipeline.loader import BadRecordError, BatchLoader
from pipeline.options import Augment, Performance
from pipeline.sampling import Sampler
from pipeline.source import ShardedSource
from pipeline.stream import StreamIterDataset

__all__ = ["BadRecordError", "make_dataset"]


def make_dataset(
  data_dir,
  split: str = "train",
  *,
  batch_size: int,
  train: bool = True,
  seed: int = 0,
  image_size: int = 224,
  num_epochs: int | None = None,
  shuffle: bool | None = None,
  drop_remainder: bool | None = None,
  shard_index: int | None = None,
  shard_count: int | None = None,
  augment: Augment | Mapping | None = None,
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
    data_dir: a converted dataset (holds manifest.json); local path or mounted bucket.
    split: the manifest split to read.
    batch_size: examples per batch *of this process*.
    train: random-resized-crop + flip, shuffled, repeated forever, drops the remainder;
      otherwise centre crop, in order, one epoch, padded with mask=False examples so every
      process yields the same number of batches and every record counts exactly once.
    seed: seeds the shuffle (a new order per epoch) and the augmentation.
    image_size: S, the side of the square output images.
    num_epochs: None repeats forever (train default); eval default is 1.
    shuffle: default `train`.
    drop_remainder: drop the last partial batch of a finite stream (default: train).
    shard_index, shard_count: this process's slice; default jax.process_index()/count().
    augment: the crop, flip and resize filter (`pipeline.Augment` or a dict of its fields).
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
    performance: threads, worker processes, prefetch, RAM cache, DCT scaling
      (`pipeline.Performance` or a dict of its fields); never changes what a batch holds.
      Threads and workers left None are chosen for this host (`pipeline.parallelism`; 2
      cores: no workers, a thread per core) and the choice is printed once.
  """
  if on_error not in ("raise", "skip"):
    raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  data_dir = epath.Path(data_dir)
  meta = manifest_lib.load(data_dir)
  paths = manifest_lib.checked_shards(data_dir, meta, split, verify=verify)
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
  )
  aug = options.coerce(Augment, augment)
  perf = options.coerce(Performance, performance)
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
    dct_scaling=perf.dct_scaling,
    fast_dct=perf.fast_dct,
  )
  source = ShardedSource(paths, counts)
  if features:
    from pipeline import features as features_lib

    features = features_lib.parse_specs(features, sample=source.read([0])[0])
  if ops or batch_ops:
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
  parallelism.announce(chosen)
  loader = BatchLoader(
    source,
    sampler,
    head,
    batch_size=batch_size,
    num_classes=meta.num_classes,
    keys=keys or meta.keys,
    seed=seed,
    num_threads=chosen.threads,
    on_error=on_error,
    cache_mb=perf.cache_mb,
    with_mask=not train,
    image_ops=ops,
    batch_ops=batch_ops,
    features=features or None,
  )
  drop = train if drop_remainder is None else drop_remainder
  num_batches = (
    len(sampler) // batch_size
    if drop or sampler.num_epochs is None
    else -(-len(sampler) // batch_size)
  )
  ds = grain.MapDataset.range(num_batches).map(loader)
  if normalize:
    ds = ds.map(_normalize_host)
  it = ds.to_iter_dataset(
    grain.ReadOptions(num_threads=perf.prefetch, prefetch_buffer_size=perf.prefetch)
  )
  if chosen.workers:
    _ensure_absl_flags_parsed()
    it = it.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=chosen.workers), worker_init_fn=_ignore_sigint
    )
  stream = {
    "shard_index": shard_index,
    "shard_count": shard_count,
    "seed": seed,
    "batch_size": batch_size,
    "num_records": sampler.num_records,
  }
  return lifecycle.ClosedAtExit(StreamIterDataset(it, stream))


def _normalize_host(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {**batch, "image": batch["image"].astype(np.float32) / 127.5 - 1.0}


def _process_shard(shard_index, shard_count) -> tuple[int, int]:
  if shard_index is None or shard_count is None:
    import jax

    return jax.process_index(), jax.process_count()
  return shard_index, shard_count


def _ignore_sigint(worker_index: int, worker_count: int) -> None:
  """Ctrl-C is the main process's to handle (the trainer saves a checkpoint); workers that
  also received it would die with tracebacks mid-save."""
  del worker_index, worker_count
  import signal

  signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ensure_absl_flags_parsed() -> None:
  """Grain workers read absl flags; unparsed flags crash them (grain #1355)."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
