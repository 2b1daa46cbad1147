"""The three groups of `make_dataset` settings that are not about *which* data: how each image
is cropped (`Augment`), how its JPEG becomes pixels, trading exactness for speed (`Decoding`:
these change pixels), and how fast the pipeline runs (`Performance`: never changes a batch).

All are frozen dataclasses; `make_dataset` also takes them as plain dicts (e.g. from a
`config.input` block), so a config names exactly these fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from pipeline.storage import budget


@dataclasses.dataclass(frozen=True)
class Augment:
  """The built-in image head: crop window, flip, resize filter.

  Train: an Inception random crop (area share in `area_range`, aspect w/h in
  `aspect_range`) and a random left-right flip. `crop` picks whose: "torchvision" is
  torchvision's RandomResizedCrop (area uniform, aspect log-uniform, 10 tries, else the
  largest centred crop); "tf" is TF's `sample_distorted_bounding_box` as big_vision's
  `inception_crop` calls it (aspect uniform, height uniform between the area bounds, 100
  tries, else the whole image): more small crops for the same ranges. Resized to
  `image_size` with `interpolation`.

  Eval, with crop_fraction f (or, with `crop_padding`, image_size / (image_size +
  crop_padding), as Flax's ImageNet example): `eval_order` "crop_then_resize" resizes the
  centre square of f x the shorter side to `image_size` (`interpolation`);
  "resize_then_crop" is big_vision's `resize_small(image_size / f)|central_crop(image_size)`:
  the shorter side resized (area filter), then the centre image_size square.
  """

  area_range: tuple[float, float] = (0.08, 1.0)
  aspect_range: tuple[float, float] = (3 / 4, 4 / 3)
  flip: bool = True
  crop_fraction: float = 0.875
  crop_padding: int | None = None  # Flax's eval crop: image_size / (image_size + crop_padding)
  interpolation: str = "bilinear"
  crop: str = "torchvision"  # or "tf": see above
  eval_order: str = "crop_then_resize"  # or "resize_then_crop"

  def eval_fraction(self, image_size: int) -> float:
    if self.crop_padding is None:
      return self.crop_fraction
    return image_size / (image_size + self.crop_padding)

  def __post_init__(self):
    lo, hi = self.area_range
    if not 0 < lo <= hi <= 1:
      raise ValueError(
        f"augment.area_range must satisfy 0 < low <= high <= 1, got {self.area_range}"
      )
    lo, hi = self.aspect_range
    if not 0 < lo <= hi:
      raise ValueError(
        f"augment.aspect_range must satisfy 0 < low <= high, got {self.aspect_range}"
      )
    if not 0 < self.crop_fraction <= 1:
      raise ValueError(f"augment.crop_fraction must be in (0, 1], got {self.crop_fraction}")
    if self.crop_padding is not None and self.crop_padding < 0:
      raise ValueError(f"augment.crop_padding must be >= 0, got {self.crop_padding}")
    for name, allowed in (
      ("interpolation", INTERPOLATIONS),
      ("crop", CROPS),
      ("eval_order", EVAL_ORDERS),
    ):
      if getattr(self, name) not in allowed:
        raise ValueError(f"augment.{name} must be one of {allowed}, got {getattr(self, name)!r}")


INTERPOLATIONS = ("bilinear", "bicubic")
CROPS = ("torchvision", "tf")
EVAL_ORDERS = ("crop_then_resize", "resize_then_crop")
# Fields that moved to another group (issue 38): the old spelling is refused in one line that
# gives the new one.
MOVED = {"Performance": {name: "decoding" for name in ("cache_mb", "dct_scaling", "fast_dct")}}


@dataclasses.dataclass(frozen=True)
class Decoding:
  """How each JPEG becomes pixels: speed bought with pixel values. Each option changes the
  pixels of a batch, never its records, order, labels or masks (tests/test_options_content.py
  checks both, within the bounds below).

  Mean absolute difference per pixel value, on the test photos (~470x390) at 64 and 224 px:
  cache_mb: RAM for decoded images ("map, cache, map"), kept with their shorter side resized
  to image_size / crop_fraction; windows are drawn and cut on that smaller image, so crops
  move and change size a little and the pixels differ (5-10 grey levels; images no larger
  than that size are unchanged). dct_scaling (default on): decode at 1/2, 1/4, 1/8 when the
  window's shorter side is that many times image_size; off, such windows are decoded whole
  and shrunk by the resize instead (7-9 levels at 64 px; none at 224, where no window was that
  large). fast_dct: libjpeg's fast integer IDCT (tf.data's default; 0.4-1 level, 2.2 on the
  32 px digits; none on DCT-scaled windows).
  """

  cache_mb: float = 0.0
  dct_scaling: bool = True
  fast_dct: bool = False

  def __post_init__(self):
    if self.cache_mb < 0:
      raise ValueError(f"decoding.cache_mb must be >= 0, got {self.cache_mb}")


@dataclasses.dataclass(frozen=True)
class Performance:
  """How the work is spread and how much is kept; never changes what a batch holds: every
  option leaves every batch bitwise equal (tests/test_options_content.py). Pixel-changing
  choices are `Decoding`'s.

  num_threads / num_workers: decode threads per process and Grain worker processes
  (None: chosen for this host, see `pipeline.host.parallelism`). prefetch: batches being decoded
  at once per process. read_ahead: batches whose records are read ahead (None: as many as
  the read latency measured at open and as it runs needs, by Little's law; see
  `pipeline.stages.read`), holding at most read_ahead_mb of records. record_cache_mb: RAM for stored
  record bytes, so storage is read once (None: the whole split when one read takes
  >= 2 ms and the split fits in a quarter of the available memory, else 0);
  record_cache_dir: a local-disk folder for them too, shared by the host's processes and kept
  across runs. max_requests_per_s: the most storage requests a second this process's reads
  make, shared by its worker processes (None or inf: no cap; at least one a minute), to stay
  within a bucket's budget (`pipeline.storage.budget`). read_deadline_s: how long a batch (or a
  stat or read at open) waits for its reads before one line naming the shard is raised (None:
  as gs:// reads, `pipeline.storage.remote`: 60 s), so that storage that stops answering (a stalled
  gcsfuse mount) is an error, never a hang (nor is the process's exit after it,
  `pipeline.storage.stalled`). stats_every_s: print `iterator.stats()`'s table (a row
  per stage and process, storage requests) to stderr every so many seconds (None: never).
  memory_mb: the most the loader holds on this host, read-ahead, blocks kept for later rounds,
  record cache, batches and worker processes together (None: half the available memory;
  `python -m train`'s eval stream then plans within what its train stream left of it); the
  record cache, then the read-ahead shrink to fit it (`pipeline.host.memory`).
  """

  num_threads: int | None = None
  num_workers: int | None = None
  prefetch: int = 2
  read_ahead: int | None = None
  read_ahead_mb: float = 256.0
  record_cache_mb: float | None = None
  record_cache_dir: str | None = None
  max_requests_per_s: float | None = None
  stats_every_s: float | None = None
  read_deadline_s: float | None = None
  memory_mb: float | None = None

  def __new__(cls, *args, **fields):
    _refuse_moved(cls, fields)
    return super().__new__(cls)

  def __post_init__(self):
    for name in ("num_threads", "num_workers"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < (name == "num_threads")):
        raise ValueError(
          f"performance.{name} must be None or an integer >= "
          f"{int(name == 'num_threads')}, got {value!r}"
        )
    if self.prefetch < 1:
      raise ValueError(f"performance.prefetch must be >= 1, got {self.prefetch}")
    if self.read_ahead is not None and (
      not isinstance(self.read_ahead, int) or self.read_ahead < 1
    ):
      raise ValueError(f"performance.read_ahead must be None or >= 1, got {self.read_ahead!r}")
    if self.read_ahead_mb <= 0:
      raise ValueError(f"performance.read_ahead_mb must be > 0, got {self.read_ahead_mb}")
    if self.record_cache_mb is not None and self.record_cache_mb < 0:
      raise ValueError(
        f"performance.record_cache_mb must be None or >= 0, got {self.record_cache_mb}"
      )
    budget.check_rate(self.max_requests_per_s)
    _positive("memory_mb", self.memory_mb, "half the available memory")
    _positive("read_deadline_s", self.read_deadline_s, "60 s")
    _positive("stats_every_s", self.stats_every_s, "never")


def _positive(name: str, value, none: str) -> None:
  """Refuses `performance.<name>` unless None (which gives `none`) or a finite number > 0, in
  one line: no limit is not a setting (a deadline of inf would hang on a stalled mount)."""
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if value is not None and not (number and 0 < value < math.inf):
    raise ValueError(
      f"performance.{name} must be None ({none}) or a finite number > 0, got {value!r}"
    )


def coerce(cls, value: Any):
  """`value` as a `cls`: None gives the defaults, a dict (or ConfigDict) its fields."""
  if value is None:
    return cls()
  if isinstance(value, cls):
    return value
  if isinstance(value, Mapping) or hasattr(value, "to_dict"):
    fields = dict(value.to_dict() if hasattr(value, "to_dict") else value)
    _refuse_moved(cls, fields)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return cls(**fields)
  raise TypeError(f"expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")


def _refuse_moved(cls, fields: Mapping) -> None:
  """A field of `cls` that moved to another group (`MOVED`): one line naming its new place."""
  moved = MOVED.get(cls.__name__, {})
  for name in (n for n in fields if n in moved):
    old, new = cls.__name__.lower(), moved[name]
    raise ValueError(
      f"{old}.{name} is now {new}.{name} (it changes pixels; {old} never does): pass "
      f"{new}={{{name!r}: ...}} or pipeline.{new.title()}({name}=...)"
    )
