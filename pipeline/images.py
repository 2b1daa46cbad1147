"""Stage 3, decode/augment: a batch's records -> uint8 images and labels, on decode threads.

`DecodeImages` (an `AheadIterDataset` stage) cuts each batch into runs of at most MAX_TASK
records, one decode-thread task each (fewer tasks: less GIL-held hand-off per image), and
keeps `prefetch` batches in flight, so the threads never idle between batches. A task
decodes MAX_CHUNK records at a time, each chunk ONE call into `_jpeg.decode_batch`, which
holds no GIL while it parses every Example, draws every crop window and flip from (seed,
epoch, index) and decodes the windows (mirrored) into this thread's arena; each window is then
resized by OpenCV straight into its slot of the batch (eval resize_then_crop: the whole image
is resized by its shorter side, and its centre copied into the slot). What the native path
hands back (other formats, odd records, read errors; everything when the extension is missing
or a decoded-image cache is on) takes the per-image Python path, which draws the same windows.
So the Python per image is a view and one OpenCV call.
"""

from __future__ import annotations

import threading

import cv2
import numpy as np

from pipeline import augment, decode, errors, records
from pipeline.ahead import Threads
from pipeline.cache import Once
from pipeline.plan import Batch
from pipeline.source import CorruptRecordsError

MAX_CHUNK = 16  # images per native call: a thread's arena of windows stays ~15 MB at 224 px
MAX_TASK = 32  # images per decode-thread task (native calls in turn): fewer tasks, less GIL


