"""`pipeline.convert.images`: image folders become verified, deterministic ArrayRecord shards."""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import time
import zlib

import numpy as np
import pytest
from array_record.python import array_record_module
from PIL import Image

from pipeline.catalog import manifest, records
from pipeline.convert import images, shards
from pipeline.image import decode
from tests.conftest import REPO, linked_photos, run_command
from tests.convert.test_faults import CONVERT_IMAGES, convert_cmd


def read_shard(path) -> list[bytes]:
  reader = array_record_module.ArrayRecordReader(str(path))
  try:
    return list(reader.read_all())
  finally:
    reader.close()


def read_split(data_dir, split: str) -> list[tuple[bytes, int, str]]:
  m = manifest.load(data_dir)
  return [records.parse(r, m.keys) for p in m.shard_paths(data_dir, split) for r in read_shard(p)]


def jpeg(shape=(40, 60, 3), seed=0, mode="RGB", **save) -> bytes:
  pixels = np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(pixels).convert(mode).save(buf, "JPEG", **save)
  return buf.getvalue()


def png(shape=(40, 60, 3), seed=0) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)).save(
    buf, "PNG"
  )
  return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
  """A tiny PNG whose header (with a valid CRC) claims a huge size: a decompression bomb."""
  data = bytearray(png((4, 4, 3)))
  ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
  data[16:24] = struct.pack(">II", width, height)
  data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
  return bytes(data)


def write(path: pathlib.Path, data: bytes) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data)


def test_photos_become_shards_with_manifest_and_untouched_jpeg_bytes(photos_raw, photos_dir):
  m = manifest.load(photos_dir)
  assert m.classes == ["astronaut", "chelsea", "coffee", "rocket"]
  assert (m.splits["train"].num_records, m.splits["validation"].num_records) == (48, 16)
  for split in m.splits.values():
    for shard in split.shards:
      path = photos_dir / shard.file
      assert shard.file.split(".array_record-")[0] in m.splits
      assert shards.sha256_file(path) == shard.sha256
      reader = array_record_module.ArrayRecordReader(str(path))
      assert "group_size:1," in reader.writer_options_string()
      assert "uncompressed" in reader.writer_options_string()
      assert reader.num_records() == shard.num_records
      reader.close()
  seen = set()
  for split in m.splits:
    for image, label, filename in read_split(photos_dir, split):
      assert m.classes[label] == filename.split("/")[0]
      assert image == (photos_raw / filename).read_bytes()  # JPEG bytes stored untouched
      seen.add(filename)
  assert len(seen) == 64
  assert m.created_by["tool"] == "pipeline.convert images"
  assert m.created_by["source"] == str(photos_raw)
  assert m.skipped == []


def test_validation_split_is_per_class_disjoint_and_seeded(photos_raw, photos_dir, tmp_path):
  train = {f for _, _, f in read_split(photos_dir, "train")}
  val = [f for _, _, f in read_split(photos_dir, "validation")]
  assert not train & set(val)
  counts = {c: sum(f.startswith(c + "/") for f in val) for c in manifest.load(photos_dir).classes}
  assert set(counts.values()) == {4}  # 25% of each 16-image class
  other = images.convert(
    images.Request(photos_raw, tmp_path / "seed1", val_fraction=0.25, seed=1),
    workers=1,
    progress=False,
  )
  assert other.splits["validation"].num_records == 16
  assert {f for _, _, f in read_split(tmp_path / "seed1", "validation")} != set(val)


