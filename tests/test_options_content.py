"""Each performance and decoding option, on and off, over a converted dataset: every
`Performance` option gives bitwise equal batches; every `Decoding` option changes pixels only,
and within the bounds its docstring gives."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

import pipeline
from pipeline.stages import device_decode
from tests.conftest import assert_same_batches, build_or_skip

SIZE = 64  # DCT scaling applies to the photos' larger windows at this size
STREAMS = {"train": 12, "validation": None}  # train: two epochs (caches filled, then hit)

# Each Performance option set away from its default (record_cache_dir: see below).
NEUTRAL = [
  ("num_threads", 1),
  ("num_threads", 3),
  ("num_workers", 1),
  ("prefetch", 1),
  ("prefetch", 5),
  ("read_ahead", 1),
  ("read_ahead", 6),
  ("read_ahead_mb", 0.01),  # a few records at a time
  ("record_cache_mb", 0.0),
  ("record_cache_mb", 64.0),
  ("max_requests_per_s", 500.0),
  ("stats_every_s", 0.001),
  ("read_deadline_s", 300.0),
  ("worker_jax", True),
  ("memory_mb", 80.0),  # the read-ahead shrunk from 256 MB to ~10 (pipeline.host.memory)
]
# Each Decoding option: (value away from its default, bound on the mean absolute difference per
# pixel value)
PIXELS = [
  ("cache_mb", 64.0, 16),
  ("dct_scaling", False, 16),
  ("fast_dct", True, 3),
  ("on", "device", 16),  # full-resolution windows: dct_scaling=False's pixels (device_decode)
]


def batches(data_dir, split: str, decoding=None, **performance) -> list[dict]:
  ds = pipeline.make_dataset(
    data_dir,
    split,
    batch_size=8,
    train=split == "train",
    image_size=SIZE,
    performance=performance,
    decoding=decoding,
  )
  return list(itertools.islice(iter(ds), STREAMS[split]))


@pytest.fixture(scope="module")
def defaults(photos_dir) -> dict[str, list[dict]]:
  return {split: batches(photos_dir, split) for split in STREAMS}


def test_every_option_is_tested_performances_as_neutral_decodings_as_changing_pixels():
  fields = {f.name for f in dataclasses.fields(pipeline.Performance)}
  assert {name for name, _ in NEUTRAL} | {"record_cache_dir"} == fields
  assert {name for name, *_ in PIXELS} == {f.name for f in dataclasses.fields(pipeline.Decoding)}


@pytest.mark.parametrize("split", STREAMS)
@pytest.mark.parametrize(("name", "value"), NEUTRAL, ids=[f"{n}={v}" for n, v in NEUTRAL])
def test_a_neutral_option_leaves_every_batch_bitwise_equal(
  photos_dir, defaults, split, name, value
):
  assert_same_batches(batches(photos_dir, split, **{name: value}), defaults[split])


@pytest.mark.parametrize("split", STREAMS)
def test_the_disk_record_cache_filled_and_read_leaves_every_batch_bitwise_equal(
  photos_dir, defaults, split, tmp_path
):
  for _ in ("filled", "read"):
    got = batches(photos_dir, split, record_cache_dir=str(tmp_path), record_cache_mb=0.0)
    assert_same_batches(got, defaults[split])
  assert any(tmp_path.rglob("*")), "nothing was kept on disk"


@pytest.mark.parametrize(("name", "value", "bound"), PIXELS, ids=[n for n, *_ in PIXELS])
def test_a_pixel_option_changes_pixels_only_and_within_its_bound(
  photos_dir, defaults, name, value, bound
):
  if name == "on":
    check = lambda: device_decode.check(pipeline.Decoding(on=value))
    build_or_skip("nvImageCodec (the gpu extra)", check, ValueError)
  changed = batches(photos_dir, "train", decoding={name: value})
  assert len(changed) == len(defaults["train"])
  for got, want in zip(changed, defaults["train"]):
    assert got.keys() == want.keys()
    for key in got.keys() - {"image"}:
      np.testing.assert_array_equal(got[key], want[key])
    assert got["image"].shape == want["image"].shape and got["image"].dtype == np.uint8
  got = np.concatenate([b["image"] for b in changed]).astype(int)
  want = np.concatenate([b["image"] for b in defaults["train"]]).astype(int)
  assert 0 < np.abs(got - want).mean() < bound
