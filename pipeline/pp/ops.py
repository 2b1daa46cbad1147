"""Preprocessing ops: your own steps after the built-in fused head, per image or per batch.

The head (crop-aware decode, crop, resize, flip) stays fused and fast; ops run after it:

    image op  (image: np.ndarray, rng: np.random.Generator) -> np.ndarray     one HWC image
              (image, rng, example) -> np.ndarray    the same, also seeing its example
    batch op  (batch: dict[str, np.ndarray], rng) -> dict[str, np.ndarray]    one host batch

An image op whose signature takes a third parameter (or one named `example`; detected once,
when the ops are built) also gets a read-only mapping {"label": int, feature: value, ...}
of its record's label and the features `make_dataset(features=...)` asked for.

A batch op returns the batch it wants: it may add, replace or drop entries (big_vision's
`keep`), but it must keep every row, and the "mask" entry, when the batch has one (eval
streams, padded), must survive: it is the pipeline's record of which rows are padding,
not the record's data, so `keep(...)` keeps it without being asked (big_vision adds its
`_mask` after the pp ops for the same reason). Train batches have no mask.

Each call gets a Generator that depends only on (seed, epoch, example index) or (seed, batch
index), so what an op draws does not depend on threads, worker processes or where a run
resumed. It is the op's for the call: the ops stage re-keys one Generator per thread for the
next example, so an op must not keep it for later. Ops travel to worker processes by
pickle: module-level functions and classes (or cloudpickle-able closures). Ops registered
in `pipeline.pp.registry` (the shipped ones below and `randaug`, and yours) are named in pp
strings, `pipeline.pp`'s language: "color_jitter(0.4, 0.4, 0.4)|my_op" (docs/API.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence

import cv2
import numpy as np

from pipeline.pp import registry

ImageOp = Callable[[np.ndarray, np.random.Generator], np.ndarray]
BatchOp = Callable[[dict, np.random.Generator], dict]

MASK_KEY = "mask"
_MASK = "it marks the padding rows of eval batches: write your result under another name"
# Philox key tags: image ops and batch ops draw from streams no other part of the pipeline
# uses (the built-in head has its own generator), whatever the seed.
_EXAMPLE_STREAM, _BATCH_STREAM = 0x696D616765, 0x6261746368


class OpError(ValueError):
  """An op broke the op contract (wrong return type, shape, rows, lost mask); names the op."""


def _philox(stream: int, seed: int, counter: tuple[int, int]) -> np.random.Generator:
  seed = operator.index(seed)
  if not 0 <= seed < 2**64:
    raise ValueError(f"seed must be in [0, 2**64), got {seed}")
  hi, lo = (operator.index(c) for c in counter)
  if hi < 0 or lo < 0:
    raise ValueError(f"epoch and indices must be >= 0, got {counter}")
  # Philox increments the first counter word per draw; the last two name the stream.
  return np.random.Generator(np.random.Philox(key=(stream << 64) | seed, counter=[0, 0, hi, lo]))


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
  """The image ops' generator for record `index` in `epoch`: a pure function of the three."""
  return _philox(_EXAMPLE_STREAM, seed, (epoch, index))


_local = threading.local()


def reused_example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
  """`example_rng(seed, epoch, index)`'s exact stream from this thread's one Generator,
  re-keyed (~1 µs instead of ~8 µs for a new one). Valid until this thread's next call: for
  the pipeline's own loop, where an op runs to completion before the next example."""
  seed = operator.index(seed)
  if not 0 <= seed < 2**64 or epoch < 0 or index < 0:
    return example_rng(seed, epoch, index)  # the checks' errors
  held = getattr(_local, "rng", None)
  if held is None:
    bits = np.random.Philox(key=0)
    held = _local.rng = (np.random.Generator(bits), bits, bits.state)
  generator, bits, state = held
  key = (_EXAMPLE_STREAM << 64) | seed
  state["state"]["key"] = np.array([key & (2**64 - 1), key >> 64], np.uint64)
  state["state"]["counter"] = np.array([0, 0, epoch, index], np.uint64)
  state["buffer_pos"], state["has_uint32"], state["uinteger"] = 4, 0, 0
  bits.state = state
  return generator


