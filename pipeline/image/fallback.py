"""The Python twins of `pipeline/image/_jpeg.c`'s pure functions, used only where the extension was
not built: the example key and its draws, the crop windows, the DCT scale, the JPEG frame walk.

Where the extension is built, `pipeline.image.augment` and `pipeline.image.decode` call the C
functions (`decode.geometry()` picks), so a window has one owner; tests/image/test_fallback.py
checks that these give the same answers on many shapes and keys. `segments` also serves `decode` to
hand the Python decoders a JPEG as libjpeg reads it.
"""

from __future__ import annotations

import math

import numpy as np

Box = tuple[int, int, int, int]  # (y, x, h, w) in full-resolution pixels
ATTEMPTS = 10  # torchvision's RandomResizedCrop
FLIP_DRAW = 4 * ATTEMPTS
TF_ATTEMPTS = 100  # sample_distorted_bounding_box's max_attempts default (big_vision's call)
TF_DRAW = 64  # the "tf" crop's draws: TF_DRAW + 4 * attempt + (aspect, height, y, x)
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


def random_resized_crop_box(
  h: int,
  w: int,
  key: int,
  area: tuple[float, float] = (0.08, 1.0),
  ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Box:
  """`augment.random_resized_crop_box` in Python."""
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  for a in range(ATTEMPTS):
    target = h * w * (area[0] + uniform(key, 4 * a) * (area[1] - area[0]))
    aspect = math.exp(log_lo + uniform(key, 4 * a + 1) * (log_hi - log_lo))
    cw, ch = lround(math.sqrt(target * aspect)), lround(math.sqrt(target / aspect))
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
    ch = lround(w / lo)
  elif in_ratio > hi:
    cw = lround(h * hi)
  ch, cw = max(ch, 1), max(cw, 1)
  return (h - ch) // 2, (w - cw) // 2, ch, cw


def tf_inception_crop_box(
  h: int,
  w: int,
  key: int,
  area: tuple[float, float] = (0.05, 1.0),
  ratio: tuple[float, float] = (0.75, 1.33),
  min_covered: float = 0.0,
) -> Box:
  """`augment.tf_inception_crop_box` in Python (TF_ATTEMPTS tries, float32 as the kernel)."""
  f32 = np.float32
  lo_area, hi_area = f32(area[0]), f32(area[1])
  lo, hi = f32(ratio[0]), f32(ratio[1])
  min_area, max_area = lo_area * f32(w) * f32(h), hi_area * f32(w) * f32(h)
  for a in range(TF_ATTEMPTS):
    k = TF_DRAW + 4 * a
    aspect = _uniform24(key, k) * (hi - lo) + lo
    ch = int(np.rint(np.sqrt(min_area / aspect)))
    max_h = int(np.rint(np.sqrt(max_area / aspect)))
    if int(np.rint(f32(max_h) * aspect)) > w:
      max_h = int((w + 0.5 - float(f32(1e-7))) / float(aspect))
      if int(np.rint(f32(max_h) * aspect)) > w:
        max_h -= 1
    max_h = min(max_h, h)
    ch = min(ch, max_h)
    if ch < max_h:
      ch += int(uniform(key, k + 1) * (max_h - ch + 1))
    cw = int(np.rint(f32(ch) * aspect))
    crop_area = f32(cw * ch)
    if crop_area < min_area:
      ch += 1
      cw = int(np.rint(f32(ch) * aspect))
      crop_area = f32(cw * ch)
    if crop_area > max_area:
      ch -= 1
      cw = int(np.rint(f32(ch) * aspect))
      crop_area = f32(cw * ch)
    covered = f32(cw * ch) / f32(h * w) >= f32(min_covered)
    if min_area <= crop_area <= max_area and 0 < cw <= w and 0 < ch <= h and covered:
      y = int(uniform(key, k + 2) * (h - ch)) if ch < h else 0
      x = int(uniform(key, k + 3) * (w - cw)) if cw < w else 0
      return y, x, ch, cw
  return 0, 0, h, w


def _uniform24(key: int, k: int) -> np.float32:
  """Draw `k` as a float32 in [0, 1) with 24 bits, like TF's RandFloat."""
  return np.float32(math.floor(uniform(key, k) * 2**24) * 2.0**-24)


def lround(x: float) -> int:
  """C's lround for x >= 0 (half away from zero), as the native path rounds."""
  return int(math.floor(x + 0.5))


def center_crop_box(h: int, w: int, crop_fraction: float = 0.875, flax: bool = False) -> Box:
  """`augment.center_crop_box` in Python."""
  if flax:
    side = max(1, int(np.float32(crop_fraction) * np.float32(min(h, w))))
    return (h - side + 1) // 2, (w - side + 1) // 2, side, side
  side = max(1, lround(min(h, w) * crop_fraction))
  return (h - side) // 2, (w - side) // 2, side, side


def dct_scale(box: Box, size: int) -> int:
  """Largest JPEG DCT scale denominator (1, 2, 4, 8) that keeps the crop >= `size` pixels."""
  shorter = min(box[2], box[3])
  for denom in (8, 4, 2):
    if shorter >= denom * size:
      return denom
  return 1


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def segments(data: bytes):
  """(marker, start, end) of each header segment up to and including the first SOS, found as
  libjpeg's next_marker finds them: bytes other than FF before a marker are skipped (libjpeg
  warns, and reads the same header as without them), as are fill FFs and stuffed `FF 00`
  pairs (a frame can hide behind those). `start` is the marker's FF; stops where the header
  cannot be walked (SOI/EOI again, a length under 2, the end of the data)."""
  n, i = len(data), 2
  if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
    return
  while True:
    while i < n and data[i] != 0xFF:
      i += 1
    while i < n and data[i] == 0xFF:
      i += 1
    if i >= n:
      return
    m, start = data[i], i - 1
    i += 1
    if m == 0x00:
      continue
    if 0xD0 <= m <= 0xD7 or m == 0x01:
      yield m, start, i
      continue
    if m in (0xD8, 0xD9) or i + 1 >= n:
      return
    length = (data[i] << 8) | data[i + 1]
    if length < 2:
      return
    yield m, start, i + length  # may pass the end of a truncated JPEG
    if m == 0xDA:
      return
    i += length


def frame(data: bytes) -> tuple[int, int, int, int] | None:
  """(SOF marker, precision, height, width) of the frame libjpeg decodes, or None.

  The header is walked as libjpeg walks it (`segments`)."""
  for m, start, end in segments(data):
    if m == 0xDA:
      return None
    if m in _SOF:
      if end - start < 10 or start + 8 >= len(data):  # a length under 8, or cut short
        return None
      h, w = (data[start + 5] << 8) | data[start + 6], (data[start + 7] << 8) | data[start + 8]
      return (m, data[start + 4], h, w) if h > 0 and w > 0 else None
  return None
