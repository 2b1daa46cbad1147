"""Preprocessing ops: your own steps after the built-in fused head, per image or per batch.

The head (crop-aware decode, crop, resize, flip) stays fused and fast; ops run after it:

    image op  (image: np.ndarray, rng: np.random.Generator) -> np.ndarray     one HWC image
    batch op  (batch: dict[str, np.ndarray], rng) -> dict[str, np.ndarray]    one host batch

Each call gets a Generator that depends only on (seed, epoch, example index) or (seed, batch
index), so what an op draws does not depend on threads, worker processes or where a run
resumed. Ops travel to worker processes by pickle: module-level functions and classes (or
cloudpickle-able closures). Registered ops can also be named in a string, as big_vision's
pp strings: "color_jitter(0.4, 0.4, 0.4)|my_op" (see `build` and docs/API.md).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import cv2
import numpy as np

ImageOp = Callable[[np.ndarray, np.random.Generator], np.ndarray]
BatchOp = Callable[[dict, np.random.Generator], dict]
Kind = Literal["image", "batch"]

MASK_KEY = "mask"
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


def batch_rng(seed: int, batch_index: int) -> np.random.Generator:
  """The batch ops' generator for batch `batch_index` of a process's stream."""
  return _philox(_BATCH_STREAM, seed, (0, batch_index))


def _name(op) -> str:
  return getattr(op, "__name__", None) or type(op).__name__


def apply(image_ops: Sequence[ImageOp], image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Runs `image_ops` in order on one image. They may change its shape and dtype, but the
  loader stacks a batch's images, so every image must come out alike."""
  for op in image_ops:
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
  """Runs `batch_ops` in order on a host batch; each must keep the rows and the mask."""
  batch = dict(batch)
  rows = _rows(batch, "the batch")
  for op in batch_ops:
    result = op(batch, rng)
    if not isinstance(result, Mapping):
      raise OpError(f"batch op {_name(op)} returned {type(result).__name__}, not a dict")
    result = dict(result)
    if MASK_KEY in batch and MASK_KEY not in result:
      raise OpError(f"batch op {_name(op)} dropped the {MASK_KEY!r} entry; pass it through")
    if _rows(result, f"batch op {_name(op)}'s output") != rows:
      raise OpError(
        f"batch op {_name(op)} changed the batch from {rows} rows to "
        f"{_rows(result, '')}; ops must keep every row"
      )
    batch = result
  return batch


def _rows(batch: Mapping[str, np.ndarray], what: str) -> int:
  sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
  if len(set(sizes.values())) != 1 or None in sizes.values():
    raise OpError(f"entries of {what} disagree on the batch dimension: {sizes}")
  return next(iter(sizes.values()))


# Registry: names for ops, so configs can hold a string ("color_jitter(0.4)|mixup(0.2)").

_REGISTRY: dict[Kind, dict[str, Callable[..., Callable]]] = {"image": {}, "batch": {}}


def register(name: str, kind: Kind, *, replace: bool = False):
  """Decorator: `factory(*args, **kwargs)` builds the op that `build` names `name`.

  Registering the same definition again (a re-run notebook cell, `importlib.reload`) is a
  no-op that keeps the newest object; a different definition under a taken name is refused
  unless `replace=True`.
  """
  if kind not in _REGISTRY:
    raise ValueError(f"kind must be 'image' or 'batch', got {kind!r}")

  def add(factory):
    taken = _REGISTRY[kind].get(name)
    if taken is not None and not replace and _definition(taken) != _definition(factory):
      raise ValueError(
        f"a different {kind} op is already registered as {name!r} "
        f"({_where(taken)}); choose another name or pass register(..., replace=True)"
      )
    _REGISTRY[kind][name] = factory
    return factory

  return add


def _where(factory) -> str:
  return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', _name(factory))}"