class DecodeImages:
  """The decode stage: fills `batch.images`, `batch.labels`, `batch.bad`. Picklable (worker
  processes): the thread pool, arenas and cache are made on first use in each process."""

  emulate_ns = 0  # pixel work replaced by GIL-free waits: set only by bench/ (emulation)
  images_in = None  # a `handoff.Writer` with worker processes: images go to shared memory

  def __init__(
    self,
    head: augment.Head,
    *,
    keys: records.Keys,
    seed: int,
    num_threads: int,
    prefetch: int,
    on_error: str,
    cache_mb: float,
  ):
    self.head, self.keys, self.seed, self.on_error = head, keys, seed, on_error
    self.num_threads, self.prefetch = num_threads, prefetch
    self.threads = Threads(num_threads, "pipeline-decode")
    self.cache_bytes = int(cache_mb * 2**20)
    self.slot_bytes = head.slot_bytes()
    self.native_params = head.native_params()
    self.key_bytes = (keys.image.encode(), keys.label.encode())
    self._init_runtime()

  def _init_runtime(self):
    self._lock = threading.Lock()
    self._cache: dict[int, np.ndarray] = {}
    self._decoding = Once()
    self._cache_used = 0
    self._local = threading.local()

  def __getstate__(self):
    runtime = ("_lock", "_cache", "_decoding", "_cache_used", "_local")
    return {k: v for k, v in self.__dict__.items() if k not in runtime}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def depth(self) -> int:
    return self.prefetch

  def arena(self, slots: int) -> np.ndarray:
    """This thread's buffer for `slots` decoded windows (kept: no page faults per batch)."""
    arena = getattr(self._local, "arena", None)
    if arena is None or len(arena) < slots * self.slot_bytes:
      arena = self._local.arena = np.empty(slots * self.slot_bytes, np.uint8)
    return arena

  def start(self, batch: Batch) -> tuple[Batch, list]:
    n, size = len(batch.indices), self.head.image_size
    empty = self.images_in.empty if self.images_in is not None else np.empty
    batch.images = empty((n, size, size, 3), np.uint8)
    batch.labels = np.zeros(n, np.int64)
    batch.bad = np.zeros(n, bool)
    # A few contiguous runs per thread, balanced, at most MAX_TASK images each.
    step = max(1, min(MAX_TASK, -(-n // (2 * self.num_threads))))
    native = [r if isinstance(r, bytes) else None for r in batch.records]
    return batch, [
      self.threads.submit(self.load, batch, native, k, min(k + step, n)) for k in range(0, n, step)
    ]

  def finish(self, started: tuple[Batch, list]) -> Batch:
    batch, futures = started
    for future in futures:
      future.result()
    return batch

  def load(self, batch: Batch, native_records: list, start: int, stop: int) -> None:
    """Slots [start, stop): the native path, MAX_CHUNK at a time, then the Python path for
    what it hands back. `native_records`: the batch's records, None where a slot has no bytes."""
    todo = range(start, stop)
    native = decode.native()
    real = batch.real.tolist()
    if native is not None and not self.cache_bytes:
      n = len(real)
      dims = np.zeros((n, 2), np.int32)
      full = np.zeros((n, 2), np.int32) if self.head.resize_first else None
      todo = [s for s in todo if isinstance(batch.records[s], CorruptRecordsError)]
      for k in range(start, stop, MAX_CHUNK):
        end = min(k + MAX_CHUNK, stop)
        todo += self._native(native, batch, native_records, k, end, dims, full, real)
    for slot in todo:
      if real[slot]:
        self._python_slot(batch, slot)

  def _native(
    self, native, batch: Batch, records_: list, start: int, stop: int, dims, full, real: list
  ) -> list[int]:
    """One GIL-free call decodes the chunk's windows into this thread's arena; each is then
    resized into its slot. Returns the slots it handed back, for the Python path."""
    head, slot_bytes = self.head, self.slot_bytes
    arena = self.arena(stop - start)
    handed_back = native.decode_batch(
      records_,
      batch.epochs,
      batch.indices,
      batch.labels,
      dims,
      arena,
      slot_bytes,
      start,
      stop,
      self.seed,
      self.key_bytes[0],
      self.key_bytes[1],
      head.image_size,
      self.native_params,
      self.emulate_ns,
      full,
    )
    todo = [slot for slot, _, _ in handed_back]
    skip = set(todo)
    images = batch.images
    for k, (h, w) in enumerate(dims[start:stop].tolist()):  # per image: a view, one resize
      slot = start + k
      if real[slot] and slot not in skip and not isinstance(batch.records[slot], Exception):
        window = arena[k * slot_bytes : k * slot_bytes + h * w * 3].reshape(h, w, 3)
        if full is None:
          self.resize(window, images[slot])
        else:  # resize_then_crop: the whole (DCT-scaled) image, its full size from the header
          head.finish(window, tuple(full[slot]), images[slot])
    return todo

  def resize(self, window: np.ndarray, out: np.ndarray) -> None:
    """The decoded window, resized into its slot of the batch."""
    h, w, size = window.shape[0], window.shape[1], self.head.image_size
    interpolation = augment.interpolation(h, w, size, self.head.bicubic)
    cv2.resize(window, (size, size), dst=out, interpolation=interpolation)

  def _python_slot(self, batch: Batch, slot: int) -> None:
    record = batch.records[slot]
    try:
      if isinstance(record, CorruptRecordsError):
        raise errors.BadRecordError(f"{errors.where(batch, slot)}: corrupt record ({record})")
      data, batch.labels[slot], _ = records.parse(record, self.keys)
      self.python_image(data, int(batch.epochs[slot]), int(batch.indices[slot]), batch.images[slot])
    except (records.RecordError, decode.DecodeError) as e:
      error = errors.BadRecordError(f"{errors.where(batch, slot)}: {e}")
      errors.fail(batch, slot, error, self.on_error)
    except errors.BadRecordError as e:
      errors.fail(batch, slot, e, self.on_error)

  def python_image(self, data: bytes, epoch: int, index: int, out: np.ndarray) -> None:
    """One image on the Python path (same windows as the native path): cache, or decode."""
    key = augment.example_key(self.seed, epoch, index)
    if self.cache_bytes:
      self.head.from_decoded(self._cached(index, data), key, out)
    else:
      self.head(data, key, out)

  def _cached(self, index: int, data: bytes) -> np.ndarray:
    """The decoded image, its shorter side resized to image_size / crop_fraction; decoded
    once even when two batches in flight hold the record."""
    image = self._cache.get(index)
    if image is not None:
      return image
    other = self._decoding.claim(index)
    if other is not None:
      other.wait()
      image = self._cache.get(index)
      return image if image is not None else self._decode_shorter(data)  # it did not fit
    try:
      image = self._decode_shorter(data)
      with self._lock:
        if index not in self._cache and self._cache_used + image.nbytes <= self.cache_bytes:
          self._cache[index] = image
          self._cache_used += image.nbytes
    finally:
      self._decoding.release(index)
    return image

  def _decode_shorter(self, data: bytes) -> np.ndarray:
    return augment.resize_shorter(
      decode.decode(data), round(self.head.image_size / self.head.crop_fraction)
    )
