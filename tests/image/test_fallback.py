"""One owner per twin: `pipeline/image/_jpeg.c` draws the keys, windows and DCT scales and walks the
frame; `pipeline.image.fallback`, its Python twin, gives the same answers where the extension was
not built, and refuses the windows the C decoder refuses, in its words."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline.image import augment, decode, fallback
from tests import jpeg_modes

RNG_SEED = 2026


def shapes(count: int) -> list[tuple[int, int]]:
  """Image sizes: random ones of every aspect, and the extremes."""
  rng = np.random.default_rng(RNG_SEED)
  sides = np.exp(rng.uniform(0, np.log(6000), (count, 2))).astype(int) + 1
  extremes = [(1, 1), (1, 5000), (5000, 1), (2, 3), (17, 4096), (65500, 3), (375, 500)]
  return extremes + [(int(h), int(w)) for h, w in sides]


def ranges(rng) -> tuple[tuple[float, float], tuple[float, float]]:
  """An area range in (0, 1] and an aspect range, sometimes a single value."""
  area = sorted(rng.uniform(0.01, 1.0, 2))
  ratio = sorted(np.exp(rng.uniform(np.log(0.2), np.log(5.0), 2)))
  if rng.random() < 0.1:
    area, ratio = (area[1], area[1]), (ratio[0], ratio[0])
  return (float(area[0]), float(area[1])), (float(ratio[0]), float(ratio[1]))


def test_keys_and_draws_agree(native):
  rng = np.random.default_rng(RNG_SEED)
  triples = [(0, 0, 0), (-1, 2**64 - 1, 2**70), (2**63, -5, 1)]
  triples += [tuple(int(v) for v in rng.integers(0, 2**63, 3)) for _ in range(500)]
  for seed, epoch, index in triples:
    key = native.example_key(seed, epoch, index)
    assert key == fallback.example_key(seed, epoch, index), (seed, epoch, index)
    for k in (0, 1, 7, fallback.FLIP_DRAW, fallback.TF_DRAW + 399, 2**64 - 1):
      assert native.uniform(key, k) == fallback.uniform(key, k), (key, k)


def test_crop_boxes_and_dct_scales_agree_on_many_shapes(native):
  rng = np.random.default_rng(RNG_SEED)
  for i, (h, w) in enumerate(shapes(3000)):
    key = fallback.example_key(i, int(rng.integers(0, 4)), int(rng.integers(0, 2**40)))
    area, ratio = ranges(rng) if i % 2 else ((0.08, 1.0), (3 / 4, 4 / 3))
    for name in ("random_resized_crop_box", "tf_inception_crop_box"):
      got = getattr(native, name)(h, w, key, area, ratio)
      assert got == getattr(fallback, name)(h, w, key, area, ratio), (name, h, w, key, area, ratio)
      y, x, ch, cw = got
      assert 0 <= y and 0 <= x and 0 < ch and 0 < cw and y + ch <= h and x + cw <= w
    covered = float(rng.choice([0.1, rng.uniform(0, 1)]))
    got = native.tf_inception_crop_box(h, w, key, area, ratio, covered)
    assert got == fallback.tf_inception_crop_box(h, w, key, area, ratio, covered), (h, w, covered)
    assert got == (0, 0, h, w) or got[2] * got[3] >= covered * h * w * (1 - 1e-6)
    fraction = float(rng.uniform(0.01, 1.0))
    for flax in (False, True):
      got = native.center_crop_box(h, w, fraction, flax)
      assert got == fallback.center_crop_box(h, w, fraction, flax), (h, w, fraction, flax)
    box, size = (0, 0, h, w), int(rng.integers(1, 600))
    assert native.dct_scale(box, size) == fallback.dct_scale(box, size), (box, size)


def jpeg(h: int, w: int) -> bytes:
  pixels = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), np.uint8)
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, "JPEG", quality=90)
  return out.getvalue()


def test_frame_walks_agree(native):
  real = jpeg(40, 56)
  header = real[: real.index(b"\xff\xda") + 4]
  datas = [*jpeg_modes.RARE.values(), jpeg_modes.hidden_frame_bomb(), real]
  datas += [header[:n] for n in range(len(header))]  # cut anywhere in the header
  rng = np.random.default_rng(RNG_SEED)
  for _ in range(300):  # stray bytes, fill FFs and stuffed FF 00 pairs in random places
    data = bytearray(header)
    at = int(rng.integers(2, len(data)))
    data[at:at] = rng.choice([b"\x00", b"\xff", b"\xff\x00", b"\x12\x34"])
    datas.append(bytes(data))
  for data in datas:
    assert native.frame(data) == fallback.frame(data), data[:40]


HEADS = [
  dict(image_size=32),
  dict(image_size=224, crop="tf", area_range=(0.05, 1.0), aspect_range=(0.75, 1.33)),
  dict(image_size=64, dct_scaling=False, flip=False),
  dict(image_size=224, train=False),
  dict(image_size=40, train=False, crop_fraction=0.5),
  dict(image_size=224, train=False, eval_order="resize_then_crop"),
]


@pytest.mark.parametrize("fields", HEADS, ids=[str(i) for i in range(len(HEADS))])
def test_the_python_path_draws_the_same_windows_with_the_fallback_forced(
  native, monkeypatch, fields
):
  """What `Head` asks of `decode.geometry()`: the C functions, then their twins."""
  head = augment.Head(**fields)

  def draws() -> list:
    out = []
    for i, (h, w) in enumerate(shapes(400)):
      key = augment.example_key(7, i % 3, i)
      box = head.box(h, w, key)
      out.append((key, box, head.flips(key), head.dct_scale(box)))
    return out

  assert decode.geometry() is native
  with_c = draws()
  monkeypatch.setattr(decode, "_jpeg", None)
  assert decode.geometry() is fallback
  assert draws() == with_c


def png(h: int, w: int) -> bytes:
  out = io.BytesIO()
  Image.new("RGB", (w, h), (10, 20, 30)).save(out, "PNG")
  return out.getvalue()


OUTSIDE = [(0, 0, 41, 56), (0, 0, 40, 57), (-1, 0, 8, 8), (0, -1, 8, 8), (39, 0, 2, 8),
           (0, 50, 8, 7), (0, 0, 0, 8), (0, 0, 8, 0), (41, 0, 1, 1)]  # fmt: skip


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_the_fallback_refuses_out_of_image_crops(monkeypatch, fmt):
  data = jpeg(40, 56) if fmt == "jpeg" else png(40, 56)
  monkeypatch.setattr(decode, "_jpeg", None)
  for y, x, h, w in OUTSIDE:
    words = f"crop \\(y={y}, x={x}, h={h}, w={w}\\) outside 40x56"
    with pytest.raises(decode.DecodeError, match=words):
      decode.decode_crop(data, (y, x, h, w))
  assert decode.decode_crop(data, (1, 2, 39, 54)).shape == (39, 54, 3)  # the edges are inside


def test_c_and_the_fallback_refuse_a_crop_in_the_same_words(native, monkeypatch):
  data = jpeg(40, 56)
  refusals = {}
  for path in ("c", "fallback"):
    if path == "fallback":
      monkeypatch.setattr(decode, "_jpeg", None)
    for box in OUTSIDE:
      with pytest.raises(decode.DecodeError) as e:
        decode.decode_crop(data, box)
      refusals.setdefault(box, []).append(str(e.value))
  for box, (c, python) in refusals.items():
    assert c == python, box
