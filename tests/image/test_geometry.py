"""Crop and eval geometry against TensorFlow's, recorded by tests/make_geometry_reference.py.

`Augment.crop="tf"` samples as `tf.image.sample_distorted_bounding_box` (big_vision's
inception crop); "torchvision" is RandomResizedCrop, a different distribution.
`eval_order="resize_then_crop"` gives big_vision's `resize_small(R)|central_crop(S)` pixels.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import pipeline
from pipeline.image import augment, decode
from tests import make_geometry_reference as reference

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "reference"
CROPS = json.loads((REFERENCE / "geometry_reference.json").read_text())


def crop_stats(sampler, area_range, seed=7):
  """Mean area share, share under 8% and share of whole images over the reference's shapes."""
  areas, whole = [], []
  for i, (h, w) in enumerate(CROPS["shapes"]):
    for j in range(CROPS["draws_per_shape"]):
      key = augment.example_key(seed, i, j)
      _, _, ch, cw = sampler(h, w, key, tuple(area_range), tuple(CROPS["aspect_range"]))
      areas.append(ch * cw / (h * w))
      whole.append(ch == h and cw == w)
  areas = np.array(areas)
  return areas.mean(), (areas < 0.08).mean(), np.mean(whole)


@pytest.mark.parametrize("ranges", CROPS["ranges"], ids=lambda r: str(r["area_range"]))
def test_tf_crop_has_tensorflows_statistics_and_torchvision_does_not(ranges):
  mean, small, _ = crop_stats(augment.tf_inception_crop_box, ranges["area_range"])
  assert abs(mean - ranges["mean_area"]) < 0.01
  assert abs(small - ranges["share_under_8pct"]) < 0.01
  mean, _, _ = crop_stats(augment.random_resized_crop_box, ranges["area_range"])
  assert mean - ranges["mean_area"] > 0.04  # larger crops: the names mean different things


def test_tf_crop_falls_back_to_the_whole_image():
  fallback = CROPS["fallback"]
  (h, w), area_range = fallback["shape"], tuple(fallback["area_range"])
  assert fallback["share_whole_image"] == 1.0  # TF's answer
  for index in range(50):
    key = augment.example_key(0, 0, index)
    assert augment.tf_inception_crop_box(h, w, key, area_range) == (0, 0, h, w)
    assert augment.random_resized_crop_box(h, w, key, area_range) != (0, 0, h, w)  # centred


def test_tf_crop_windows_stay_inside_the_image():
  for h, w in [(1, 1), (1, 500), (500, 1), (7, 13), (2000, 30)]:
    for index in range(200):
      y, x, ch, cw = augment.tf_inception_crop_box(h, w, augment.example_key(1, 2, index))
      assert 0 <= y and y + ch <= h and 0 <= x and x + cw <= w and ch > 0 and cw > 0


def eval_cases():
  pixels = np.load(REFERENCE / "geometry_eval.npz")
  for package, name, sizes in reference.EVAL_IMAGES:
    with open(reference.image_path(package, name), "rb") as f:
      data = f.read()
    for size in sizes:
      yield f"{name}@{size}", data, size, pixels[f"{package}/{name}@{size}"]


@pytest.mark.parametrize("fast_dct", [True, False])
def test_resize_then_crop_gives_big_visions_eval_pixels(fast_dct):
  """big_vision decodes with TF's default fast IDCT; ours is a performance choice. TF casts
  the area filter's floats down, OpenCV rounds: 0.5 levels of the difference."""
  for what, data, size, expected in eval_cases():
    errors = {}
    for order in ("resize_then_crop", "crop_then_resize"):
      head = augment.Head(size, train=False, eval_order=order, fast_dct=fast_dct)
      errors[order] = np.abs(head(data, 0).astype(int) - expected).mean()
    assert errors["resize_then_crop"] < (0.6 if fast_dct else 1.6), (what, errors)
    assert errors["crop_then_resize"] > errors["resize_then_crop"] + 0.4, (what, errors)


def test_resize_then_crop_on_cached_pixels_is_close():
  """The decoded-image cache keeps images (exact IDCT) resized to resize_to: cropping them
  is as close as the exact IDCT's pixels are."""
  for what, data, size, expected in eval_cases():
    head = augment.Head(size, train=False, eval_order="resize_then_crop")
    cached = augment.resize_shorter(decode.decode(data), head.resize_to)
    assert np.abs(head.from_decoded(cached, 0).astype(int) - expected).mean() < 1.6, what


@pytest.mark.parametrize(
  "field, value, allowed",
  [
    ("crop", "inception", "('torchvision', 'tf')"),
    ("eval_order", "resize", "('crop_then_resize', 'resize_then_crop')"),
  ],
)
def test_augment_refuses_unknown_geometry(field, value, allowed):
  with pytest.raises(ValueError, match=rf"augment\.{field} must be one of .*{allowed}"):
    pipeline.Augment(**{field: value})