def batch_rng(seed: int, batch_index: int) -> np.random.Generator:
  """The batch ops' generator for batch `batch_index` of a process's stream."""
  return _philox(_BATCH_STREAM, seed, (0, batch_index))


def _name(op) -> str:
  return getattr(op, "__name__", None) or type(op).__name__


def takes_example(op) -> bool:
  """Whether an image op asks for its example: a third positional parameter, or one named
  `example` (checked once, when the ops are built)."""
  try:
    params = list(inspect.signature(op).parameters.values())
  except (TypeError, ValueError):  # builtins and the like: the plain contract
    return False
  if any(p.name == "example" for p in params):
    return True
  positional = [
    p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
  ]
  return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def example_view(label: int, features: Mapping | None = None) -> Mapping:
  """The read-only mapping an example-taking image op gets."""
  return types.MappingProxyType({"label": int(label), **(features or {})})


def apply(
  image_ops: Sequence[ImageOp],
  image: np.ndarray,
  rng: np.random.Generator,
  example: Mapping | None = None,
  wants: Sequence[bool] | None = None,
) -> np.ndarray:
  """Runs `image_ops` in order on one image. They may change its shape and dtype, but the
  loader puts a batch's images in one array, so every image must come out alike. `wants`
  (from `takes_example`, per op; default: asked here) says which ops get `example`."""
  wants = [takes_example(op) for op in image_ops] if wants is None else wants
  for op, want in zip(image_ops, wants):
    if want:
      result = op(image, rng, example if example is not None else example_view(-1))
    else:
      result = op(image, rng)
    if not isinstance(result, np.ndarray):
      raise OpError(
        f"image op {_name(op)} returned {type(result).__name__}, not a numpy "
        "array (an op returns the new image)"
      )
    image = result
  return image


def apply_batch(
  batch_ops: Sequence[BatchOp], batch: Mapping[str, np.ndarray], rng: np.random.Generator
) -> dict[str, np.ndarray]:
  """Runs `batch_ops` in order on a host batch; each must keep the rows and, when the batch
  has one, the mask as it is (ops see it read-only). Any other entry may be dropped or added."""
  batch = dict(batch)
  rows = _rows(batch, "the batch")
  mask = batch.get(MASK_KEY)
  if mask is not None:
    batch[MASK_KEY] = seen = mask.view()
    seen.flags.writeable = False  # an op writing into it fails there, naming the op
  for op in batch_ops:
    try:
      result = op(batch, rng)
    except ValueError as e:
      if mask is not None and "read-only" in str(e):
        raise OpError(f"batch op {_name(op)} wrote into the {MASK_KEY!r} entry; {_MASK}") from e
      raise
    if not isinstance(result, Mapping):
      raise OpError(f"batch op {_name(op)} returned {type(result).__name__}, not a dict")
    result = dict(result)
    if mask is not None and MASK_KEY not in result:
      raise OpError(
        f"batch op {_name(op)} dropped the {MASK_KEY!r} entry; pass it through (it marks "
        "the padding rows of eval batches; any other entry may be dropped)"
      )
    if _rows(result, f"batch op {_name(op)}'s output") != rows:
      raise OpError(
        f"batch op {_name(op)} changed the batch from {rows} rows to "
        f"{_rows(result, '')}; ops must keep every row"
      )
    if mask is not None and result[MASK_KEY] is not seen:
      raise OpError(f"batch op {_name(op)} replaced the {MASK_KEY!r} entry; {_MASK}")
    batch = result
  if mask is not None:
    batch[MASK_KEY] = mask
  return batch


def _rows(batch: Mapping[str, np.ndarray], what: str) -> int:
  sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
  if len(set(sizes.values())) != 1 or None in sizes.values():
    raise OpError(f"entries of {what} disagree on the batch dimension: {sizes}")
  return next(iter(sizes.values()))


