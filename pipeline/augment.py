"""Crop geometry and image ops: Inception random-resized-crop, centre crop, flip, resize.

Crop windows are chosen from the header's size *before* decoding, so the decoder only
touches the pixels the crop needs (see `pipeline.decode.decode_crop`).
"""

from __future__ import annotations

import math

import cv2
import numpy as np

cv2.setNumThreads(1)  # parallelism comes from the pipeline's threads, not OpenCV's

Box = tuple[int, int, int, int]  # (y, x, h, w) in full-resolution pixels


def random_resized_crop_box(h: int, w: int, rng: np.random.Generator,
                            area: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3),
                            attempts: int = 10) -> Box:
  """Inception-style crop: area share in `area`, aspect (w/h) log-uniform in `ratio`.

  After `attempts` misses falls back to the largest centred crop within `ratio`, as
  torchvision's RandomResizedCrop and tf's sample_distorted_bounding_box do.
  """
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(attempts):
    target = h * w * rng.uniform(*area)
    aspect = math.exp(rng.uniform(*log_ratio))
    cw = int(round(math.sqrt(target * aspect)))
    ch = int(round(math.sqrt(target / aspect)))
    if 0 < cw <= w and 0 < ch <= h:
      return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
  in_ratio = w / h
  if in_ratio < ratio[0]:
    cw, ch = w, int(round(w / ratio[0]))
  elif in_ratio > ratio[1]:
    ch, cw = h, int(round(h * ratio[1]))
  else:
    ch, cw = h, w
  return (h - ch) // 2, (w - cw) // 2, ch, cw


def center_crop_box(h: int, w: int, crop_fraction: float = 0.875) -> Box:
  """The eval crop: resize shorter side to size/crop_fraction, then take the centre square."""
  side = max(1, int(round(min(h, w) * crop_fraction)))
  return (h - side) // 2, (w - side) // 2, side, side


def dct_scale(box: Box, size: int) -> int:
  """Largest JPEG DCT scale denominator (1, 2, 4, 8) that keeps the crop >= `size` pixels."""
  shorter = min(box[2], box[3])
  for denom in (8, 4, 2):
    if shorter >= denom * size:
      return denom
  return 1


def resize(image: np.ndarray, size: int, out: np.ndarray | None = None) -> np.ndarray:
  """Resizes to size x size (into `out` if given): bilinear, or area averaging when
  shrinking by more than 2x."""
  h, w = image.shape[:2]
  if (h, w) == (size, size):
    if out is None:
      return np.ascontiguousarray(image)
    out[...] = image
    return out
  interp = cv2.INTER_AREA if min(h, w) > 2 * size else cv2.INTER_LINEAR
  return cv2.resize(image, (size, size), dst=out, interpolation=interp)


def resize_shorter(image: np.ndarray, size: int) -> np.ndarray:
  """Resizes so the shorter side is `size`, keeping the aspect ratio (for caching)."""
  h, w = image.shape[:2]
  if min(h, w) <= size:
    return image
  f = size / min(h, w)
  return cv2.resize(image, (max(size, round(w * f)), max(size, round(h * f))),
                    interpolation=cv2.INTER_AREA)


def flip_lr(image: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
  """Mirrors left-right (in place when `out` is `image`)."""
  return cv2.flip(image, 1, dst=out)
