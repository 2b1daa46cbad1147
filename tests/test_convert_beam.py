"""The Apache Beam conversion writes the very same shards as the local converter."""

from __future__ import annotations

import pytest

from pipeline.convert import beam as convert_beam  # imports apache_beam only when it runs
from pipeline.convert import images, tfrecord

pytest.importorskip("apache_beam", reason="optional extra: pip install '.[beam]'")


def same_files(a, b) -> None:
  names = sorted(p.name for p in a.iterdir())
  assert names == sorted(p.name for p in b.iterdir())
  for name in names:
    assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_beam_image_conversion_matches_the_local_one(photos_raw, tmp_path):
  local = images.convert(
    photos_raw, tmp_path / "local", val_fraction=0.25, shard_size_mb=1, workers=1, progress=False
  )
  on_beam = convert_beam.convert_images(
    photos_raw, tmp_path / "beam", runner="DirectRunner", val_fraction=0.25, shard_size_mb=1
  )
  assert on_beam == local and len(local.splits["train"].shards) > 1
  same_files(tmp_path / "local", tmp_path / "beam")


def test_beam_tfrecord_conversion_matches_the_local_one(photos_dir, tmp_path):
  from tests.test_convert_tfrecord import photos_tfrecord

  source = photos_tfrecord(photos_dir, tmp_path)
  local = tfrecord.convert(
    source, tmp_path / "local", num_classes=4, shard_size_mb=1, workers=1, progress=False
  )
  on_beam = convert_beam.convert_tfrecord(source, tmp_path / "beam", num_classes=4, shard_size_mb=1)
  assert on_beam == local
  same_files(tmp_path / "local", tmp_path / "beam")