# Ops that ship: colour jitter per image; mixups and onehot (below) per batch.


@registry.register("color_jitter", "image")
@dataclasses.dataclass(frozen=True)
class ColorJitter:
  """torchvision's ColorJitter on uint8 RGB images with OpenCV lookup tables.

  brightness, contrast, saturation: factors drawn uniformly from [max(0, 1 - x), 1 + x];
  hue: a shift drawn from [-hue, hue] of the colour circle (hue <= 0.5). Applied in a random
  order; 0 turns one off. uint8 HxWx3 in, uint8 out of the same shape.
  """

  brightness: float = 0.4
  contrast: float = 0.4
  saturation: float = 0.4
  hue: float = 0.0

  def __post_init__(self):
    for name in ("brightness", "contrast", "saturation", "hue"):
      if getattr(self, name) < 0:
        raise ValueError(f"color_jitter {name} must be >= 0, got {getattr(self, name)}")
    if self.hue > 0.5:
      raise ValueError(f"color_jitter hue must be <= 0.5, got {self.hue}")

  def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
      raise OpError(
        f"color_jitter needs uint8 HxWx3 RGB images, got {image.dtype}{list(image.shape)}"
      )
    # Every draw happens whatever is switched off, so one setting never shifts another's.
    factors = [
      rng.uniform(max(0.0, 1 - x), 1 + x) for x in (self.brightness, self.contrast, self.saturation)
    ]
    shift = rng.uniform(-self.hue, self.hue)
    steps = [
      (_brightness, factors[0], self.brightness),
      (_contrast, factors[1], self.contrast),
      (_saturation, factors[2], self.saturation),
      (_hue, shift, self.hue),
    ]
    for k in rng.permutation(len(steps)):
      step, value, enabled = steps[k]
      if enabled:
        image = step(image, value)
    return image


_LEVELS = np.arange(256, dtype=np.float32)


def _table(values: np.ndarray) -> np.ndarray:
  return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def _gray(image: np.ndarray) -> np.ndarray:
  return cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2GRAY)


def _brightness(image: np.ndarray, f: float) -> np.ndarray:
  return cv2.LUT(image, _table(_LEVELS * f))


def _contrast(image: np.ndarray, f: float) -> np.ndarray:
  mean = float(_gray(image).mean())
  return cv2.LUT(image, _table(_LEVELS * f + (1 - f) * mean))


def _saturation(image: np.ndarray, f: float) -> np.ndarray:
  gray = cv2.cvtColor(_gray(image), cv2.COLOR_GRAY2RGB)
  return cv2.addWeighted(np.ascontiguousarray(image), f, gray, 1 - f, 0)


def _hue(image: np.ndarray, shift: float) -> np.ndarray:
  hsv = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2HSV)  # uint8 hue in [0, 180)
  table = ((np.arange(256) + round(shift * 180)) % 180).astype(np.uint8)
  hsv[..., 0] = table[hsv[..., 0]]
  return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)


