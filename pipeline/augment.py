"""Crop geometry and image ops: Inception random-resized-crop, centre crop, flip, resize.

Crop windows are chosen from the header's size *before* decoding, so the decoder only
touches the pixels the crop needs. Every random draw of an example comes from a counter-based
hash of (seed, epoch, record index): a record's crop and flip do not depend on threads,
workers or where a run resumed. The native batch path (`pipeline/_jpeg.c`) draws the same
windows and flips; this module is the Python path (cached images, other formats, no C
extension), and `tests/test_dataset.py` checks that both give identical images.
"""

from __future__ import annotations

import dataclasses
import math

import cv2
import numpy as np

from pipeline import decode

cv2.setNumThreads(1)  # parallelism comes from the pipeline's threads, not OpenCV's

Box = tuple[int, int, int, int]  # (y, x, h, w) in full-resolution pixels
ATTEMPTS = 10
FLIP_DRAW = 4 * ATTEMPTS
_M64 = 2**64 - 1


def _mix(z: int) -> int:
  """splitmix64's finalizer."""
  z = (z + 0x9E3779B97F4A7C15) & _M64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
  return z ^ (z >> 31)


def example_key(seed: int, epoch: int, index: int) -> int:
  """The key of an example's random draws."""
  return _mix(_mix(_mix(seed ^ 0x5DEECE66D) ^ epoch) ^ index)


def uniform(key: int, k: int) -> float:
  """Draw `k` of an example, uniform in [0, 1)."""
  return (_mix((key + (k + 1) * 0xD1B54A32D192ED03) & _M64) >> 11) * 2.0**-53


@dataclasses.dataclass(frozen=True)
class Head:
  """The built-in per-image head: crop window (train: random, eval: centre), flip, resize."""

  image_size: int = 224
  train: bool = True
  area_range: tuple[float, float] = (0.08, 1.0)
  aspect_range: tuple[float, float] = (3 / 4, 4 / 3)
  flip: bool = True
  crop_fraction: float = 0.875
  bicubic: bool = False
  dct_scaling: bool = True
  fast_dct: bool = False

  def native_params(self) -> tuple:
    """The parameter tuple of `_jpeg.decode_batch` and `_jpeg.crop_boxes`."""
    return (
      self.train,
      self.flip,
      self.dct_scaling,
      self.fast_dct,
      tuple(self.area_range),
      tuple(self.aspect_range),
      self.crop_fraction,
    )

  def slot_bytes(self) -> int:
    """Room for one decoded window in the native path's arena: after DCT scaling the shorter
    side is < 2 x image_size (unless the image is 16x larger than that) and the longer at most
    the widest aspect allowed longer; larger windows take the Python path."""
    widest = max(self.aspect_range[1], 1 / self.aspect_range[0]) if self.train else 1.0
    short = 2 * self.image_size + 16  # + an iMCU of the columns libjpeg widens to
    return short * (int(short * widest) + 32) * 3

  def box(self, h: int, w: int, key: int) -> Box:
    if self.train:
      return random_resized_crop_box(h, w, key, self.area_range, self.aspect_range)
    return center_crop_box(h, w, self.crop_fraction)

  def flips(self, key: int) -> bool:
    return self.train and self.flip and uniform(key, FLIP_DRAW) < 0.5

  def dct_scale(self, box: Box) -> int:
    return dct_scale(box, self.image_size) if self.dct_scaling else 1

  def __call__(self, data: bytes, key: int, out: np.ndarray | None = None) -> np.ndarray:
    """The Python path for encoded bytes: header, window, decode the window, flip, resize."""
    box = self.box(*decode.image_size(data), key)
    crop = decode.decode_crop(data, box, self.dct_scale(box), self.fast_dct)
    return resize(
      crop[:, ::-1] if self.flips(key) else crop, self.image_size, out, bicubic=self.bicubic
    )

  def from_decoded(self, image: np.ndarray, key: int, out: np.ndarray | None = None) -> np.ndarray:
    """The same on already decoded pixels (the RAM cache)."""
    y, x, ch, cw = self.box(*image.shape[:2], key)
    crop = image[y : y + ch, x : x + cw]
    return resize(
      crop[:, ::-1] if self.flips(key) else crop, self.image_size, out, bicubic=self.bicubic
    )


def random_resized_crop_box(
  h: int,
  w: int,
  key: int,
  area: tuple[float, float] = (0.08, 1.0),
  ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Box:
  """Inception-style crop: area share in `area`, aspect (w/h) log-uniform in `ratio`.

  After ATTEMPTS misses falls back to the largest centred crop within `ratio`, as
  torchvision's RandomResizedCrop and tf's sample_distorted_bounding_box do.
  """
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  for a in range(ATTEMPTS):
    target = h * w * (area[0] + uniform(key, 4 * a) * (area[1] - area[0]))
    aspect = math.exp(log_lo + uniform(key, 4 * a + 1) * (log_hi - log_lo))
    cw, ch = _round(math.sqrt(target * aspect)), _round(math.sqrt(target / aspect))
    if 0 < cw <= w and 0 < ch <= h:
      return (
        int(uniform(key, 4 * a + 2) * (h - ch + 1)),
        int(uniform(key, 4 * a + 3) * (w - cw + 1)),
        ch,
        cw,
      )
  in_ratio, lo, hi = w / h, math.exp(log_lo), math.exp(log_hi)
  ch, cw = h, w
  if in_ratio < lo:
    ch = _round(w / lo)
  elif in_ratio > hi:
    cw = _round(h * hi)
  ch, cw = max(ch, 1), max(cw, 1)
  return (h - ch) // 2, (w - cw) // 2, ch, cw


def _round(x: float) -> int:
  """C's lround for x >= 0 (half away from zero), as the native path rounds."""
  return int(math.floor(x + 0.5))


def center_crop_box(h: int, w: int, crop_fraction: float = 0.875) -> Box:
  """The eval crop: the centre square of `crop_fraction` of the shorter side."""
  side = max(1, _round(min(h, w) * crop_fraction))
  return (h - side) // 2, (w - side) // 2, side, side


def dct_scale(box: Box, size: int) -> int:
  """Largest JPEG DCT scale denominator (1, 2, 4, 8) that keeps the crop >= `size` pixels."""
  shorter = min(box[2], box[3])
  for denom in (8, 4, 2):
    if shorter >= denom * size:
      return denom
  return 1


def interpolation(h: int, w: int, size: int, bicubic: bool = False) -> int:
  """OpenCV's filter for an h x w -> size x size resize: area averaging when shrinking by
  more than 2x, else bilinear (or bicubic)."""
  if min(h, w) > 2 * size:
    return cv2.INTER_AREA
  return cv2.INTER_CUBIC if bicubic else cv2.INTER_LINEAR


def resize(
  image: np.ndarray, size: int, out: np.ndarray | None = None, *, bicubic: bool = False
) -> np.ndarray:
  """Resizes to size x size (into `out` if given), with `interpolation`'s filter."""
  h, w = image.shape[:2]
  return cv2.resize(
    np.ascontiguousarray(image),
    (size, size),
    dst=out,
    interpolation=interpolation(h, w, size, bicubic),
  )


def resize_shorter(image: np.ndarray, size: int) -> np.ndarray:
  """Resizes so the shorter side is `size`, keeping the aspect ratio (for caching)."""
  h, w = image.shape[:2]
  if min(h, w) <= size:
    return image
  f = size / min(h, w)
  return cv2.resize(
    image, (max(size, round(w * f)), max(size, round(h * f))), interpolation=cv2.INTER_AREA
  )
