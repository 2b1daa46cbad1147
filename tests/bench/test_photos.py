"""`python -m bench photos`: JPEGs of ImageNet's sizes, the same bytes for the same seed."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np

from bench import photos


def digests(folder: pathlib.Path) -> dict[str, str]:
  return {
    str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
    for p in sorted(folder.rglob("*.jpg"))
  }


def test_the_same_seed_writes_the_same_photos_and_another_seed_others(tmp_path):
  for name, seed in (("a", 0), ("b", 0), ("c", 1)):
    photos.make(str(tmp_path / name), num_images=6, seed=seed, workers=1)
  first = digests(tmp_path / "a")
  assert len(first) == 6
  assert digests(tmp_path / "b") == first
  assert set(digests(tmp_path / "c").values()).isdisjoint(first.values())


def test_sizes_are_drawn_like_imagenets():
  rng = np.random.default_rng(0)
  sizes = np.array([photos.imagenet_size(rng) for _ in range(2000)])
  longest = sizes.max(1)
  assert 0.8 < (longest == photos.LONG_SIDE).mean() < 0.9  # most: a long side of 500 px
  assert 0.01 < (longest > photos.LONG_SIDE).mean() < 0.06  # a few large ones
  assert 430 < sizes[:, 0].mean() < 490 and 360 < sizes[:, 1].mean() < 420
