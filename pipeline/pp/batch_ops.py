"""The shipped batch ops (`pipeline.pp.contract` has their contract): the mixups
(`permuted_mixup`, big_vision's `mixup`) and big_vision's `onehot`, `value_range`, `keep`."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Mapping

import cv2
import numpy as np

from pipeline.pp import registry
from pipeline.pp.contract import MASK_KEY, OpError


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
    labels = self._soft(np.asarray(batch[key]), batch.get(MASK_KEY))
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

  def _soft(self, labels: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """One-hot rows of class indices; rows the mask leaves out (label -1) all zeros."""
    if labels.ndim == 2:
      return labels.astype(np.float32)
    if self.num_classes is None:
      raise OpError("permuted_mixup needs num_classes to make soft labels from class indices")
    real = np.ones(len(labels), bool) if mask is None else np.asarray(mask, bool)
    kept = labels[real]
    if kept.size and not 0 <= kept.min() <= kept.max() < self.num_classes:
      raise OpError(
        f"permuted_mixup: labels outside [0, {self.num_classes}): {kept.min()}..{kept.max()}"
      )
    out = np.zeros((len(labels), self.num_classes), np.float32)
    out[np.flatnonzero(real), kept] = 1
    return out


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
  Labels outside [0, depth) are refused, never an all-`off` row, except on rows an eval
  batch's "mask" leaves out (padding, label -1): those are all `off`."""

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
    real = np.asarray(batch.get(MASK_KEY, np.ones(len(labels), bool)), bool)
    kept = labels[real]
    if kept.size and not 0 <= kept.min() <= kept.max() < self.depth:
      raise OpError(f"onehot: labels outside [0, {self.depth}): {kept.min()}..{kept.max()}")
    out = np.full((len(labels), self.depth), self.off, np.float32)
    out[np.flatnonzero(real), kept] = self.on
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
  Its output arrays are reused once nothing references them any more: a new 77 MB array per
  batch costs as much in page faults and zeroing as the arithmetic (without the reuse,
  bit_i1k's pp_train took ~1.1x the CPU per image; docs/HISTORY.md, issue 38). One you hold
  is never overwritten.
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
    np.multiply(x, scale, out=out, casting="unsafe")
    out += offset
    if self.clip_values:
      np.clip(out, self.vmin, self.vmax, out=out)
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
