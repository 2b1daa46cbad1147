"""The Flax ImageNet example's recipe (docs/RECIPES.md) against what TensorFlow made of it,
recorded by tests/make_flax_reference.py: the eval window to the pixel, eval pixels within a
level, and train crops with the statistics of its `sample_distorted_bounding_box` call.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import pipeline
from pipeline.catalog import records
from pipeline.image import augment, fallback
from tests import make_flax_reference as reference
from tests import make_geometry_reference as geometry

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "reference"
RECORDED = json.loads((REFERENCE / "flax_reference.json").read_text())
ARRAYS = np.load(REFERENCE / "flax_eval.npz")
# docs/RECIPES.md's settings for the example (the Augment fields; pipeline.input takes them too)
TRAIN = dict(crop="tf", min_object_covered=0.1, interpolation="bicubic")
EVAL = dict(crop_padding=32, interpolation="bicubic")


def test_crop_padding_cuts_the_examples_eval_window_to_the_pixel():
  rows = RECORDED["center_windows"]["rows"]
  rounded = 0
  for h, w, size, y, x, side in rows:
    fraction = size / (size + reference.CROP_PADDING)
    assert augment.center_crop_box(h, w, fraction, flax=True) == (y, x, side, side), (h, w, size)
    assert fallback.center_crop_box(h, w, fraction, flax=True) == (y, x, side, side)
    rounded += augment.center_crop_box(h, w, fraction) != (y, x, side, side)
  assert rounded > len(rows) / 2  # crop_fraction's box (nearest side, offset down) is another


def test_eval_at_224_px_is_within_a_level_of_the_examples_pixels(tmp_path, write_dataset):
  """The settings of docs/RECIPES.md through make_dataset; TF's pixels were rounded to uint8
  and kept every STRIDE-th row and column."""
  jpegs = reference.eval_jpegs()
  recs = [records.encode(data, 0) for data in jpegs.values()]
  data_dir = write_dataset(tmp_path / "data", recs)
  errors = {}
  for fast_dct in (True, False):
    ds = pipeline.make_dataset(
      data_dir,
      "train",
      batch_size=8,
      train=False,
      image_size=224,
      augment=EVAL,
      decoding=dict(fast_dct=fast_dct),
      performance=dict(num_threads=2),
    )
    images = np.concatenate([b["image"][b["mask"]] for b in ds])
    grid = images[:, :: reference.STRIDE, :: reference.STRIDE].astype(int)
    expected = np.stack([ARRAYS[f"eval/{name}"] for name in jpegs])
    errors[fast_dct] = np.abs(grid - expected).mean(axis=(1, 2, 3))
  assert errors[True].mean() < 1.0 and errors[True].max() < 1.5, errors[True]
  assert errors[False].mean() > errors[True].mean()  # TF decodes with the fast IDCT


def area_shares(sampler) -> np.ndarray:
  """Crop area / image area of DRAWS crops per shape of the reference, pooled."""
  shares = []
  for i, (h, w) in enumerate(geometry.SHAPES):
    for j in range(reference.DRAWS):
      _, _, ch, cw = sampler(h, w, augment.example_key(5, i, j))
      shares.append(ch * cw / (h * w))
  return np.array(shares)


def ks(a: np.ndarray, b: np.ndarray) -> float:
  """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
  points = np.union1d(a, b)
  gaps = [np.searchsorted(np.sort(x), points, side="right") / len(x) for x in (a, b)]
  return float(np.abs(gaps[0] - gaps[1]).max())


def head(**fields) -> augment.Head:
  """The train head `make_dataset` builds for these Augment fields."""
  aug = pipeline.Augment(**fields)
  return augment.Head(
    train=True,
    area_range=aug.area_range,
    aspect_range=aug.aspect_range,
    crop=aug.crop,
    min_object_covered=aug.min_object_covered,
  )


def test_train_crops_have_the_statistics_of_the_examples_sampler():
  tf = []
  for h, w in geometry.SHAPES:
    boxes = ARRAYS[f"train/{h}x{w}"].astype(np.int64)
    tf.append(boxes[:, 2] * boxes[:, 3] / (h * w))
  tf = np.concatenate(tf)
  assert (tf < 0.1).mean() == RECORDED["train"]["share_under_10pct"] == 0
  flax = area_shares(lambda h, w, key: head(**TRAIN).box(h, w, key))
  assert ks(flax, tf) <= 0.02 and (flax < 0.1).mean() == 0
  assert abs(flax.mean() - RECORDED["train"]["mean_area"]) < 0.01
  plain = area_shares(lambda h, w, key: head(crop="tf").box(h, w, key))
  assert ks(plain, tf) > 0.05 and (plain < 0.1).mean() > 0.05  # the crops the issue saw


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(min_object_covered=0.1), "min_object_covered is TF's sampler's .* set crop='tf'"),
    (dict(crop="tf", min_object_covered=1.5), r"min_object_covered must be in \[0, 1\]"),
  ],
)
def test_min_object_covered_is_refused_where_it_means_nothing(fields, message):
  with pytest.raises(ValueError, match=message):
    pipeline.Augment(**fields)
