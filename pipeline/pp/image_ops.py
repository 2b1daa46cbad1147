"""The shipped image ops (`pipeline.pp.contract` has their contract): `color_jitter`."""

from __future__ import annotations

import dataclasses

import cv2
import numpy as np

from pipeline.pp import registry
from pipeline.pp.contract import OpError


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