@registry.register("permuted_mixup", "batch")
@dataclasses.dataclass(frozen=True)
class PermutedMixup:
  """`permuted_mixup(alpha, num_classes, key)`: mixup (Zhang et al. 2018) on a host batch:
  each row becomes lam * itself + (1 - lam) * a partner row, lam ~ Beta(alpha, alpha) once per
  batch, partners a random permutation (big_vision's is `mixup`, `BigVisionMixup`).

  Output keys: "image" keeps its dtype (uint8 rounds, as timm's fast-collate mixup, so the
  host still moves uint8); the labels (`key`, default "label") become soft,
  float32[B, num_classes] summing to 1 (int labels are one-hot first; soft ones mix as they
  are). With a "mask" (eval, padding), only real rows mix, with each other; padding rows
  stay as they were. A batch without `key` is refused, and so is one where another entry
  holds the soft labels (e.g. `onehot(key_result="labels")` ran first) unless `key` names
  the entry to mix: mixing images but not the labels the model reads would be silent.
  """

  alpha: float = 0.2
  num_classes: int | None = None
  key: str | None = None

  def __post_init__(self):
    if self.alpha <= 0:
      raise ValueError(f"permuted_mixup alpha must be > 0, got {self.alpha}")
    if self.num_classes is not None and self.num_classes < 1:
      raise ValueError(f"permuted_mixup num_classes must be >= 1, got {self.num_classes}")

  def __call__(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    key = _label_key("permuted_mixup", self.key, batch)
    labels = self._soft(np.asarray(batch[key]))
    rows = len(labels)
    real = np.flatnonzero(batch[MASK_KEY]) if MASK_KEY in batch else np.arange(rows)
    lam = np.float32(rng.beta(self.alpha, self.alpha))
    partner = np.arange(rows)
    partner[real] = real[rng.permutation(len(real))]
    image = np.asarray(batch["image"])
    if image.dtype == np.uint8:  # OpenCV: rounded and saturated, ~2x numpy's speed
      flat = np.ascontiguousarray(image).reshape(rows, -1)
      mixed = cv2.addWeighted(flat, float(lam), flat[partner], float(1 - lam), 0)
      mixed = mixed.reshape(image.shape)
    else:
      mixed = (lam * image + (1 - lam) * image[partner]).astype(image.dtype)
    return {**batch, "image": mixed, key: lam * labels + (1 - lam) * labels[partner]}

  def _soft(self, labels: np.ndarray) -> np.ndarray:
    if labels.ndim == 2:
      return labels.astype(np.float32)
    if self.num_classes is None:
      raise OpError("permuted_mixup needs num_classes to make soft labels from class indices")
    if labels.size and not 0 <= labels.min() <= labels.max() < self.num_classes:
      raise OpError(
        f"permuted_mixup: labels outside [0, {self.num_classes}): {labels.min()}..{labels.max()}"
      )
    return np.eye(self.num_classes, dtype=np.float32)[labels]


def _label_key(op: str, key: str | None, batch: Mapping[str, np.ndarray]) -> str:
  """The batch entry a label-mixing op works on: `key`, or "label" when that is the only
  entry holding labels; anything ambiguous or missing is refused, naming the keys."""
  if key is not None:
    if key not in batch:
      raise OpError(f"{op}: the batch has no {key!r} entry (it has {sorted(batch)})")
    return key
  soft = [
    k
    for k, v in batch.items()
    if k not in ("label", "image", MASK_KEY) and _looks_like_soft_labels(np.asarray(v))
  ]
  if soft:
    raise OpError(
      f"{op}: the batch holds soft labels in {soft[0]!r} but {op} mixes 'label'; "
      f"pass {op}(..., key={soft[0]!r}) (big_vision: the onehot op's key_result)"
    )
  if "label" not in batch:
    raise OpError(
      f"{op}: the batch has no 'label' entry (it has {sorted(batch)}); pass key= the labels' key"
    )
  return "label"


def _looks_like_soft_labels(v: np.ndarray) -> bool:
  if v.ndim != 2 or v.dtype.kind != "f" or v.shape[1] < 2 or not v.size:
    return False
  return bool((v >= 0).all() and np.allclose(v.sum(axis=1), 1, atol=1e-3))


@registry.register("onehot", "batch")
@dataclasses.dataclass(frozen=True)
class OneHot:
  """big_vision's onehot on a host batch: int labels in `key` -> float32[B, depth] in
  `key_result` (default: `key` itself), `on` for the class and `off` elsewhere.
  Labels outside [0, depth) are refused, never an all-`off` row."""

  depth: int
  key: str = "label"
  key_result: str | None = None
  on: float = 1.0
  off: float = 0.0

  def __post_init__(self):
    if not isinstance(self.depth, int) or self.depth < 1:
      raise ValueError(f"onehot depth must be a positive int, got {self.depth!r}")

  def __call__(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    if self.key not in batch:
      raise OpError(f"onehot: the batch has no {self.key!r} entry (it has {sorted(batch)})")
    labels = np.asarray(batch[self.key])
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
      raise OpError(
        f"onehot: {self.key!r} must hold int class indices, got {labels.dtype}{list(labels.shape)}"
      )
    if labels.size and not 0 <= labels.min() <= labels.max() < self.depth:
      raise OpError(f"onehot: labels outside [0, {self.depth}): {labels.min()}..{labels.max()}")
    out = np.full((len(labels), self.depth), self.off, np.float32)
    out[np.arange(len(labels)), labels] = self.on
    return {**batch, self.key_result or self.key: out}


# big_vision's ops that are not part of the head (pipeline.pp compiles the head ones).


@registry.register("value_range", "batch")
@dataclasses.dataclass(frozen=True)
class ValueRange:
  """big_vision's value_range on a host batch: `key` ("image") from [in_min, in_max] to float32
  in [vmin, vmax] (clipped with clip_values), into `key_result` (default: `key`).

  Host-side float32 images are 4x the bytes of uint8 through the rest of the pipeline and to
  the device; normalizing on the device (`pipeline.input(normalize="minus_one_one")`) gives
  the same values faster. This op is here so big_vision's pp strings run as written.
  Its output arrays are reused once nothing references them any more (a new 77 MB array per
  batch costs as much in page faults as the arithmetic); one you hold is never overwritten.
  """

  vmin: float = -1.0
  vmax: float = 1.0
  in_min: float | tuple = 0.0
  in_max: float | tuple = 255.0
  clip_values: bool = False
  key: str = "image"
  key_result: str | None = None

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "_pool"}

  def __setstate__(self, state):
    self.__dict__.update(state)

  def __call__(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    if self.key not in batch:
      raise OpError(f"value_range: the batch has no {self.key!r} entry (it has {sorted(batch)})")
    x = np.asarray(batch[self.key])
    in_min = np.asarray(self.in_min, np.float32)
    scale = np.float32(self.vmax - self.vmin) / (np.asarray(self.in_max, np.float32) - in_min)
    offset = np.float32(self.vmin) - in_min * scale
    out = _reusable(self, x.shape, np.float32)
    _in_parts(
      _scale_into, x, out, scale, offset, self.vmin if self.clip_values else None, self.vmax
    )
    return {**batch, self.key_result or self.key: out}


_POOL_LOCK = threading.Lock()
POOL_SIZE = 4  # float32 batches an op keeps for reuse (~77 MB each at 128 x 224 px)


def _reusable(owner, shape: tuple, dtype) -> np.ndarray:
  """An uninitialized array for `owner`'s output: one of its earlier outputs that nothing
  references any more (its only reference is this pool's), else a new one. A new array of a
  batch of float32 images costs ~20k page faults and zeroing, about as much as filling it."""
  with _POOL_LOCK:
    pool = owner.__dict__.setdefault("_pool", [])
    for k in range(len(pool)):
      # References: the pool's list, getrefcount's argument: nobody else holds it.
      if pool[k].shape == shape and pool[k].dtype == dtype and sys.getrefcount(pool[k]) == 2:
        return pool[k]
    out = np.empty(shape, dtype)
    pool.append(out)
    del pool[:-POOL_SIZE]
    return out


def _scale_into(x, out, scale, offset, vmin, vmax) -> None:
  np.multiply(x, scale, out=out, casting="unsafe")
  out += offset
  if vmin is not None:
    np.clip(out, vmin, vmax, out=out)


def _in_parts(fn, x: np.ndarray, out: np.ndarray, *args, parts: int = 2) -> None:
  """`fn(x, out, *args)` over `parts` slices of the rows on threads (numpy drops the GIL and
  the new array's page faults spread over cores)."""
  rows = len(x) if x.ndim else 0
  if rows < 2 * parts:
    fn(x, out, *args)
    return
  cuts = np.linspace(0, rows, parts + 1).astype(int)
  threads = [
    threading.Thread(target=fn, args=(x[a:b], out[a:b], *args)) for a, b in zip(cuts, cuts[1:])
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()


@registry.register("keep", "batch")
class Keep:
  """big_vision's keep("image", "labels"): only the named entries stay, and the "mask" when
  the batch has one (it is the pipeline's, marking eval padding; see the module docstring).
  A named entry the batch lacks is an error, not a silent drop."""

  def __init__(self, *keys: str):
    if not keys or not all(isinstance(k, str) for k in keys):
      raise ValueError(f"keep takes the names of the entries to keep, got {keys!r}")
    self.keys = keys

  def __eq__(self, other):
    return isinstance(other, Keep) and other.keys == self.keys

  def __hash__(self):
    return hash(self.keys)

  def __repr__(self):
    return f"Keep{self.keys!r}"

  def __call__(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    missing = [k for k in self.keys if k not in batch]
    if missing:
      raise OpError(f"keep: the batch has no {missing} entries (it has {sorted(batch)})")
    return {k: v for k, v in batch.items() if k in self.keys or k == MASK_KEY}


@registry.register("mixup", "batch", train_only=True)
@dataclasses.dataclass(frozen=True)
class BigVisionMixup:
  """big_vision's mixup (`big_vision.utils.get_mixup`): a ~ Beta(p, p) once per batch,
  a = max(a, 1 - a), and every entry in `keys` becomes a * x + (1 - a) * roll(x, 1, axis=0),
  as float32 (images and soft labels alike). p = 0 leaves the batch as it is.

  big_vision mixes in its train step, on the device, after the pp ops; here it runs on the
  host batch, so the host moves float32 images. `fold_in` (the config's) is accepted and
  unused: the draw comes from the batch's generator, a pure function of (seed, batch index).
  Named `mixup(p=..., fold_in=None)` in a pp string. Eval batches (with a mask) are refused:
  big_vision mixes training batches only.
  """

  p: float = 0.2
  fold_in: int | None = None
  n: int = 2
  keys: tuple[str, ...] = ("image", "labels")

  def __post_init__(self):
    if self.p < 0:
      raise ValueError(f"mixup p must be >= 0, got {self.p}")
    if self.n != 2:
      raise ValueError(f"mixup n: only 2 (pairs, big_vision's default) is supported, got {self.n}")
    object.__setattr__(
      self, "keys", (self.keys,) if isinstance(self.keys, str) else tuple(self.keys)
    )

  def lam(self, rng: np.random.Generator) -> np.float32:
    a = rng.beta(self.p, self.p)
    return np.float32(max(a, 1.0 - a))

  def __call__(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    if MASK_KEY in batch:
      raise OpError("mixup mixes training batches; this one has a mask (eval): drop mixup there")
    missing = [k for k in self.keys if k not in batch]
    if missing:
      raise OpError(
        f"mixup: the batch has no {missing} entries (it has {sorted(batch)}); big_vision's "
        "mixup mixes one-hot labels: run onehot(..., key_result='labels') first or pass keys= "
        "(permuted_mixup(alpha) mixes int labels, this library's mixup before issue 27)"
      )
    for k in self.keys:
      v = np.asarray(batch[k])
      if k != "image" and (v.ndim != 2 or v.dtype.kind != "f"):
        raise OpError(
          f"mixup: {k!r} holds {v.dtype}{list(v.shape)}, not soft labels: run onehot first"
        )
    if self.p == 0:
      return batch
    a = self.lam(rng)
    out = dict(batch)
    for k in self.keys:
      x = np.asarray(batch[k], np.float32)
      out[k] = a * x + (1 - a) * np.roll(x, 1, axis=0)
    return out


_MOVED = {
  "Mixup": "pipeline.pp.ops.PermutedMixup, named 'permuted_mixup' ('mixup' is big_vision's)",
  "register": "pipeline.pp.registry.register",
  "build": "pipeline.pp.build",
}


def __getattr__(name: str):
  """Names issue 27 moved: one line saying the new spelling."""
  if name in _MOVED:
    raise AttributeError(f"pipeline.pp.ops.{name} is now {_MOVED[name]}")
  raise AttributeError(f"module 'pipeline.pp.ops' has no attribute {name!r}")
