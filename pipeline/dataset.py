"""`make_dataset`: ArrayRecord shards -> batches of uint8 images, as a Grain dataset.

The chain, in Grain terms:

    MapDataset of batch positions (sampling.Sampler: shuffle per epoch, repeat, slice)
      .map(BatchLoader)        read the batch's records in one call, then parse, decode the
                               crop window, flip and resize each image on a thread pool,
                               straight into one preallocated array (a fused map + batch)
      .to_iter_dataset(...)    a few batches in flight on Grain's prefetch threads
      [.mp_prefetch(...)]      optional worker processes

Every buffer sits inside Grain's iterator, whose state is the next batch position, so
`get_state()`/`set_state()` resume exactly. Decoders release the GIL, so threads give
parallel decode with no pickling, no shared memory and instant start.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import Mapping

import grain
import numpy as np
from absl import logging
from etils import epath

from pipeline import augment, decode, lifecycle, options, records
from pipeline import manifest as manifest_lib
from pipeline.options import Augment, Performance
from pipeline.sampling import PAD, Sampler
from pipeline.source import CorruptRecordsError, ShardedSource


class BadRecordError(ValueError):
  """A record that cannot be used; the message names its shard file and index."""


@dataclasses.dataclass(frozen=True)
class Transform:
  """What happens to each image: the train (random) or eval (deterministic) recipe."""

  image_size: int = 224
  train: bool = True
  area_range: tuple[float, float] = (0.08, 1.0)
  aspect_range: tuple[float, float] = (3 / 4, 4 / 3)
  flip: bool = True
  crop_fraction: float = 0.875  # eval: centre crop of this share of the shorter side
  dct_scaling: bool = True
  fast_dct: bool = False  # libjpeg's fast integer IDCT (tf.data's default)

  def box(self, h: int, w: int, rng: np.random.Generator) -> augment.Box:
    if self.train:
      return augment.random_resized_crop_box(h, w, rng, self.area_range, self.aspect_range)
    return augment.center_crop_box(h, w, self.crop_fraction)

  def decode(self, data: bytes, box: augment.Box) -> np.ndarray:
    """Decodes only the crop window, DCT-scaled when it is that much larger than the target."""
    scale = augment.dct_scale(box, self.image_size) if self.dct_scaling else 1
    return decode.decode_crop(data, box, scale, self.fast_dct)

  def finish(self, crop: np.ndarray, rng: np.random.Generator,
             out: np.ndarray | None = None) -> np.ndarray:
    """Resizes a decoded crop to the target size (into `out`, e.g. its slot of the batch)
    and flips it at random (train)."""
    image = augment.resize(crop, self.image_size, out)
    if self.train and self.flip and rng.random() < 0.5:
      image = augment.flip_lr(image, out=image)
    return image

  def __call__(self, data: bytes, rng: np.random.Generator,
               out: np.ndarray | None = None) -> np.ndarray:
    box = self.box(*decode.image_size(data), rng)
    return self.finish(self.decode(data, box), rng, out)

  def from_cache(self, image: np.ndarray, rng: np.random.Generator,
                 out: np.ndarray | None = None) -> np.ndarray:
    """The cheap half applied to a cached decoded image (random crop and flip)."""
    y, x, ch, cw = self.box(*image.shape[:2], rng)
    return self.finish(image[y:y + ch, x:x + cw], rng, out)


class BatchLoader:
  """Loads one batch: batched read, then parse/decode/augment on a thread pool.

  Picklable (for worker processes): the thread pool and cache are made on first use.
  """

  def __init__(self, source: ShardedSource, sampler: Sampler, transform: Transform, *,
               batch_size: int, num_classes: int, keys: records.Keys, seed: int,
               num_threads: int, on_error: str, cache_mb: float, with_mask: bool):
    self.source, self.sampler, self.transform = source, sampler, transform
    self.batch_size, self.num_classes, self.keys, self.seed = batch_size, num_classes, keys, seed
    self.num_threads, self.on_error, self.with_mask = num_threads, on_error, with_mask
    self.cache_bytes = int(cache_mb * 2**20)
    self._init_runtime()

  def _init_runtime(self):
    self._pool = None
    self._lock = threading.Lock()
    self._cache: dict[int, np.ndarray] = {}
    self._cache_used = 0
    self.skipped = 0

  def __getstate__(self):
    state = self.__dict__.copy()
    for k in ("_pool", "_lock", "_cache", "_cache_used", "skipped"):
      state.pop(k)
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
    with self._lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.num_threads, thread_name_prefix="pipeline-decode")
      return self._pool

  def _image(self, index: int, data: bytes, rng: np.random.Generator, out: np.ndarray) -> None:
    if not self.cache_bytes:
      self.transform(data, rng, out)
      return
    cached = self._cache.get(index)
    if cached is None:
      size = round(self.transform.image_size / self.transform.crop_fraction)
      cached = augment.resize_shorter(decode.decode(data), size)
      with self._lock:
        if self._cache_used + cached.nbytes <= self.cache_bytes:
          self._cache[index] = cached
          self._cache_used += cached.nbytes
    self.transform.from_cache(cached, rng, out)

  def _read(self, indices: list[int]) -> dict[int, bytes | CorruptRecordsError]:
    """One batched read; after a corrupt chunk, one read per record names the bad ones."""
    try:
      return dict(zip(indices, self.source.read(indices)))
    except CorruptRecordsError:
      out = {}
      for i in indices:
        try:
          out[i] = self.source.read([i])[0]
        except CorruptRecordsError as e:
          out[i] = e
      return out

  def _load_one(self, index: int, epoch: int, record: bytes | CorruptRecordsError,
                out: np.ndarray) -> int:
    """Decodes record `index` into `out` (its slot of the batch); returns its label."""
    if isinstance(record, CorruptRecordsError):
      raise BadRecordError(f"{self.source.where(index)}: corrupt record ({record})")
    try:
      data, label, _ = records.parse(record, self.keys)
      if not 0 <= label < self.num_classes:
        raise BadRecordError(f"{self.source.where(index)}: label {label} outside "
                             f"[0, {self.num_classes}) of the manifest's classes")
      self._image(index, data, np.random.default_rng([self.seed, epoch, index]), out)
    except (records.RecordError, decode.DecodeError) as e:
      raise BadRecordError(f"{self.source.where(index)}: {e}") from None
    return label

  def __call__(self, batch: int) -> dict[str, np.ndarray]:
    first = batch * self.batch_size
    positions = range(first, min(first + self.batch_size, len(self.sampler)))
    indices = [self.sampler.record_index(p) for p in positions]
    epochs = [self.sampler.epoch(p) for p in positions]
    real = [i for i in indices if i != PAD]
    recs = self._read(real) if real else {}
    n, size = len(indices), self.transform.image_size
    images = np.zeros((n, size, size, 3), np.uint8)
    labels = np.zeros((n,), np.int32)
    mask = np.array([i != PAD for i in indices])

    def load(slots: range) -> None:
      for slot in slots:
        index = indices[slot]
        if index == PAD:
          continue
        try:
          labels[slot] = self._load_one(index, epochs[slot], recs[index], images[slot])
        except BadRecordError as e:
          if self.on_error == "raise":
            raise
          logging.warning("skipping %s", e)
          images[slot] = 0
          mask[slot] = False
          with self._lock:
            self.skipped += 1

    # A few contiguous runs of slots per thread: fewer futures and GIL hand-offs than one
    # task per image, still balanced across threads.
    step = max(1, -(-n // (4 * self.num_threads)))
    list(self._executor().map(load, [range(k, min(k + step, n)) for k in range(0, n, step)]))
    if not self.with_mask:
      _fill_skipped(images, labels, mask)
      return {"image": images, "label": labels}
    return {"image": images, "label": labels, "mask": mask}


def _fill_skipped(images: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> None:
  """Train batches keep their shape: a skipped slot repeats a good example of the batch."""
  bad = np.flatnonzero(~mask)
  good = np.flatnonzero(mask)
  if len(bad) and not len(good):
    raise BadRecordError("every record of a batch was bad; see the warnings above")
  for k, slot in enumerate(bad):
    images[slot], labels[slot] = images[good[k % len(good)]], labels[good[k % len(good)]]


def default_threads() -> int:
  """Decode threads: one per core (decoders release the GIL)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _process_shard(shard_index, shard_count) -> tuple[int, int]:
  if shard_index is None or shard_count is None:
    import jax  # pylint: disable=g-import-not-at-top

    return jax.process_index(), jax.process_count()
  return shard_index, shard_count


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
    keys: records.Keys | None = None,
    normalize: bool = False,
    on_error: str = "raise",
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
    keys: feature keys of the records (default: the manifest's).
    normalize: host-side float32 in [-1, 1] (default: uint8; normalize on device instead).
    on_error: "raise" (default) or "skip" a bad record; errors name the shard and record.
    performance: threads, worker processes, prefetch, RAM cache, DCT scaling
      (`pipeline.Performance` or a dict of its fields); never changes what a batch holds.
  """
  if on_error not in ("raise", "skip"):
    raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  data_dir = epath.Path(data_dir)
  meta = manifest_lib.load(data_dir)
  paths = meta.shard_paths(data_dir, split)
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
  transform = Transform(image_size=image_size, train=train, area_range=aug.area_range,
                        aspect_range=aug.aspect_range, crop_fraction=aug.eval_fraction(image_size),
                        flip=aug.flip, dct_scaling=perf.dct_scaling, fast_dct=perf.fast_dct)
  loader = BatchLoader(
      ShardedSource(paths, counts), sampler, transform, batch_size=batch_size,
      num_classes=meta.num_classes, keys=keys or meta.keys, seed=seed,
      num_threads=perf.num_threads or default_threads(), on_error=on_error,
      cache_mb=perf.cache_mb,
      with_mask=not train)
  drop = train if drop_remainder is None else drop_remainder
  num_batches = (len(sampler) // batch_size if drop or sampler.num_epochs is None
                 else -(-len(sampler) // batch_size))
  ds = grain.MapDataset.range(num_batches).map(loader)
  if normalize:
    ds = ds.map(_normalize_host)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=perf.prefetch,
                                            prefetch_buffer_size=perf.prefetch))
  if perf.num_workers:
    _ensure_absl_flags_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=perf.num_workers))
  stream = {"shard_index": shard_index, "shard_count": shard_count, "seed": seed,
            "batch_size": batch_size, "num_records": sampler.num_records}
  return lifecycle.ClosedAtExit(_StreamCheck(it, stream))


class _StreamCheck(grain.IterDataset):
  """Tags iterator states with the stream they index, and refuses a state of another stream.

  A state is a batch position in one process's stream: restored with another shard_count,
  shard_index, seed or batch size it would silently read other records.
  """

  def __init__(self, parent: grain.IterDataset, stream: dict):
    super().__init__(parent)
    self._stream = stream

  def __iter__(self) -> grain.DatasetIterator:
    return _StreamCheckIterator(self._parent.__iter__(), self._stream)


class _StreamCheckIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, stream: dict):
    super().__init__(parent)
    self._stream = stream

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict:
    return {**self._parent.get_state(), "stream": self._stream}

  def set_state(self, state: dict) -> None:
    saved = state.get("stream", self._stream)  # states saved before this check still load
    if saved != self._stream:
      diff = ", ".join(f"{k} {saved.get(k)} in the state, {v} here"
                       for k, v in self._stream.items() if saved.get(k) != v)
      raise ValueError(f"iterator state of another stream ({diff}): resume with the same "
                       "shard_index/shard_count, seed and batch_size")
    self._parent.set_state({k: v for k, v in state.items() if k != "stream"})


def _normalize_host(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {**batch, "image": batch["image"].astype(np.float32) / 127.5 - 1.0}


def _ensure_absl_flags_parsed() -> None:
  """Grain workers read absl flags; unparsed flags crash them (grain #1355)."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