def _definition(obj, depth: int = 0):
  """What makes two factories the same definition: module, name and code (for a class, the
  code of its methods), not object identity, so re-running the defining code matches."""
  if depth > 3:
    return None
  code = getattr(obj, "__code__", None)
  if code is not None:
    defaults = repr((getattr(obj, "__defaults__", None), getattr(obj, "__kwdefaults__", None)))
    return (_where(obj), _code(code), defaults)
  if isinstance(obj, type):
    members = sorted(
      (k, _definition(v, depth + 1))
      for k, v in vars(obj).items()
      if callable(v) or isinstance(v, (staticmethod, classmethod, property))
    )
    values = sorted(
      (k, repr(v))
      for k, v in vars(obj).items()
      if not k.startswith("__") and isinstance(v, (int, float, str, bytes, tuple, type(None)))
    )
    fields = sorted((k, str(v)) for k, v in getattr(obj, "__annotations__", {}).items())
    return (_where(obj), tuple(members), tuple(values), tuple(fields))
  inner = getattr(obj, "__func__", None) or getattr(obj, "fget", None)
  if inner is not None:
    return _definition(inner, depth + 1)
  return (_where(obj), id(obj))


def _code(code):
  consts = tuple(_code(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts)
  return (code.co_code, consts, code.co_names, code.co_varnames)


def build(spec: str | Sequence[str | Callable] | None, kind: Kind, **context) -> tuple:
  """The ops a spec names: a "|"-separated string of registered ops with literal arguments,
  an op callable, or a sequence of such strings and callables (kept as they are).

  `context` (e.g. num_classes, image_size) fills a factory's parameters of those names
  that the spec left out, as big_vision's `kwargs_extra`.
  """
  if kind not in _REGISTRY:
    raise ValueError(f"kind must be 'image' or 'batch', got {kind!r}")
  if spec is None:
    return ()
  if isinstance(spec, str):
    items = spec.split("|")
  else:
    items = [spec] if callable(spec) else list(spec)
  ops = []
  for item in items:
    if callable(item):
      ops.append(item)
    elif isinstance(item, str):
      if item.strip():
        ops.append(_lookup(item.strip(), kind, context))
    else:
      raise TypeError(
        f"{kind} ops are callables or registered names, got {type(item).__name__} {item!r}"
      )
  return tuple(ops)


def _lookup(text: str, kind: Kind, context: dict) -> Callable:
  name, args, kwargs = _parse_call(text)
  factory = _REGISTRY[kind].get(name)
  if factory is None:
    other = "batch" if kind == "image" else "image"
    hint = f" (it is a {other} op)" if name in _REGISTRY[other] else ""
    raise ValueError(
      f"unknown {kind} op {name!r} in {text!r}{hint}; registered: {sorted(_REGISTRY[kind])}"
    )
  params = inspect.signature(factory).parameters
  for key, value in context.items():
    if key in params and key not in kwargs:
      kwargs[key] = value
  try:
    return factory(*args, **kwargs)
  except TypeError as e:
    raise ValueError(f"{kind} op {text!r}: {e}") from None


def _parse_call(text: str) -> tuple[str, tuple, dict]:
  """ "name" or "name(1, b=2)" with literal arguments only (nothing is evaluated)."""
  try:
    expr = ast.parse(text, mode="eval").body
    if isinstance(expr, ast.Name):
      return expr.id, (), {}
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
      args = tuple(ast.literal_eval(a) for a in expr.args)
      kwargs = {k.arg: ast.literal_eval(k.value) for k in expr.keywords}
      if None not in kwargs:
        return expr.func.id, args, kwargs
  except (SyntaxError, ValueError):
    pass
  raise ValueError(f"cannot read op {text!r}: write name or name(literal, key=literal)")


# Ops that ship: colour jitter per image; mixup and onehot (below) per batch.


@register("color_jitter", "image")
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


@register("mixup", "batch")
@dataclasses.dataclass(frozen=True)
class Mixup:
  """mixup (Zhang et al. 2018) on a host batch: each row becomes lam * itself + (1 - lam) *
  a partner row, lam ~ Beta(alpha, alpha) once per batch, partners a random permutation.

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
      raise ValueError(f"mixup alpha must be > 0, got {self.alpha}")
    if self.num_classes is not None and self.num_classes < 1:
      raise ValueError(f"mixup num_classes must be >= 1, got {self.num_classes}")

  def __call__(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    key = _label_key("mixup", self.key, batch)
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
      raise OpError("mixup needs num_classes to make soft labels from class indices")
    if labels.size and not 0 <= labels.min() <= labels.max() < self.num_classes:
      raise OpError(
        f"mixup: labels outside [0, {self.num_classes}): {labels.min()}..{labels.max()}"
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


@register("onehot", "batch")
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
