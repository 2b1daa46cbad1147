"""Stage 3, decode/augment: a batch's records -> uint8 images and labels, on decode threads.

`DecodeImages` (an `AheadIterDataset` stage) cuts each batch into runs of at most MAX_TASK
records, one decode-thread task each (fewer tasks: less GIL-held hand-off per image), keeping
`prefetch` batches in flight. A task takes MAX_CHUNK records at a time, each chunk ONE call of
its `decoder` (`batch_decoder`), which without the GIL parses, draws the windows and flips
from (seed, epoch, index), decodes them into this thread's arena and resizes each bilinear one
into its batch slot, mirrored on the way (OpenCV's pixels, to the bit); OpenCV resizes the
others (area averaging, bicubic, resize_then_crop). A broken JPEG comes back with its message;
what else the decoder hands back (other formats, odd records; all without a decoder) takes the
per-image Python path.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import cv2
import numpy as np

from pipeline.catalog import records
from pipeline.host.pool import BatchPool
from pipeline.image import augment, decode
from pipeline.stages import errors
from pipeline.stages.ahead import Threads
from pipeline.stages.plan import Batch
from pipeline.storage.cache import DecodedCache
from pipeline.storage.source import CorruptRecordsError

MAX_CHUNK = 16  # images per native call: a thread's arena of windows stays ~15 MB at 224 px
MAX_TASK = 32  # images per decode-thread task (native calls in turn): fewer tasks, less GIL
_ARENAS = threading.local()  # each decode thread's windows, kept: no page faults per batch


def task_size(batch_size: int, threads: int) -> int:
  """Images per decode-thread task of a batch: two runs a thread, balanced, at most MAX_TASK."""
  return max(1, min(MAX_TASK, -(-batch_size // (2 * threads))))


def arena_bytes(head: augment.Head) -> int:
  """A decode thread's arena of windows at its largest: MAX_CHUNK of `head`'s slots."""
  return MAX_CHUNK * head.slot_bytes()


def batch_decoder(head: augment.Head, keys: records.Keys, seed: int):
  """The native decoder of a decode stage (`_jpeg.BatchDecoder`: `head`'s windows, `keys`'
  features, `seed`'s draws), or None where the extension was not built."""
  native = decode.native()
  if native is None:
    return None
  params, size, slot = head.native_params(), head.image_size, head.slot_bytes()
  return native.BatchDecoder(params, size, slot, seed, keys.image.encode(), keys.label.encode())


@dataclasses.dataclass(eq=False)
class DecodeImages:
  """Fills `batch.images` (made by `allocate`: a `BatchPool`'s (None), or a `shm.Writer`'s
  in shared memory), `batch.labels`, `batch.bad`. `decoder`: `batch_decoder`'s or a stand-in; None:
  the Python path alone. Picklable: pool and cache are made on first use in each process."""

  head: augment.Head
  _: dataclasses.KW_ONLY
  keys: records.Keys
  seed: int
  num_threads: int
  prefetch: int
  on_error: str
  cache_mb: float
  decoder: Callable | None
  allocate: Callable | None = None

  def __post_init__(self):
    self.allocate = self.allocate or BatchPool().empty
    self.threads = Threads(self.num_threads, "pipeline-decode")
    self.cache = DecodedCache(int(self.cache_mb * 2**20)) if self.cache_mb else None
    self.slot_bytes = self.head.slot_bytes()

  def depth(self) -> int:
    return self.prefetch

  def start(self, batch: Batch, step: int | None = None) -> tuple[Batch, list]:
    """Submits the batch's decode tasks of `step` images (default: `task_size` of it). With
    `batch.rows`, slot k fills row `rows[k]` of the `batch.images` given (a mixture's)."""
    n, size = len(batch.indices), self.head.image_size
    if batch.rows is None:
      batch.images = self.allocate((n, size, size, 3), np.uint8)
    batch.labels, batch.bad = np.zeros(n, np.int64), np.zeros(n, bool)
    step = step or task_size(n, self.num_threads)
    native = [r if isinstance(r, bytes) else None for r in batch.records]
    return batch, [
      self.threads.submit(self.load, batch, native, k, min(k + step, n)) for k in range(0, n, step)
    ]

  def finish(self, started: tuple[Batch, list]) -> Batch:
    for future in started[1]:
      future.result()
    return started[0]

  def load(self, batch: Batch, native_records: list, start: int, stop: int) -> None:
    """Slots [start, stop): the decoder, MAX_CHUNK at a time, then what it hands back (with a
    message: broken; None: the Python path). `native_records`: None where a slot has no bytes."""
    real = batch.real.tolist()
    todo = [(slot, None) for slot in range(start, stop)]
    if self.decoder is not None:
      todo = [(s, m) for s, m in todo if isinstance(batch.records[s], CorruptRecordsError)]
      dims = np.zeros((len(real), 2), np.int32)
      full = np.zeros((len(real), 2), np.int32) if self.head.resize_first else None
      for k in range(start, stop, MAX_CHUNK):
        todo += self._native(batch, native_records, k, min(k + MAX_CHUNK, stop), dims, full, real)
    for slot, message in todo:
      if isinstance(batch.records[slot], CorruptRecordsError):
        message = f"corrupt record ({batch.records[slot]})"
      if real[slot] and message is None:
        self._python_slot(batch, slot)
      elif real[slot]:
        self._fail(batch, slot, message)

  def _native(self, batch: Batch, records_: list, start: int, stop: int, dims, full, real: list):
    """One GIL-free call decodes the chunk's windows into this thread's arena; each is then
    resized into its slot. Returns the (slot, message) it handed back."""
    head, slot_bytes, images = self.head, self.slot_bytes, batch.images
    rows = range(len(real)) if batch.rows is None else batch.rows.tolist()
    arena = getattr(_ARENAS, "arena", None)
    if arena is None or len(arena) < (stop - start) * slot_bytes:
      arena = _ARENAS.arena = np.empty((stop - start) * slot_bytes, np.uint8)
    # bilinear windows are resized (and mirrored) into their rows by the decoder itself
    fused = images if full is None and not head.bicubic else None
    handed_back = self.decoder(
      records_,
      batch.epochs,
      batch.indices,
      batch.labels,
      dims,
      arena,
      start,
      stop,
      full,
      fused,
      batch.rows,
    )
    for slot, (h, w) in enumerate(dims[start:stop].tolist(), start):  # the rest: OpenCV
      if h and real[slot]:
        at = (slot - start) * slot_bytes
        window = arena[at : at + h * w * 3].reshape(h, w, 3)
        if full is None:
          interpolation = augment.interpolation(h, w, head.image_size, head.bicubic)
          out = images[rows[slot]]
          cv2.resize(window, (head.image_size,) * 2, dst=out, interpolation=interpolation)
        else:  # resize_then_crop: the whole (DCT-scaled) image, its full size from the header
          head.finish(window, tuple(full[slot]), images[rows[slot]])
    return handed_back

  def _python_slot(self, batch: Batch, slot: int) -> None:
    try:
      data, batch.labels[slot], _ = records.parse(batch.records[slot], self.keys)
      row = slot if batch.rows is None else int(batch.rows[slot])
      self.python_image(data, int(batch.epochs[slot]), int(batch.indices[slot]), batch.images[row])
    except (records.RecordError, decode.DecodeError) as e:
      self._fail(batch, slot, str(e))

  def _fail(self, batch: Batch, slot: int, why: str) -> None:
    error = errors.BadRecordError(f"{errors.where(batch, slot)}: {why}")
    errors.fail(batch, slot, error, self.on_error)

  def python_image(self, data: bytes, epoch: int, index: int, out: np.ndarray) -> np.ndarray:
    """One image on the Python path: decode, or the cache (`cache_mb`: other pixels)."""
    key = augment.example_key(self.seed, epoch, index)
    if self.cache is None:
      return self.head(data, key, out)
    shorter = round(self.head.image_size / self.head.crop_fraction)  # decoded once, kept
    image = self.cache.get(index, lambda: augment.resize_shorter(decode.decode(data), shorter))
    return self.head.from_decoded(image, key, out)
