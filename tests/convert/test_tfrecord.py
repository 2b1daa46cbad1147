"""`pipeline.convert.tfrecord`: TFRecord files become ArrayRecord shards by copying bytes."""

from __future__ import annotations

import os
import struct

import pytest
from array_record.python import array_record_module

from pipeline.catalog import manifest, records
from pipeline.convert import tfrecord
from tests.convert.test_images import read_shard

OTHER_KEYS = records.Keys(image="data", label="category", filename="name")


def write_tfrecord(path, payloads: list[bytes]) -> None:
  """The TFRecord format, written here from its specification (little-endian, masked CRC)."""
  with open(path, "wb") as f:
    for data in payloads:
      length = struct.pack("<Q", len(data))
      f.write(length + struct.pack("<I", tfrecord.masked_crc32c(length)))
      f.write(data + struct.pack("<I", tfrecord.masked_crc32c(data)))


def photos_tfrecord(photos_dir, folder) -> str:
  """The `photos_dir` fixture's train records as one TFRecord file in `folder`: its path."""
  path = folder / "in.tfrecord"
  write_tfrecord(path, [r for p in sorted(photos_dir.glob("train.*")) for r in read_shard(p)])
  return str(path)


def read_all(data_dir) -> list[bytes]:
  m = manifest.load(data_dir)
  out = []
  for path in m.shard_paths(data_dir, "train"):
    reader = array_record_module.ArrayRecordReader(str(path))
    out += reader.read_all()
    reader.close()
  return out


@pytest.fixture(scope="module")
def examples(photos_raw) -> list[bytes]:
  """40 real photo records with a foreign schema (data/category/name), labels 0..3."""
  files = sorted(photos_raw.rglob("*.jpg"))[:40]
  return [records.encode(f.read_bytes(), i % 4, f.name, OTHER_KEYS) for i, f in enumerate(files)]


def test_crc32c_matches_published_check_values():
  assert tfrecord.crc32c(b"123456789") == 0xE3069283
  assert tfrecord.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4
  assert tfrecord.crc32c(b"\xff" * 32) == 0x62A8AB43
  assert tfrecord.crc32c(bytes(range(32))) == 0x46DD794E
  # The vectorized path (long inputs, any length) agrees with the bytewise one.
  data = os.urandom(70_001)
  short = 0xFFFFFFFF
  for b in data:
    short = tfrecord._TABLE_LIST[(short ^ b) & 0xFF] ^ (short >> 8)
  assert tfrecord.crc32c(data) == short ^ 0xFFFFFFFF
  for n in (255, 256, 257, 1000, 4099):
    expected = 0xFFFFFFFF
    for b in data[:n]:
      expected = tfrecord._TABLE_LIST[(expected ^ b) & 0xFF] ^ (expected >> 8)
    assert tfrecord.crc32c(data[:n]) == expected ^ 0xFFFFFFFF, n


def test_records_are_copied_byte_for_byte_in_order(examples, tmp_path):
  write_tfrecord(tmp_path / "train-00000-of-00002", examples[:25])
  write_tfrecord(tmp_path / "train-00001-of-00002", examples[25:])
  m = tfrecord.convert(
    tfrecord.Request(str(tmp_path / "train-*"), tmp_path / "out", num_classes=4, shard_size_mb=1),
    workers=2,
    progress=False,
  )
  assert read_all(tmp_path / "out") == examples
  assert m.keys == OTHER_KEYS  # detected from the first record
  assert m.classes == ["0", "1", "2", "3"]
  assert m.splits["train"].num_records == 40 and len(m.splits["train"].shards) >= 2
  assert m.created_by["tool"] == "pipeline.convert tfrecord"


