"""`verify`: re-reads a converted dataset and names every shard and record that is wrong."""

from __future__ import annotations

import shutil

import pytest

from pipeline.catalog import manifest, records
from pipeline.convert import __main__ as cli
from pipeline.convert import shards, verify


@pytest.fixture
def dataset(photos_dir, tmp_path):
  """A private copy of the converted photos, safe to damage."""
  return shutil.copytree(photos_dir, tmp_path / "photos")


def first_train_shard(data_dir):
  return data_dir / manifest.load(data_dir).splits["train"].shards[0].file


def test_a_good_dataset_verifies(dataset, capsys):
  report = verify.verify(dataset, workers=1, progress=False)
  assert report.ok, str(report)
  assert report.num_records == {"train": 48, "validation": 16}
  assert cli.main(["verify", str(dataset), "--no-progress", "--workers", "2"]) == 0
  assert "OK" in capsys.readouterr().out


def test_a_flipped_bit_is_caught_and_named(dataset, capsys):
  shard = first_train_shard(dataset)
  data = bytearray(shard.read_bytes())
  data[len(data) // 3] ^= 0x04  # inside some record's JPEG payload
  shard.write_bytes(bytes(data))
  report = verify.verify(dataset, workers=1, progress=False)
  assert not report.ok
  assert any(p.startswith(f"{shard.name}: sha256") for p in report.problems)
  assert cli.main(["verify", str(dataset), "--no-progress"]) == 1
  assert shard.name in capsys.readouterr().out


def test_a_truncated_shard_is_caught(dataset):
  shard = first_train_shard(dataset)
  shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
  report = verify.verify(dataset, workers=1, progress=False)
  assert not report.ok
  assert all(p.startswith(shard.name) for p in report.problems), report.problems
  assert any("unreadable" in p or "sha256" in p for p in report.problems)


def test_a_missing_shard_and_wrong_counts_are_caught(dataset):
  m = manifest.load(dataset)
  (dataset / m.splits["validation"].shards[0].file).unlink()
  m.splits["train"].num_records += 1
  (dataset / manifest.FILENAME).unlink()
  manifest.save(m, dataset)
  problems = verify.verify(dataset, workers=1, progress=False).problems
  assert f"{m.splits['validation'].shards[0].file}: missing" in problems
  assert "manifest: split train has 49 records but its shards hold 48" in problems


def test_bad_records_are_named_by_shard_and_index(photos_raw, tmp_path):
  image = next(photos_raw.rglob("*.jpg")).read_bytes()
  out = tmp_path / "made"
  out.mkdir()
  shard = shards.AtomicShard(str(out), "train.array_record-00000-of-00001")
  shard.write(records.encode(image, 1, "fine.jpg"))
  shard.write(records.encode(image, 7, "label_too_big.jpg"))
  shard.write(records.encode(image[:5000], 0, "truncated.jpg"))
  shard.write(b"\x00garbage")
  count, digest, *_ = shard.commit()
  manifest.save(
    manifest.Manifest(
      classes=["a", "b"],
      splits={
        "train": manifest.Split(
          count, [manifest.Shard("train.array_record-00000-of-00001", count, digest)]
        )
      },
    ),
    out,
  )
  problems = verify.verify(out, workers=1, progress=False).problems
  name = "train.array_record-00000-of-00001"
  assert problems[0] == f"{name} record 1: label 7 out of range [0, 2)"
  assert problems[1].startswith(f"{name} record 2: image does not decode")
  assert problems[2].startswith(f"{name} record 3: not a tf.train.Example")
  assert len(problems) == 3


def test_a_folder_without_manifest_is_reported(tmp_path):
  report = verify.verify(tmp_path, progress=False)
  assert not report.ok and report.problems[0].startswith("manifest:")
