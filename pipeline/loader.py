"""Loads one batch: the native decode path on a few threads, a chunk of the batch each.

`BatchLoader(batch_index)` is the one map of the Grain chain (a fused read + map + batch):

1. the sampler gives the batch's (epoch, record index) pairs, vectorized;
2. the batch is cut into a few chunks, one per thread task, so reads run in parallel too;
   each chunk reads its records (one batched ArrayRecord read per shard), then makes ONE
   call into `_jpeg.decode_batch`, which holds no GIL while it parses every Example, draws
   every crop window and flip from (seed, epoch, index) and decodes the windows (mirrored)
   into this thread's arena; each window is then resized by OpenCV straight into its slot of
   the batch array (which a Grain worker process copies into shared memory to send);
3. what the native path hands back (other formats, odd records, errors; everything when the
   extension is missing or a RAM cache is on) takes the per-image Python path, which draws
   the same windows;
4. labels are range-checked at once, then custom per-image ops, extra features and batch ops.

So the Python per image is a view and one OpenCV call; what is left per batch is fixed.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Sequence

import cv2
import numpy as np
from absl import logging

from pipeline import augment, decode, records
from pipeline.sampling import PAD, Sampler
from pipeline.source import CorruptRecordsError, ShardedSource

# Benchmarks only: "D[,R]" replaces each image's decode and resize by GIL-free waits of D + R
# microseconds, taken once per chunk inside the native call (as its pixel work would be);
# everything else stays real, the per-image resize call included (on a 1x1 window): one
# process's ceiling on a host with many more cores.
EMULATE_ENV = "PIPELINE_EMULATE_DECODE_US"
MAX_CHUNK = 8
SKIPPED_KEY = "_skipped"  # per-batch skip count; `pipeline.dataset` sums and removes it
PYTHON_PATH = 1


class BadRecordError(ValueError):
  """A record that cannot be used; the message names its shard file and index."""


class BatchLoader:
  """Loads batch `i` of a process's stream. Picklable (worker processes): the thread pool
  and the cache are made on first use in each process."""

  def __init__(
    self,
    source: ShardedSource,
    sampler: Sampler,
    head: augment.Head,
    *,
    batch_size: int,
    num_classes: int,
    keys: records.Keys,
    seed: int,
    num_threads: int,
    on_error: str,
    cache_mb: float,
    with_mask: bool,
    image_ops: Sequence = (),
    batch_ops: Sequence = (),
    features: dict | None = None,
  ):
    self.source, self.sampler, self.head = source, sampler, head
    self.batch_size, self.num_classes, self.keys, self.seed = batch_size, num_classes, keys, seed
    self.num_threads, self.on_error, self.with_mask = num_threads, on_error, with_mask
    self.image_ops, self.batch_ops, self.features = tuple(image_ops), tuple(batch_ops), features
    self.cache_bytes = int(cache_mb * 2**20)
    self.slot_bytes = head.slot_bytes()
    self.key_bytes = (keys.image.encode(), keys.label.encode())
    self._init_runtime()

  def _init_runtime(self):
    self._pool = None
    self._lock = threading.Lock()
    self._cache: dict[int, np.ndarray] = {}
    self._cache_used = 0
    self._local = threading.local()
    self.emulate_ns = _emulation()

  def __getstate__(self):
    return {
      k: v
      for k, v in self.__dict__.items()
      if k not in ("_pool", "_lock", "_cache", "_cache_used", "_local", "emulate_ns")
    }

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def arena(self, slots: int) -> np.ndarray:
    """This thread's buffer for `slots` decoded windows (kept: no page faults per batch)."""
    arena = getattr(self._local, "arena", None)
    if arena is None or len(arena) < slots * self.slot_bytes:
      arena = self._local.arena = np.empty(slots * self.slot_bytes, np.uint8)
    return arena

  def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
    with self._lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
          self.num_threads, thread_name_prefix="pipeline-decode"
        )
      return self._pool

  def __call__(self, batch_index: int) -> dict[str, np.ndarray]:
    first = batch_index * self.batch_size
    positions = np.arange(first, min(first + self.batch_size, len(self.sampler)))
    epochs, indices = self.sampler.records(positions)
    b = _Batch(self, epochs, indices)
    n = len(indices)
    # A few contiguous chunks per thread, one GIL release each, balanced, and at most
    # MAX_CHUNK images so a thread's arena of decoded windows stays small (~7 MB at 224 px).
    step = max(1, min(MAX_CHUNK, -(-n // (2 * self.num_threads))))
    chunks = [(k, min(k + step, n)) for k in range(0, n, step)]
    if len(chunks) == 1:
      b.load(*chunks[0])
    else:
      list(self._executor().map(lambda c: b.load(*c), chunks))
    return b.finish(batch_index)

  def python_image(self, data: bytes, epoch: int, index: int, out: np.ndarray) -> None:
    """One image on the Python path (same windows as the native path): cache, or decode."""
    key = augment.example_key(self.seed, epoch, index)
    if self.cache_bytes:
      self.head.from_decoded(self._cached(index, data), key, out)
    else:
      self.head(data, key, out)

  def _cached(self, index: int, data: bytes) -> np.ndarray:
    """The decoded image, its shorter side resized to image_size / crop_fraction."""
    image = self._cache.get(index)
    if image is None:
      size = round(self.head.image_size / self.head.crop_fraction)
      image = augment.resize_shorter(decode.decode(data), size)
      with self._lock:
        if self._cache_used + image.nbytes <= self.cache_bytes:
          self._cache[index] = image
          self._cache_used += image.nbytes
    return image


class _Batch:
  """The arrays of one batch being loaded, and the slots that failed."""

  def __init__(self, loader: BatchLoader, epochs: np.ndarray, indices: np.ndarray):
    self.loader, self.epochs, self.indices = loader, epochs, indices
    n, size = len(indices), loader.head.image_size
    shape = (n, size, size, 3)
    self.images = np.empty(shape, np.uint8)
    self.labels = np.zeros(n, np.int64)
    self.dims = np.zeros((n, 2), np.int32)
    self.real = indices != PAD
    self.bad = np.zeros(n, bool)
    self.records: list = [None] * n  # each chunk reads its own: reads run in parallel too
    self.native_records: list = [None] * n
    self.features = None
    if loader.features:
      from pipeline import features as features_lib

      self.features = features_lib.allocate(loader.features, n)
    self.op_images: list[np.ndarray | None] = [None] * n

  def where(self, slot: int) -> str:
    return self.loader.source.where(int(self.indices[slot]))

  def fail(self, slot: int, error: BadRecordError) -> None:
    if self.loader.on_error == "raise":
      raise error
    logging.warning("skipping %s", error)
    self.bad[slot] = True

  def load(self, start: int, stop: int) -> None:
    """Slots [start, stop): the native path, then the Python path for what it hands back."""
    loader = self.loader
    got = _read(loader.source, self.indices[start:stop])
    self.records[start:stop] = got
    self.native_records[start:stop] = [r if isinstance(r, bytes) else None for r in got]
    todo = range(start, stop)
    native = decode.native()
    if native is not None and not loader.cache_bytes:
      todo = self._native(native, start, stop)
    for slot in todo:
      if self.real[slot]:
        self._python_slot(slot)
    if loader.image_ops or self.features is not None:
      for slot in range(start, stop):
        if self.real[slot] and not self.bad[slot]:
          self._extras(slot)

  def _native(self, native, start: int, stop: int) -> list[int]:
    """One GIL-free call decodes the chunk's windows into this thread's arena; each is then
    resized into its slot. Returns the slots for the Python path."""
    loader, head = self.loader, self.loader.head
    arena = loader.arena(stop - start)
    handed_back = native.decode_batch(
      self.native_records,
      self.epochs,
      self.indices,
      self.labels,
      self.dims,
      arena,
      loader.slot_bytes,
      start,
      stop,
      loader.seed,
      loader.key_bytes[0],
      loader.key_bytes[1],
      head.image_size,
      head.native_params(),
      loader.emulate_ns,
    )
    todo = [slot for slot, _, _ in handed_back] + [
      s for s in range(start, stop) if isinstance(self.records[s], CorruptRecordsError)
    ]
    skip = set(todo)
    real, dims = self.real[start:stop].tolist(), self.dims[start:stop].tolist()
    size, bicubic, slot_bytes = head.image_size, head.bicubic, loader.slot_bytes
    emulated = np.empty((1, 1, 3), np.uint8) if loader.emulate_ns else None
    for k, (h, w) in enumerate(dims):  # the per-image Python: a view and one OpenCV call
      if real[k] and start + k not in skip:
        window = arena[k * slot_bytes : k * slot_bytes + h * w * 3].reshape(h, w, 3)
        if emulated is not None:  # the call without its pixel work (waited for above)
          cv2.resize(window, (1, 1), dst=emulated)
          continue
        cv2.resize(
          window,
          (size, size),
          dst=self.images[start + k],
          interpolation=augment.interpolation(h, w, size, bicubic),
        )
    return todo

  def _python_slot(self, slot: int) -> None:
    record = self.records[slot]
    try:
      if isinstance(record, CorruptRecordsError):
        raise BadRecordError(f"{self.where(slot)}: corrupt record ({record})")
      data, self.labels[slot], _ = records.parse(record, self.loader.keys)
      self.loader.python_image(
        data, int(self.epochs[slot]), int(self.indices[slot]), self.images[slot]
      )
    except (records.RecordError, decode.DecodeError) as e:
      self.fail(slot, BadRecordError(f"{self.where(slot)}: {e}"))
    except BadRecordError as e:
      self.fail(slot, e)

  def _extras(self, slot: int) -> None:
    """Custom per-image ops and extra features of a loaded slot."""
    loader = self.loader
    try:
      if self.features is not None:
        from pipeline import features as features_lib

        features_lib.fill(loader.features, self.records[slot], self.features, slot)
      if loader.image_ops:
        from pipeline import ops

        rng = ops.example_rng(loader.seed, int(self.epochs[slot]), int(self.indices[slot]))
        self.op_images[slot] = ops.apply(loader.image_ops, self.images[slot], rng)
    except records.RecordError as e:
      self.fail(slot, BadRecordError(f"{self.where(slot)}: {e}"))
    except Exception as e:  # a user's op failed: say on which record
      from pipeline import ops

      raise ops.OpError(f"{self.where(slot)}: {type(e).__name__}: {e}") from e

  def finish(self, batch_index: int) -> dict[str, np.ndarray]:
    loader = self.loader
    ok = self.real & ~self.bad
    out_of_range = ok & ((self.labels < 0) | (self.labels >= loader.num_classes))
    for slot in np.flatnonzero(out_of_range):
      self.fail(
        slot,
        BadRecordError(
          f"{self.where(slot)}: label {self.labels[slot]} outside [0, {loader.num_classes}) "
          "of the manifest's classes"
        ),
      )
    ok = self.real & ~self.bad
    images = self.images
    if loader.image_ops:
      images = _stack(self.op_images, ok)
    images[~ok] = 0
    batch = {"image": images, "label": self.labels.astype(np.int32)}
    if self.features is not None:
      batch.update(self.features)
    if loader.with_mask:
      batch["mask"] = ok
    else:
      _fill_skipped(batch, ok)
    if loader.batch_ops:
      from pipeline import ops

      batch = ops.apply_batch(loader.batch_ops, batch, ops.batch_rng(loader.seed, batch_index))
    batch[SKIPPED_KEY] = np.int64((self.real & self.bad).sum())
    return batch


def _emulation() -> int:
  """Nanoseconds of pixel work per image from EMULATE_ENV ("D[,R]": D + R); 0 when unset."""
  value = os.environ.get(EMULATE_ENV, "")
  return int(sum(float(v) for v in value.split(",") if v.strip()) * 1000)


def _read(source: ShardedSource, indices: np.ndarray) -> list:
  """Each slot's record (bytes), None for padding, or the CorruptRecordsError of its read:
  one batched read; after a corrupt chunk, one read per record names the bad ones."""
  out: list = [None] * len(indices)
  slots = np.flatnonzero(indices != PAD).tolist()
  wanted = indices[slots].tolist()
  try:
    got = source.read(wanted)
  except CorruptRecordsError:
    got = []
    for i in wanted:
      try:
        got.append(source.read([i])[0])
      except CorruptRecordsError as e:
        got.append(e)
  for slot, rec in zip(slots, got):
    out[slot] = rec
  return out


def _stack(images: list[np.ndarray | None], ok: np.ndarray) -> np.ndarray:
  """The per-image ops' outputs as one array (failed and padding slots zero)."""
  done = [im for im, good in zip(images, ok) if good]
  if not done:
    raise BadRecordError("every record of a batch was bad; see the warnings above")
  first = done[0]
  out = np.zeros((len(images), *first.shape), first.dtype)
  for slot, (im, good) in enumerate(zip(images, ok)):
    if good:
      if im.shape != first.shape or im.dtype != first.dtype:
        raise ValueError(
          f"per-image ops gave {im.dtype}{list(im.shape)} and "
          f"{first.dtype}{list(first.shape)} in one batch: they must agree"
        )
      out[slot] = im
  return out


def _fill_skipped(batch: dict[str, np.ndarray], ok: np.ndarray) -> None:
  """Train batches keep their shape: a skipped slot repeats a good example of the batch."""
  bad, good = np.flatnonzero(~ok), np.flatnonzero(ok)
  if len(bad) and not len(good):
    raise BadRecordError("every record of a batch was bad; see the warnings above")
  for k, slot in enumerate(bad):
    for v in batch.values():
      v[slot] = v[good[k % len(good)]]
