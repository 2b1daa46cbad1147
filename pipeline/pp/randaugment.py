"""big_vision's RandAugment (`randaug(num_layers, magnitude)`) on uint8 images, with OpenCV.

A port of `distort_image_with_randaugment` (big_vision/pp/autoaugment.py, the TPU
AutoAugment code): `num_layers` times, one of 16 ops is drawn uniformly and applied at
`magnitude` (levels over 10 go past the paper's range, as there: magnitude 15 rotates by
45 degrees, shears by 0.45 and translates by 150 pixels). Empty pixels of geometric ops
and cutout are grey (128). Every draw comes from the op's generator, so an image's
augmentation is a pure function of (seed, epoch, index).

Where pixels can differ from TF's:
- Rotate, shear and translate sample nearest pixels through OpenCV's `warpAffine`; at
  places the chosen source pixel differs by one from tensorflow-addons' (rounding of
  the mapped coordinate), and rotation's direction for a given sign may be mirrored (the
  sign is drawn 50/50, so the distribution is the same).
- Colour's grey image is OpenCV's RGB->grey (0.299, 0.587, 0.114, rounded) where TF uses
  (0.2989, 0.5870, 0.1140): at most one grey level apart.
- Blends truncate toward zero as TF's cast does, through OpenCV with an offset of
  -0.499: a value within 0.0005 below an integer rounds up instead.
Kept as TF has them, quirks included: Contrast blends toward the constant
min(255, pixels / 256) (TF's histogram sum / 256, not the mean grey level), Solarize from
magnitude 10 on leaves images unchanged (threshold >= 256), and no op is skipped at random
(RandAugment ignores the per-op probability).
"""

from __future__ import annotations

import dataclasses

import cv2
import numpy as np

from pipeline.pp import ops, registry

MAX_LEVEL = 10.0
GREY = (128, 128, 128)
NAMES = (
  "AutoContrast",
  "Equalize",
  "Invert",
  "Rotate",
  "Posterize",
  "Solarize",
  "Color",
  "Contrast",
  "Brightness",
  "Sharpness",
  "ShearX",
  "ShearY",
  "TranslateX",
  "TranslateY",
  "Cutout",
  "SolarizeAdd",
)
_LEVELS = np.arange(256, dtype=np.float64)
_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13


