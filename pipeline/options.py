"""The three groups of `make_dataset` settings that are not about *which* data: how each image
is cropped (`Augment`), how its JPEG becomes pixels, trading exactness for speed (`Decoding`:
these change pixels), and how fast the pipeline runs (`Performance`: never changes a batch).

All are frozen dataclasses; `make_dataset` also takes them as plain dicts (e.g. from a
`config.input` block), so a config names exactly these fields.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
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
  tries, else the whole image): more small crops for the same ranges. `min_object_covered`
  ("tf" only): a crop must cover at least this share of the image, as the Flax ImageNet
  example asks TF's sampler (0.1). Resized to `image_size` with `interpolation`.

  Eval, with crop_fraction f (or, with `crop_padding`, image_size / (image_size +
  crop_padding) and the Flax ImageNet example's box: side truncated, offset rounded up):
  `eval_order` "crop_then_resize" resizes the centre square of f x the shorter side to
  `image_size` (`interpolation`);
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
  min_object_covered: float = 0.0  # "tf" crop: the least share of the image a crop covers

  def eval_fraction(self, image_size: int) -> float:
    if self.crop_padding is None:
      return self.crop_fraction
    return image_size / (image_size + self.crop_padding)

  def __post_init__(self):
    check_types(self, "augment.")
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
    if not 0 <= self.min_object_covered <= 1:
      raise ValueError(
        f"augment.min_object_covered must be in [0, 1], got {self.min_object_covered}"
      )
    if self.min_object_covered and self.crop != "tf":
      raise ValueError(
        "augment.min_object_covered is TF's sampler's (sample_distorted_bounding_box): "
        "set crop='tf' with it"
      )
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
DECODE_ON = ("host", "device")


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
  on: where windows are decoded. "host": the C decoder on decode threads. "device": nvImageCodec
  on this process's GPUs (its CPU backend without one; the `gpu` extra), the same windows and
  flips, decoded at full resolution (no DCT scaling), resized on the host; no worker processes,
  cache_mb or fast_dct (`pipeline.stages.device_decode`). On the CPU backend each image is within
  0.05 levels on average of dct_scaling=False's (the C decoder's window edges, see there); DCT
  scaling's differences above apply; a GPU's IDCT adds its own (not measured yet).
  """

  cache_mb: float = 0.0
  dct_scaling: bool = True
  fast_dct: bool = False
  on: str = "host"

  def __post_init__(self):
    check_types(self, "decoding.")
    if self.on not in DECODE_ON:
      raise ValueError(f"decoding.on must be one of {DECODE_ON}, got {self.on!r}")
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
  within a bucket's budget (`pipeline.storage.budget`). read_deadline_s: how long storage may
  answer none of this process's reads in flight (or a stat or read at open) before one line
  naming the shard is raised (None: as gs:// reads, `pipeline.storage.remote`: 60 s), so that
  storage that stops answering (a stalled gcsfuse mount) is an error, never a hang (nor is the
  process's exit after it, `pipeline.storage.stalled`); time queued behind the request cap or
  other reads does not count. In the global order a shard's records of a batch are one read.
  stats_every_s: print `iterator.stats()`'s table (a row per stage and process over the last
  interval, in images/s, the slowest stage, storage requests) to stderr every so many seconds
  (None: never).
  memory_mb: the most the loader holds on this host, read-ahead, blocks kept for later rounds,
  record cache, batches and worker processes together (None: half the available memory;
  an eval stream opened `beside=` its train stream, `pipeline.input`, plans within what that
  one left of it); the record cache, then the read-ahead shrink to fit it
  (`pipeline.host.memory`).
  worker_jax: let worker processes import JAX, for ops that need it (they then start as
  Grain starts them: JAX and your main script imported again, ~140 MB more each). Off, they
  never load JAX (`pipeline.host.light`), and an op that imports it fails in one line saying so.
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
  worker_jax: bool = False

  def __post_init__(self):
    check_types(self, "performance.")
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
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return cls(**fields)
  raise TypeError(f"expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")


_KINDS = {  # what each annotation a field may have accepts
  "int": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
  "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
  "bool": lambda v: isinstance(v, numbers.Integral) and v in (0, 1),
  "str": lambda v: isinstance(v, (str, os.PathLike)),
  "None": lambda v: v is None,
}
_WORDS = {"int": "an int", "float": "a number", "bool": "True or False", "str": "a str"}
_WORDS["None"] = "None"
_PAIR = re.compile(r"tuple\[(\w+), (\w+)\]")


def _fits(value: Any, kind: str) -> bool:
  pair = _PAIR.fullmatch(kind)
  if pair:
    kinds = pair.groups()
    return (
      isinstance(value, (tuple, list))
      and len(value) == 2
      and all(_KINDS[k](v) for k, v in zip(kinds, value))
    )
  return _KINDS[kind](value)


def check_types(obj: Any, group: str, values: Mapping | None = None) -> None:
  """One ValueError naming the field (`group` + its name) whose value is not of the type its
  annotation names (a str where a number goes, say); fields of other annotations pass.
  `values`: the fields' values, where `obj` is the dataclass only (not yet built)."""
  for field in dataclasses.fields(obj):
    kinds = [k.strip() for k in str(field.type).split("|")]
    if not all(k in _KINDS or _PAIR.fullmatch(k) for k in kinds):
      continue
    value = values[field.name] if values is not None else getattr(obj, field.name)
    if not any(_fits(value, k) for k in kinds):
      wanted = " or ".join(_WORDS.get(k, "a pair of numbers") for k in kinds)
      raise ValueError(
        f"{group}{field.name} must be {wanted}, got {value!r} ({type(value).__name__})"
      )
