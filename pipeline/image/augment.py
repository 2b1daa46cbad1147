"""Crop geometry and image ops: two Inception random crops, two eval orders, flip, resize.

Train crops (`Head.crop`): "torchvision" is torchvision's RandomResizedCrop (area share
uniform, aspect log-uniform, 10 tries, centred fallback); "tf" is TF's
`sample_distorted_bounding_box` as big_vision's `inception_crop` calls it (aspect uniform,
height uniform between the area bounds, 100 tries, whole-image fallback, TF's float32
rounding; `min_object_covered` as the Flax ImageNet example passes it). Eval
(`Head.eval_order`): "crop_then_resize" resizes the centre crop (`flax_center`: the Flax
example's box); "resize_then_crop" is big_vision's `resize_small(R)|central_crop(S)`.

Crop windows are chosen from the header's size *before* decoding, so the decoder only
touches the pixels the crop needs. Every random draw of an example comes from a counter-based
hash of (seed, epoch, record index): a record's crop and flip do not depend on threads,
workers or where a run resumed. The key, draws, windows and DCT scales are those of
`pipeline/image/_jpeg.c`, the functions its batch path calls (`decode.geometry()`; their Python
twins in `pipeline.image.fallback` only where the extension was not built). This module is the
Python path (cached images, other formats), and `tests/test_dataset.py` checks that both paths
give identical images.
"""

from __future__ import annotations

import dataclasses

import cv2
import numpy as np

from pipeline.image import decode, fallback

cv2.setNumThreads(1)  # parallelism comes from the pipeline's threads, not OpenCV's

Box = fallback.Box  # (y, x, h, w) in full-resolution pixels


def example_key(seed: int, epoch: int, index: int) -> int:
  """The key of an example's random draws."""
  return decode.geometry().example_key(seed, epoch, index)


def uniform(key: int, k: int) -> float:
  """Draw `k` of an example, uniform in [0, 1)."""
  return decode.geometry().uniform(key, k)