@pytest.mark.parametrize(
  "shard_size_mb", [0.5, 64], ids=["workers-write-shards", "workers-check-records"]
)
def test_output_is_byte_identical_for_any_worker_count(photos_raw, tmp_path, shard_size_mb):
  for workers in (1, 2):
    images.convert(
      images.Request(photos_raw, tmp_path / f"w{workers}", shard_size_mb=shard_size_mb),
      workers=workers,
      progress=False,
    )
  files = sorted(p.name for p in (tmp_path / "w1").iterdir())
  assert len(files) == (12 if shard_size_mb < 1 else 2)  # shards + manifest.json
  assert files == sorted(p.name for p in (tmp_path / "w2").iterdir())
  for name in files:
    assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_shards_are_sized_by_bytes_and_named_like_tfds(photos_raw, tmp_path):
  m = images.convert(
    images.Request(photos_raw, tmp_path / "out", shard_size_mb=1), workers=1, progress=False
  )
  total = sum(p.stat().st_size for p in photos_raw.rglob("*.jpg"))
  names = [s.file for s in m.splits["train"].shards]
  assert len(names) == -(-total // (1 << 20))
  assert names[0] == f"train.array_record-00000-of-{len(names):05d}"
  sizes = [(tmp_path / "out" / n).stat().st_size for n in names]
  assert max(sizes) < 1.5 * (1 << 20) and min(sizes) > 0.5 * (1 << 20)
  assert not any(p.name.startswith(".") for p in (tmp_path / "out").iterdir())


@pytest.fixture
def messy(tmp_path) -> pathlib.Path:
  """A folder with every kind of input the converter must accept, re-encode or skip."""
  src = tmp_path / "src"
  good = jpeg(seed=1)
  write(src / "cat" / "good.jpg", good)
  write(src / "cat" / "gray.jpg", jpeg(mode="L", seed=2))
  write(src / "cat" / "cmyk.jpg", jpeg(mode="CMYK", seed=3))
  write(src / "cat" / "png_named.jpg", png(seed=4))
  write(src / "cat" / "real.png", png(seed=5))
  write(src / "cat" / "progressive.jpg", jpeg(seed=6, progressive=True))
  exif = Image.Exif()
  exif[0x0112] = 6  # orientation: rotate 90 degrees
  write(src / "cat" / "rotated.jpg", jpeg(seed=7, exif=exif.tobytes()))
  write(src / "dog" / "empty.jpg", b"")
  write(src / "dog" / "truncated.jpg", good[: len(good) // 2])
  write(src / "dog" / "truncated.png", png(seed=8)[:200])
  write(src / "dog" / "notes.txt", b"not an image at all\n")
  write(src / "dog" / "bomb.png", png_claiming(20000, 20000))
  bomb = bytearray(jpeg(seed=9))
  sof = bomb.index(b"\xff\xc0")
  bomb[sof + 5 : sof + 9] = struct.pack(">HH", 30000, 30000)  # height, width in the SOF0 frame
  write(src / "dog" / "bomb.jpg", bytes(bomb))
  write(src / "dog" / "ok.jpg", jpeg(seed=10))
  write(src / "stray.jpg", jpeg(seed=11))
  write(tmp_path / "outside" / "elsewhere.jpg", jpeg(seed=12))
  os.symlink(tmp_path / "outside" / "elsewhere.jpg", src / "dog" / "link_out.jpg")
  os.symlink(src / "cat" / "good.jpg", src / "dog" / "link_in.jpg")
  return src


def test_bad_inputs_are_skipped_with_reasons_and_odd_ones_reencoded(messy, tmp_path):
  (messy / "empty_class").mkdir()  # refused, unless a label map numbers it
  classes = ["cat", "dog", "empty_class"]
  m = images.convert(
    images.Request(messy, tmp_path / "out", label_map=classes), workers=1, progress=False
  )
  skipped = {s["path"]: s["reason"] for s in m.skipped}
  assert skipped["dog/empty.jpg"] == "empty file"
  assert skipped["dog/truncated.jpg"].startswith("truncated or corrupt JPEG")
  assert skipped["dog/truncated.png"].startswith("truncated or corrupt image")
  assert skipped["dog/notes.txt"].startswith("not an image")
  assert skipped["dog/bomb.png"].startswith("decompression bomb")
  assert skipped["dog/bomb.jpg"].startswith("decompression bomb: 30000x30000")
  assert skipped["dog/link_out.jpg"].startswith("symlink outside the source folder")
  assert skipped["empty_class/"] == "empty class folder"
  assert skipped["stray.jpg"] == "not in a class folder"
  assert skipped["dog/link_in.jpg"].startswith("same file as cat/good.jpg in class cat")
  assert len(skipped) == 10
  assert m.classes == ["cat", "dog", "empty_class"]

  stored = {f: (image, label) for image, label, f in read_split(tmp_path / "out", "train")}
  assert sorted(stored) == [
    "cat/cmyk.jpg",
    "cat/good.jpg",
    "cat/gray.jpg",
    "cat/png_named.jpg",
    "cat/progressive.jpg",
    "cat/real.png",
    "cat/rotated.jpg",
    "dog/ok.jpg",
  ]
  for name in ("cat/good.jpg", "cat/gray.jpg", "cat/progressive.jpg", "cat/rotated.jpg"):
    assert stored[name][0] == (messy / name).read_bytes()  # untouched, EXIF tag and all
  assert stored["cat/good.jpg"][1] == 0  # its one label, not also dog's through the link
  reencoded = {r["path"]: r["reason"] for r in m.created_by["reencoded"]}
  assert sorted(reencoded) == ["cat/cmyk.jpg", "cat/png_named.jpg", "cat/real.png"]
  assert reencoded["cat/cmyk.jpg"].startswith("jpeg CMYK")
  assert reencoded["cat/png_named.jpg"].startswith("png RGB")
  for name in reencoded:
    image = Image.open(io.BytesIO(stored[name][0]))
    assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (60, 40))
  line = shards.summary(m)
  assert "train: 8 records" in line and "skipped 10" in line and "re-encoded 3" in line
  assert "2 decompression bomb" in line and "1 empty class folder" in line


def test_a_jpeg_libjpeg_decodes_with_a_warning_is_stored_untouched(photos_raw, tmp_path):
  photo = next(photos_raw.rglob("*.jpg")).read_bytes()
  strays = {}
  for marker in (b"\xff\xdb", b"\xff\xc4", b"\xff\xda"):  # before DQT, DHT, SOS
    at = photo.index(marker)
    strays[marker.hex()] = photo[:at] + b"\x00" + photo[at:]
    write(tmp_path / "src" / "a" / f"{marker.hex()}.jpg", strays[marker.hex()])
  m = images.convert(images.Request(tmp_path / "src", tmp_path / "out"), workers=1, progress=False)
  assert m.created_by["reencoded"] == [] and m.skipped == []
  stored = {f: image for image, _, f in read_split(tmp_path / "out", "train")}
  assert stored == {f"a/{name}.jpg": data for name, data in strays.items()}
  assert all((decode.decode(data) == decode.decode(photo)).all() for data in stored.values())


def test_symlinks_outside_source_are_followed_only_when_asked(messy, tmp_path):
  m = images.convert(
    images.Request(messy, tmp_path / "out", follow_symlinks=True), workers=1, progress=False
  )
  assert "dog/link_out.jpg" not in {s["path"] for s in m.skipped}
  assert m.splits["train"].num_records == 9


def test_max_size_reencodes_only_large_images(tmp_path):
  write(tmp_path / "src" / "a" / "big.jpg", jpeg((300, 200, 3)))
  write(tmp_path / "src" / "a" / "small.jpg", jpeg((90, 120, 3)))
  m = images.convert(
    images.Request(tmp_path / "src", tmp_path / "out", max_size=100), workers=1, progress=False
  )
  stored = {f: Image.open(io.BytesIO(b)).size for b, _, f in read_split(tmp_path / "out", "train")}
  assert stored == {"a/big.jpg": (100, 150), "a/small.jpg": (120, 90)}
  assert [r["path"] for r in m.created_by["reencoded"]] == ["a/big.jpg"]


def test_pixel_limit_is_configurable(tmp_path):
  write(tmp_path / "src" / "a" / "x.jpg", jpeg((400, 500, 3)))
  write(tmp_path / "src" / "a" / "y.jpg", jpeg((40, 60, 3)))
  m = images.convert(
    images.Request(tmp_path / "src", tmp_path / "out", max_pixels=100_000),
    workers=1,
    progress=False,
  )
  assert m.skipped == [
    {"path": "a/x.jpg", "reason": "decompression bomb: 500x400 pixels > limit 100000"}
  ]


def test_label_map_orders_classes_and_rejects_bad_maps(tmp_path):
  for name in ("cat", "dog"):
    write(tmp_path / "src" / name / "x.jpg", jpeg())
  json_map = tmp_path / "map.json"
  json_map.write_text(json.dumps({"dog": 0, "cat": 1, "bird": 2}))
  m = images.convert(
    images.Request(tmp_path / "src", tmp_path / "out", label_map=json_map),
    workers=1,
    progress=False,
  )
  assert m.classes == ["dog", "cat", "bird"]
  assert {f: label for _, label, f in read_split(tmp_path / "out", "train")} == {
    "cat/x.jpg": 1,
    "dog/x.jpg": 0,
  }
  text_map = tmp_path / "map.txt"
  text_map.write_text("dog\ncat\n")
  assert images.convert(
    images.Request(tmp_path / "src", tmp_path / "out2", label_map=text_map),
    workers=1,
    progress=False,
  ).classes == ["dog", "cat"]
  bad = {
    "unknown class": ({"cat": 0}, r"\['dog'\].*not in the label map"),
    "out of range": ({"cat": 0, "dog": 2}, r"label 2 of class 'dog' is out of range \[0, 2\)"),
    "negative": ({"cat": -1, "dog": 0}, r"out of range"),
    "duplicate": ({"cat": 0, "dog": 0, "x": 1}, r"label 0 used by both"),
    "not an integer": ({"cat": "0", "dog": 1}, r"not an integer"),
  }
  for label_map, message in bad.values():
    with pytest.raises(images.LabelMapError, match=message):
      images.convert(
        images.Request(tmp_path / "src", tmp_path / "bad", label_map=label_map),
        workers=1,
        progress=False,
      )
  assert not (tmp_path / "bad" / "manifest.json").exists()


def test_cli_reports_label_map_errors_with_exit_status(tmp_path):
  write(tmp_path / "src" / "cat" / "x.jpg", jpeg())
  (tmp_path / "map.json").write_text('{"dog": 0}')
  flags = ["--label-map", tmp_path / "map.json", "--no-progress"]
  result = run_command([*CONVERT_IMAGES, tmp_path / "src", tmp_path / "out", *flags], timeout=120)
  assert result.returncode == 2
  assert "error: class folders ['cat']" in result.stderr


def test_finished_conversion_is_not_redone(photos_raw, tmp_path):
  first = images.convert(images.Request(photos_raw, tmp_path / "out"), workers=1, progress=False)
  shard = tmp_path / "out" / first.splits["train"].shards[0].file
  stamp = shard.stat().st_mtime_ns
  assert (
    images.convert(images.Request(photos_raw, tmp_path / "out"), workers=1, progress=False) == first
  )
  assert shard.stat().st_mtime_ns == stamp


def test_resume_after_sigkill_keeps_finished_shards_and_matches(photos_raw, tmp_path):
  src = linked_photos(photos_raw, tmp_path / "src", copies=12)  # 768: the kill lands mid-way
  out, build = tmp_path / "killed", tmp_path / "killed" / shards.BUILD_DIR
  child = subprocess.Popen(
    convert_cmd(src, out, workers=1), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and child.poll() is None:
    if build.is_dir() and len(list(build.glob("train*.done"))) >= 3:
      break
    time.sleep(0.002)
  child.send_signal(signal.SIGKILL)
  child.wait()
  assert not (out / "manifest.json").exists(), "the conversion finished before the kill"
  done = {p.stem: (build / p.stem).stat().st_mtime_ns for p in build.glob("*.done")}
  assert len(done) >= 3

  resumed = images.convert(
    images.Request(src, out, shard_size_mb=0.5, val_fraction=0.1), workers=2, progress=False
  )
  whole = images.convert(
    images.Request(src, tmp_path / "whole", shard_size_mb=0.5, val_fraction=0.1),
    workers=1,
    progress=False,
  )
  assert resumed == whole
  for name, stamp in done.items():
    assert (out / name).stat().st_mtime_ns == stamp, f"{name} was redone"
  names = sorted(p.name for p in out.iterdir())
  assert names == sorted(p.name for p in (tmp_path / "whole").iterdir())
  for name in names:
    assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_stale_shards_of_an_earlier_conversion_are_removed(photos_raw, tmp_path):
  images.convert(
    images.Request(photos_raw, tmp_path / "out", shard_size_mb=1), workers=1, progress=False
  )
  m = images.convert(
    images.Request(photos_raw, tmp_path / "out", shard_size_mb=4, overwrite=True),
    workers=1,
    progress=False,
  )
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
    ["manifest.json"] + [s.file for s in m.splits["train"].shards]
  )


def test_missing_source_and_no_classes_are_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not found"):
    images.convert(images.Request(tmp_path / "nope", tmp_path / "out"), progress=False)
  (tmp_path / "flat").mkdir()
  write(tmp_path / "flat" / "x.jpg", jpeg())
  with pytest.raises(ValueError, match="no class folders"):
    images.convert(images.Request(tmp_path / "flat", tmp_path / "out"), progress=False)
  shutil.rmtree(tmp_path / "flat")