def test_class_names_from_a_file(examples, tmp_path):
  write_tfrecord(tmp_path / "a.tfrecord", examples[:8])
  (tmp_path / "classes.txt").write_text("ant\nbee\ncat\ndog\n")
  m = tfrecord.convert(
    tfrecord.Request(
      str(tmp_path / "*.tfrecord"), tmp_path / "out", classes=tmp_path / "classes.txt"
    ),
    workers=1,
    progress=False,
  )
  assert m.classes == ["ant", "bee", "cat", "dog"]
  with pytest.raises(ValueError, match="needs the class count"):
    tfrecord.convert(
      tfrecord.Request(str(tmp_path / "*.tfrecord"), tmp_path / "o2"), progress=False
    )


def test_label_out_of_range_is_an_error_naming_file_and_record(examples, tmp_path):
  write_tfrecord(tmp_path / "a.tfrecord", examples[:10])
  with pytest.raises(records.RecordError, match=r"a.tfrecord:3: label 3 out of range \[0, 3\)"):
    tfrecord.convert(
      tfrecord.Request(str(tmp_path / "a.tfrecord"), tmp_path / "out", num_classes=3),
      workers=1,
      progress=False,
    )


def test_corrupt_data_checksum_names_file_and_record(examples, tmp_path):
  path = tmp_path / "a.tfrecord"
  write_tfrecord(path, examples[:5])
  data = bytearray(path.read_bytes())
  second = 16 + len(examples[0])
  data[second + 12 + 100] ^= 0x01  # one bit inside record 1's payload
  path.write_bytes(bytes(data))
  with pytest.raises(tfrecord.TFRecordError, match=r"record 1 at byte \d+: data checksum"):
    tfrecord.convert(
      tfrecord.Request(str(path), tmp_path / "out", num_classes=4), workers=1, progress=False
    )


def test_truncated_file_and_bad_length_checksum_are_errors(examples, tmp_path):
  path = tmp_path / "a.tfrecord"
  write_tfrecord(path, examples[:3])
  whole = path.read_bytes()
  path.write_bytes(whole[:-50])
  with pytest.raises(tfrecord.TFRecordError, match=r"record 2 at byte \d+: truncated record"):
    tfrecord.convert(tfrecord.Request(str(path), tmp_path / "out", num_classes=4), progress=False)
  path.write_bytes(whole[:8] + b"\0\0\0\0" + whole[12:])
  with pytest.raises(tfrecord.TFRecordError, match="record 0 at byte 0: length checksum"):
    tfrecord.convert(tfrecord.Request(str(path), tmp_path / "out", num_classes=4), progress=False)
  with pytest.raises(FileNotFoundError, match="no TFRecord files match"):
    tfrecord.convert(tfrecord.Request(str(tmp_path / "missing-*"), tmp_path / "out", num_classes=4))


def test_records_whose_image_does_not_decode_are_skipped_and_listed(examples, tmp_path):
  image, label, name = records.parse(examples[0], OTHER_KEYS)
  broken = records.encode(image[: len(image) // 2], label, name, OTHER_KEYS)
  write_tfrecord(tmp_path / "a.tfrecord", [examples[1], broken, examples[2]])
  m = tfrecord.convert(
    tfrecord.Request(str(tmp_path / "a.tfrecord"), tmp_path / "out", num_classes=4),
    workers=1,
    progress=False,
  )
  assert read_all(tmp_path / "out") == [examples[1], examples[2]]
  assert [s["path"] for s in m.skipped] == [f"{tmp_path / 'a.tfrecord'}:1"]
  assert m.skipped[0]["reason"].startswith("truncated or corrupt JPEG")


def test_unparseable_record_is_an_error(tmp_path):
  write_tfrecord(tmp_path / "a.tfrecord", [records.encode(b"x", 0), b"\xff\xff not a proto"])
  with pytest.raises(records.RecordError, match="a.tfrecord:1: not a tf.train.Example"):
    tfrecord.convert(
      tfrecord.Request(
        str(tmp_path / "a.tfrecord"), tmp_path / "out", num_classes=1, keys=records.DEFAULT_KEYS
      ),
      progress=False,
    )