def random_resized_crop_box(
  h: int,
  w: int,
  key: int,
  area: tuple[float, float] = (0.08, 1.0),
  ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Box:
  """torchvision's RandomResizedCrop: area share uniform in `area`, aspect (w/h) log-uniform
  in `ratio`; after 10 misses the largest centred crop within `ratio`. Not TF's
  sample_distorted_bounding_box (see `tf_inception_crop_box`): smaller crops are rarer here.
  """
  return decode.geometry().random_resized_crop_box(h, w, key, area, ratio)


def tf_inception_crop_box(
  h: int,
  w: int,
  key: int,
  area: tuple[float, float] = (0.05, 1.0),
  ratio: tuple[float, float] = (0.75, 1.33),
  min_covered: float = 0.0,
) -> Box:
  """TF's `sample_distorted_bounding_box` as big_vision's `inception_crop` calls it (no boxes,
  min_object_covered=0): aspect (w/h) uniform in `ratio`, then the height uniform among
  the integers between the area bounds (`GenerateRandomCrop`, float32 like the kernel), the
  offset uniform in [0, h - ch) (sic); after 100 misses, the whole image. `min_covered`: as
  the Flax example calls it (the whole image as its one box, `min_object_covered=0.1`), a
  crop covering less of the image is a miss (`SatisfiesOverlapConstraints`)."""
  return decode.geometry().tf_inception_crop_box(h, w, key, area, ratio, min_covered)


def center_crop_box(h: int, w: int, crop_fraction: float = 0.875, flax: bool = False) -> Box:
  """The eval crop: the centre square of `crop_fraction` of the shorter side, its side rounded
  to nearest and its offset down; `flax`: as the Flax example's `_decode_and_center_crop`
  (side truncated from float32, offset rounded up)."""
  return decode.geometry().center_crop_box(h, w, crop_fraction, flax)


def dct_scale(box: Box, size: int) -> int:
  """Largest JPEG DCT scale denominator (1, 2, 4, 8) that keeps the crop >= `size` pixels."""
  return decode.geometry().dct_scale(box, size)


@dataclasses.dataclass(frozen=True)
class Head:
  """The built-in per-image head: crop window (train: random, eval: centre), flip, resize.
  `crop` and `eval_order`: see the module docstring."""

  image_size: int = 224
  train: bool = True
  area_range: tuple[float, float] = (0.08, 1.0)
  aspect_range: tuple[float, float] = (3 / 4, 4 / 3)
  flip: bool = True
  crop_fraction: float = 0.875
  bicubic: bool = False
  dct_scaling: bool = True
  fast_dct: bool = False
  crop: str = "torchvision"
  eval_order: str = "crop_then_resize"
  min_object_covered: float = 0.0
  flax_center: bool = False

  @property
  def resize_first(self) -> bool:
    """Eval resizes the whole image's shorter side to `resize_to`, then crops the centre."""
    return not self.train and self.eval_order == "resize_then_crop"

  @property
  def resize_to(self) -> int:
    """The shorter side of resize_then_crop: image_size / crop_fraction (big_vision's 256)."""
    return fallback.lround(self.image_size / self.crop_fraction)

  def native_params(self) -> tuple:
    """The parameter tuple of `_jpeg.BatchDecoder`."""
    return (
      self.train,
      self.flip,
      self.dct_scaling,
      self.fast_dct,
      tuple(self.area_range),
      tuple(self.aspect_range),
      self.crop_fraction,
      self.crop == "tf",
      self.resize_first,
      self.min_object_covered,
      self.flax_center,
    )

  def slot_bytes(self) -> int:
    """Room for one decoded window in the native path's arena: after DCT scaling the shorter
    side is < 2 x image_size (unless the image is 16x larger than that) and the longer at most
    the widest aspect allowed longer; larger windows take the Python path (the "tf" crop's
    whole-image fallback may). resize_then_crop decodes whole images unscaled: room for
    2:1 ones whose shorter side is <= max(2 x resize_to, 512) (ImageNet's)."""
    widest = max(self.aspect_range[1], 1 / self.aspect_range[0]) if self.train else 1.0
    short = 2 * self.image_size + 16  # + an iMCU of the columns libjpeg widens to
    if self.resize_first:
      widest, short = 2.0, max(2 * self.resize_to, 512) + 16
    return short * (int(short * widest) + 32) * 3

  def box(self, h: int, w: int, key: int) -> Box:
    """The window to decode: the random crop, the centre crop, or (resize_then_crop) all."""
    if self.train and self.crop == "tf":
      return tf_inception_crop_box(
        h, w, key, self.area_range, self.aspect_range, self.min_object_covered
      )
    if self.train:
      return random_resized_crop_box(h, w, key, self.area_range, self.aspect_range)
    if self.resize_first:
      return 0, 0, h, w
    return center_crop_box(h, w, self.crop_fraction, self.flax_center)

  def flips(self, key: int) -> bool:
    return self.train and self.flip and uniform(key, fallback.FLIP_DRAW) < 0.5

  def dct_scale(self, box: Box) -> int:
    """resize_then_crop decodes at full resolution as TF does (DCT scaling there moved pixels
    by 1.4-6 levels on average vs big_vision's, none by 0.5)."""
    return dct_scale(box, self.image_size) if self.dct_scaling and not self.resize_first else 1

  def finish(
    self, window: np.ndarray, full: tuple[int, int], out: np.ndarray | None = None
  ) -> np.ndarray:
    """A decoded (flipped) window -> image_size x image_size: resized, or (resize_then_crop)
    the whole image of full-resolution size `full` resized by shorter side, centre-cropped."""
    if not self.resize_first:
      return resize(window, self.image_size, out, bicubic=self.bicubic)
    return resize_small_central_crop(window, full, self.resize_to, self.image_size, out)

  def __call__(self, data: bytes, key: int, out: np.ndarray | None = None) -> np.ndarray:
    """The Python path for encoded bytes: header, window, decode the window, flip, resize."""
    full = decode.image_size(data)
    box = self.box(*full, key)
    crop = decode.decode_crop(data, box, self.dct_scale(box), self.fast_dct)
    return self.finish(crop[:, ::-1] if self.flips(key) else crop, full, out)

  def from_decoded(self, image: np.ndarray, key: int, out: np.ndarray | None = None) -> np.ndarray:
    """The same on already decoded pixels (the RAM cache): the window is drawn on `image`'s
    own size, so a cached image, smaller than the record's, gets a slightly other crop
    (`Decoding.cache_mb` changes pixels)."""
    y, x, ch, cw = self.box(*image.shape[:2], key)
    crop = image[y : y + ch, x : x + cw]
    return self.finish(crop[:, ::-1] if self.flips(key) else crop, image.shape[:2], out)


def resize_small_dims(h: int, w: int, size: int) -> tuple[int, int]:
  """big_vision's `resize_small(size)` output size: factor = size / min(h, w) and
  round(side * factor), in float32 with round-half-even as TF's."""
  factor = np.float32(size) / np.float32(min(h, w))
  return int(np.rint(np.float32(h) * factor)), int(np.rint(np.float32(w) * factor))


def resize_small_central_crop(
  image: np.ndarray, full: tuple[int, int], small: int, size: int, out: np.ndarray | None = None
) -> np.ndarray:
  """big_vision's `resize_small(small)|central_crop(size)` of an image whose full-resolution
  size is `full` (`image` may be DCT-scaled): area filter (TF's method "area", no
  antialias), then the centre size x size."""
  rh, rw = resize_small_dims(*full, small)
  resized = cv2.resize(np.ascontiguousarray(image), (rw, rh), interpolation=cv2.INTER_AREA)
  dy, dx = (rh - size) // 2, (rw - size) // 2
  crop = resized[dy : dy + size, dx : dx + size]
  if out is None:
    return np.ascontiguousarray(crop)
  out[...] = crop
  return out


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
