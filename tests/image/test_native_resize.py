"""The C decoder's own bilinear resize: given the batch's images, it resizes each window into its
slot, mirrored on the way, with the pixels cv2.resize gives the mirrored window, to the bit."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from pipeline.catalog import records
from pipeline.image import augment, decode


def photos(count: int, seed: int = 0) -> list[bytes]:
  """JPEGs of smooth noise, 24 to 700 px a side (windows both shrunk and enlarged)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    h, w = rng.integers(24, 700, 2)
    small = rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8)
    image = cv2.resize(small, (int(w), int(h)), interpolation=cv2.INTER_CUBIC)
    out.append(cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
  return out


def decoded(head: augment.Head, datas: list[bytes], fused: bool):
  """The batch path's images: resized by the decoder (`fused`) or, as before, each window
  handed to cv2.resize; and the windows the decoder left to OpenCV."""
  n, size = len(datas), head.image_size
  slot = head.slot_bytes() * (1 if head.dct_scaling else 64)  # room for windows decoded whole
  keys = records.Keys()
  decoder = decode.native().BatchDecoder(
    head.native_params(), size, slot, 3, keys.image.encode(), keys.label.encode()
  )
  index = np.arange(n, dtype=np.int64)
  labels, dims = np.zeros(n, np.int64), np.zeros((n, 2), np.int32)
  arena, images = np.zeros(n * slot, np.uint8), np.zeros((n, size, size, 3), np.uint8)
  back = decoder(
    [records.encode(d, 1) for d in datas],
    index,
    index,
    labels,
    dims,
    arena,
    0,
    n,
    None,
    images if fused else None,
  )
  assert back == []
  for k, (h, w) in enumerate(dims.tolist()):
    if h:
      window = arena[k * slot : k * slot + h * w * 3].reshape(h, w, 3)
      cv2.resize(
        window, (size, size), dst=images[k], interpolation=augment.interpolation(h, w, size)
      )
  return images, int((dims[:, 0] > 0).sum())


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("size", [224, 61, 32])
def test_the_decoders_resize_gives_opencvs_pixels_mirrored_or_not(size):
  datas = photos(48)
  for head in (augment.Head(size, train=True), augment.Head(size, train=False)):
    want, _ = decoded(head, datas, fused=False)
    got, left = decoded(head, datas, fused=True)
    np.testing.assert_array_equal(got, want, err_msg=f"{size} px, train={head.train}")
    assert left < len(datas) // 2  # most windows were resized by the decoder itself


@pytest.mark.usefixtures("native")
def test_windows_over_twice_the_size_are_left_to_opencvs_area_filter_unmirrored():
  """Without DCT scaling a large window is shrunk by area averaging, which the decoder leaves
  to OpenCV: it then mirrors that window in place, as it did before."""
  datas = photos(24, seed=1)
  head = augment.Head(32, train=True, dct_scaling=False)
  want, _ = decoded(head, datas, fused=False)
  got, left = decoded(head, datas, fused=True)
  np.testing.assert_array_equal(got, want)
  assert left > 0


@pytest.mark.usefixtures("native")
def test_with_rows_each_image_goes_to_its_row_and_no_other_row_is_touched():
  """A mixture's source fills only its rows of the batch's images (slot k -> rows[k]); a row
  outside the images is refused before anything is decoded."""
  datas, size = photos(8, seed=2), 32
  head = augment.Head(size, train=True)
  want, _ = decoded(head, datas, fused=True)
  keys, slot = records.Keys(), head.slot_bytes()
  decoder = decode.native().BatchDecoder(
    head.native_params(), size, slot, 3, keys.image.encode(), keys.label.encode()
  )
  index, rows = np.arange(8, dtype=np.int64), np.arange(1, 17, 2, dtype=np.int64)
  labels, dims, arena = (
    np.zeros(8, np.int64),
    np.zeros((8, 2), np.int32),
    np.zeros(8 * slot, np.uint8),
  )
  images = np.full((17, size, size, 3), 7, np.uint8)
  encoded = [records.encode(d, 1) for d in datas]
  assert decoder(encoded, index, index, labels, dims, arena, 0, 8, None, images, rows) == []
  assert not dims.any()  # every window resized by the decoder
  np.testing.assert_array_equal(images[rows], want)
  assert (images[::2] == 7).all()  # the other source's rows untouched
  with pytest.raises(ValueError, match=r"rows\[3\] = 17 outside the 17 images"):
    decoder(encoded, index, index, labels, dims, arena, 0, 8, None, images, rows + (rows == 7) * 10)