@registry.register("randaug", "image")
@dataclasses.dataclass(frozen=True)
class RandAugment:
  """big_vision's randaug(num_layers, magnitude) on uint8 HxWx3 images (module docstring)."""

  num_layers: int = 2
  magnitude: float = 10
  translate_const: float = 100
  cutout_const: float = 40

  def __post_init__(self):
    if not isinstance(self.num_layers, int) or self.num_layers < 0:
      raise ValueError(f"randaug num_layers must be an int >= 0, got {self.num_layers!r}")
    if self.magnitude < 0:
      raise ValueError(f"randaug magnitude must be >= 0, got {self.magnitude}")

  def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
      raise ops.OpError(
        f"randaug needs uint8 HxWx3 images (put it before value_range), got "
        f"{image.dtype}{list(image.shape)}"
      )
    for _ in range(self.num_layers):
      image = self.apply(NAMES[int(rng.integers(len(NAMES)))], image, rng)
    return image

  def apply(self, name: str, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Op `name` at this magnitude (its random sign or position drawn from `rng`)."""
    level = float(self.magnitude) / MAX_LEVEL
    sign = lambda: -1.0 if rng.random() < 0.5 else 1.0
    image = np.ascontiguousarray(image)
    if name == "AutoContrast":
      return _per_channel(image, _autocontrast_table)
    if name == "Equalize":
      return _per_channel(image, _equalize_table)
    if name == "Invert":
      return cv2.bitwise_not(image)
    if name == "Rotate":
      h, w = image.shape[:2]
      m = cv2.getRotationMatrix2D(((w - 1) / 2, (h - 1) / 2), sign() * level * 30.0, 1.0)
      return _warp(image, m, inverse=False)
    if name == "Posterize":
      shift = max(0, 8 - int(level * 4))
      return cv2.LUT(image, ((np.arange(256) >> shift) << shift).astype(np.uint8))
    if name == "Solarize":
      threshold = int(level * 256)
      return cv2.LUT(image, np.where(_LEVELS < threshold, _LEVELS, 255 - _LEVELS).astype(np.uint8))
    if name == "SolarizeAdd":
      add = int(level * 110)
      table = np.where(_LEVELS < 128, np.clip(_LEVELS + add, 0, 255), _LEVELS)
      return cv2.LUT(image, table.astype(np.uint8))
    factor = level * 1.8 + 0.1
    if name == "Color":
      grey = cv2.cvtColor(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB)
      return _blend(grey, image, factor)
    if name == "Contrast":  # toward TF's constant: pixel count / 256, clipped (see above)
      grey = min(255, image.shape[0] * image.shape[1] // 256) if image.size else 0
      return cv2.LUT(image, _blend_table(float(grey), factor))
    if name == "Brightness":
      return cv2.LUT(image, _blend_table(0.0, factor))
    if name == "Sharpness":
      smooth = cv2.filter2D(image, -1, _SMOOTH, delta=-0.499, borderType=cv2.BORDER_REPLICATE)
      smooth[0], smooth[-1], smooth[:, 0], smooth[:, -1] = (
        image[0],
        image[-1],
        image[:, 0],
        image[:, -1],
      )
      return _blend(smooth, image, factor)
    if name == "ShearX":
      return _warp(image, np.array([[1, sign() * level * 0.3, 0], [0, 1, 0]]))
    if name == "ShearY":
      return _warp(image, np.array([[1, 0, 0], [sign() * level * 0.3, 1, 0]]))
    if name == "TranslateX":
      return _warp(image, np.array([[1, 0, sign() * level * self.translate_const], [0, 1, 0]]))
    if name == "TranslateY":
      return _warp(image, np.array([[1, 0, 0], [0, 1, sign() * level * self.translate_const]]))
    if name == "Cutout":
      pad = int(level * self.cutout_const)
      h, w = image.shape[:2]
      cy, cx = int(rng.integers(h)), int(rng.integers(w))
      out = image.copy()
      out[max(0, cy - pad) : min(h, cy + pad), max(0, cx - pad) : min(w, cx + pad)] = GREY
      return out
    raise ValueError(f"unknown RandAugment op {name!r}")


def _warp(image: np.ndarray, m: np.ndarray, inverse: bool = True) -> np.ndarray:
  """Output pixel (x, y) from input m @ (x, y, 1) (inverse) or the inverse of m; nearest
  pixel, grey outside."""
  flags = cv2.INTER_NEAREST | (cv2.WARP_INVERSE_MAP if inverse else 0)
  return cv2.warpAffine(
    image,
    np.asarray(m, np.float64),
    (image.shape[1], image.shape[0]),
    flags=flags,
    borderMode=cv2.BORDER_CONSTANT,
    borderValue=GREY,
  )


def _blend_table(degenerate: float, factor: float) -> np.ndarray:
  """TF's blend(degenerate, image, factor) of a constant degenerate, as a lookup table."""
  return np.trunc(np.clip(degenerate + factor * (_LEVELS - degenerate), 0, 255)).astype(np.uint8)


def _blend(degenerate: np.ndarray, image: np.ndarray, factor: float) -> np.ndarray:
  """TF's blend: degenerate + factor * (image - degenerate), clipped, truncated."""
  if factor == 0.0:
    return degenerate
  if factor == 1.0:
    return image
  return cv2.addWeighted(image, factor, degenerate, 1.0 - factor, -0.499)


def _per_channel(image: np.ndarray, table_of) -> np.ndarray:
  tables = [table_of(plane) for plane in cv2.split(image)]
  return cv2.LUT(image, np.stack(tables, axis=-1).reshape(256, 1, 3))


def _autocontrast_table(channel: np.ndarray) -> np.ndarray:
  lo, hi, _, _ = cv2.minMaxLoc(channel)
  if hi <= lo:
    return np.arange(256, dtype=np.uint8)
  scale = 255.0 / (hi - lo)
  return np.clip(_LEVELS * scale - lo * scale, 0, 255).astype(np.uint8)


def _equalize_table(channel: np.ndarray) -> np.ndarray:
  histo = cv2.calcHist([channel], [0], None, [256], [0, 256])
  histo = histo.ravel().astype(np.int64)
  nonzero = histo[histo != 0]
  step = (nonzero.sum() - nonzero[-1]) // 255 if len(nonzero) else 0
  if step == 0:
    return np.arange(256, dtype=np.uint8)
  lut = (np.cumsum(histo) + step // 2) // step
  return np.clip(np.concatenate([[0], lut[:-1]]), 0, 255).astype(np.uint8)
