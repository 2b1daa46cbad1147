"""Hostile bytes (issue 20): rare JPEG modes, hidden frames, and the pixel limit.

Every input here once crashed a decoder, fooled a guard or cost gigabytes. Decoding that could
crash runs in a child process, so a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from etils import epath
from PIL import Image

from pipeline.catalog import manifest, records
from pipeline.convert import checks, images, shards
from pipeline.image import augment, decode, fallback
from pipeline.stages.decode import batch_decoder
from pipeline.storage import backend
from pipeline.storage.source import ShardedSource
from tests import jpeg_modes

ROOT = pathlib.Path(__file__).resolve().parents[2]
NATIVE = decode.native()


def run_child(code: str, memory: int = 1 << 30, timeout: float = 60) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh interpreter with at most `memory` bytes of address space."""
  prelude = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
  return subprocess.run(
    [sys.executable, "-c", prelude + textwrap.dedent(code)],
    cwd=ROOT,
    # one malloc arena: each new thread's would reserve 64 MB of the capped address space
    env={**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "1"},
    capture_output=True,
    text=True,
    timeout=timeout,
  )


# --- rare JPEG modes ------------------------------------------------------------------------


def test_rare_jpeg_modes_decode_or_are_refused_without_crashing():
  """Lossless RGB went through simplejpeg's scaled decode (conversion's check), was stored as
  is, and corrupted the heap: SIGSEGV at exit or at the next call. Now Pillow decodes it and
  conversion stores it re-encoded, or the mode is refused."""
  child = run_child("""
    import json, sys
    from pipeline.image import decode
    from pipeline.convert import checks
    from tests.jpeg_modes import RARE
    for name, data in sorted(RARE.items()):
      print(json.dumps({"trying": name}), flush=True)  # names the input if the next call dies
      out = {"name": name}
      for path, fn in [("prepare", lambda: checks.prepare(data)[1]),
                       ("decode", lambda: decode.decode(data).shape),
                       ("crop", lambda: decode.decode_crop(data, (0, 0, 4, 4), 2).shape),
                       ("stored", lambda: checks.decode_rgb(data).shape)]:
        try:
          out[path] = str(fn())
        except (checks.BadImage, decode.DecodeError) as e:
          out[path] = "refused: " + str(e)
      print(json.dumps(out), flush=True)
    """)
  lines = [json.loads(line) for line in child.stdout.splitlines()]
  died_on = lines[-1].get("trying", "exit (heap corrupted earlier)") if lines else "start"
  assert child.returncode == 0, f"rc {child.returncode} at {died_on}:\n{child.stderr[-2000:]}"
  results = [r for r in lines if "name" in r]
  assert sorted(r["name"] for r in results) == sorted(jpeg_modes.RARE)
  for out in results:
    if not out["prepare"].startswith("refused"):  # stored re-encoded: decodes everywhere
      assert "jpeg" in out["prepare"], out
      assert out["decode"] == "(8, 8, 3)", out


def test_plain_jpegs_are_told_from_rare_ones_by_their_frame():
  assert not any(decode.plain_jpeg(d) for d in jpeg_modes.RARE.values())
  assert decode.plain_jpeg(jpeg_modes.sequential(8, 0xC0))
  assert decode.jpeg_frame(jpeg_modes.lossless(ids=b"RGB")) == (0xC3, 8, 8, 8)
  # behind `FF 00 LL LL`, skipped as libjpeg skips them: the frame libjpeg decodes
  assert decode.jpeg_frame(jpeg_modes.hidden_frame_bomb()) == (0xC2, 8, 65500, 65500)
  if NATIVE is not None:  # the C walker and its Python twin find the same frame
    for data in [*jpeg_modes.RARE.values(), jpeg_modes.hidden_frame_bomb()]:
      assert NATIVE.frame(data) == fallback.frame(data)
    # and the C decoder itself refuses what libjpeg reads as lossless or 12-bit
    for name, why in [("lossless_rgb", "lossless JPEG"), ("extended12", "12-bit JPEG")]:
      with pytest.raises(ValueError, match=f"{why} \\(not for this decoder"):
        NATIVE.decode_crop(jpeg_modes.RARE[name], 0, 0, 4, 4, 1)


def test_a_lossless_jpeg_is_reencoded_and_a_12_bit_one_skipped_by_convert(tmp_path, run_python):
  src = tmp_path / "src" / "a"
  src.mkdir(parents=True)
  (src / "plain.jpg").write_bytes(jpeg_modes.sequential(8, 0xC0))
  (src / "lossless.jpg").write_bytes(jpeg_modes.lossless(ids=b"RGB"))
  (src / "deep.jpg").write_bytes(jpeg_modes.sequential(12, 0xC1))
  done = run_python("-m", "pipeline.convert", "images", str(tmp_path / "src"), str(tmp_path / "o"))
  assert done.returncode == 0, done.stdout + done.stderr
  m = json.loads((tmp_path / "o" / "manifest.json").read_text())
  assert m["splits"]["train"]["num_records"] == 2
  assert m["skipped"] == [
    {"path": "a/deep.jpg", "reason": "unsupported 12-bit JPEG: Pillow cannot decode it"}
  ]
  assert [(r["path"], r["reason"]) for r in m["created_by"]["reencoded"]] == [
    ("a/lossless.jpg", "jpeg RGB: lossless jpeg")
  ]


# --- bytes between header segments, and the end-of-image marker (issue 31) ------------------


def _jpegs() -> dict[str, bytes]:
  """Small real JPEGs in the flavours the C decoder takes."""
  rng = np.random.default_rng(31)
  pixels = np.linspace(0, 200, 64)[None, :, None] + rng.normal(0, 40, (48, 64, 3))
  image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
  flavours = {
    "baseline": dict(quality=90),
    "444": dict(quality=95, subsampling=0),
    "progressive": dict(progressive=True),
    "restart": dict(restart_marker_blocks=1),
    "gray": dict(),
  }
  out = {}
  for name, options in flavours.items():
    buf = io.BytesIO()
    (image.convert("L") if name == "gray" else image).save(buf, "JPEG", **options)
    out[name] = buf.getvalue()
  return out


JPEGS = _jpegs()
STRAYS = [b"\x41", b"\x00", b"\xff\x00", b"\x12\x34\x56"]  # `FF 00`: skipped as a pair


def with_strays(data: bytes):
  """(where, `data` with stray bytes before one of its header segments), for every segment
  before the image data (up to SOS) of a well-formed JPEG and every kind of stray bytes."""
  at = 2
  while True:
    marker, length = data[at + 1], int.from_bytes(data[at + 2 : at + 4], "big")
    for stray in STRAYS:
      yield f"{stray.hex()} before {marker:#x} at {at}", data[:at] + stray + data[at:]
    if marker == 0xDA:
      return
    at += 2 + length


def pillow(data: bytes) -> np.ndarray:
  """What libjpeg gives (Pillow decodes with it and ignores its warnings)."""
  return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def batch_windows(*datas: bytes) -> tuple[list, list]:
  """The native batch path on records of `datas`, all drawn as the same example: what it
  handed back, and each decoded (mirrored, cropped) window."""
  head = augment.Head(32, train=True)
  n, slot = len(datas), head.slot_bytes()
  same = np.zeros(n, np.int64)
  labels, dims, arena = (
    np.zeros(n, np.int64),
    np.zeros((n, 2), np.int32),
    np.zeros(n * slot, np.uint8),
  )
  decoder = batch_decoder(head, records.Keys(), 7)
  back = decoder([records.encode(d, 1) for d in datas], same, same, labels, dims, arena, 0, n)
  return back, [arena[k * slot : k * slot + h * w * 3].copy() for k, (h, w) in enumerate(dims)]


@pytest.mark.usefixtures("native")
def test_stray_bytes_before_a_header_segment_give_the_pixels_libjpeg_gives():
  """libjpeg skips them with a warning ("Corrupt JPEG data: 1 extraneous bytes before marker
  0xdb") and decodes the same image; the C decoder refused such a JPEG and Pillow served it,
  so a picture had two sets of pixels depending on an ignorable byte."""
  for name, original in JPEGS.items():
    h, w = decode.image_size(original)
    buf, _, _ = NATIVE.decode_crop(original, 0, 0, h, w, 1)
    clean = np.frombuffer(buf, np.uint8).reshape(h, w, 3)  # libjpeg's pixels of the image
    for where, data in with_strays(original):
      if data[2] == 0xFF:  # Pillow takes bytes for a JPEG only if FF D8 FF; libjpeg: FF D8
        np.testing.assert_array_equal(pillow(data), pillow(original))  # libjpeg: same image
      buf, _, _ = NATIVE.decode_crop(data, 0, 0, h, w, 1)
      got = np.frombuffer(buf, np.uint8).reshape(h, w, 3)
      np.testing.assert_array_equal(got, clean, err_msg=f"{name}: {where}")
      back, (want, window) = batch_windows(original, data)
      assert back == [], f"{name}: {where}: handed back {back}"
      np.testing.assert_array_equal(window, want, err_msg=f"{name}: {where}")


def test_stray_bytes_change_no_pixel_on_any_decoder(decoder):
  """The fallback gives a JPEG with stray header bytes the pixels of the same JPEG without."""
  key = augment.example_key(3, 0, 5)
  for name, original in JPEGS.items():
    h, w = decode.image_size(original)
    boxes = [(0, 0, h, w, 1), (8, 16, 32, 40, 2)]
    clean = [decode.decode_crop(original, box[:4], box[4]) for box in boxes]
    trained = augment.Head(32, train=True)(original, key)
    for where, data in with_strays(original):
      for box, want in zip(boxes, clean):
        got = decode.decode_crop(data, box[:4], box[4])
        np.testing.assert_array_equal(got, want, err_msg=f"{name}: {where}, box {box}")
      got = augment.Head(32, train=True)(data, key)
      np.testing.assert_array_equal(got, trained, err_msg=f"{name}: {where}")


def test_a_jpeg_without_its_end_of_image_marker_is_refused_in_words_that_say_so(decoder):
  """It was refused as "Premature end of JPEG file", "End Of Image" (a progressive one) or
  not at all (a window that ends above the last row): now refused, whatever the window."""
  message = (
    "JPEG decode failed: no end-of-image marker (FF D9) after the image data: the JPEG is truncated"
  )
  for name, original in JPEGS.items():
    assert original.endswith(b"\xff\xd9")
    h, w = decode.image_size(original)
    for data in (original[:-2], original[:-2] + bytes(4), original[: len(original) // 2]):
      for box in [(0, 0, h, w), (0, 0, 8, 8)]:
        with pytest.raises(decode.DecodeError) as e:
          decode.decode_crop(data, box)
        assert str(e.value) == message, (name, len(data), box, str(e.value))
      if decoder == "libjpeg-turbo extension":
        back, _ = batch_windows(data)
        assert back == [(0, message)], name
    whole = decode.decode(original)  # bytes after the marker are not the image's: ignored
    np.testing.assert_array_equal(decode.decode(original + b"\x00trailer"), whole)


# --- the pixel limit on the frame libjpeg decodes -------------------------------------------


def test_one_pixel_limit_shared_by_c_and_python():
  assert checks.MAX_PIXELS == decode.MAX_PIXELS == 89_478_485
  if NATIVE is not None:
    assert NATIVE.MAX_PIXELS == decode.MAX_PIXELS


def test_a_frame_hidden_behind_stray_bytes_is_measured_as_libjpeg_reads_it():
  bomb = jpeg_modes.hidden_frame_bomb()  # shows 64x64, decodes as 65500x65500
  with pytest.raises(decode.DecodeError, match="65500x65500 image exceeds"):
    decode.image_size(bomb)
  with pytest.raises(checks.BadImage, match="decompression bomb"):
    checks.prepare(bomb)


@pytest.mark.usefixtures("native")
def test_the_c_decoder_refuses_a_hidden_bomb_before_allocating():
  """A 64x64 crop of the visible frame: libjpeg would size its buffers by the hidden one."""
  child = run_child(
    """
    import resource, time
    from pipeline.image import augment, decode
    from pipeline.stages.decode import batch_decoder
    from tests.jpeg_modes import hidden_frame_bomb
    import numpy as np
    native, bomb = decode.native(), hidden_frame_bomb()
    assert native.header(bomb) == (65500, 65500)
    start = time.process_time()
    try:
      native.decode_crop(bomb, 0, 0, 64, 64, 1)
    except ValueError as e:
      print(e)
    from pipeline.catalog import records
    head = augment.Head(32)
    index, labels = np.zeros(1, np.int64), np.zeros(1, np.int64)
    arena, dims = np.empty(head.slot_bytes(), np.uint8), np.zeros((1, 2), np.int32)
    decoder = batch_decoder(head, records.Keys(), 0)
    print(decoder([records.encode(bomb, 1)], index, index, labels, dims, arena, 0, 1))
    print(time.process_time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)
    """,
    memory=2 << 30,
  )
  assert child.returncode == 0, child.stderr[-2000:]
  refusal, handed_back, cost = child.stdout.splitlines()
  assert "65500x65500 image exceeds the 89478485-pixel limit" in refusal
  assert handed_back == "[(0, None)]"  # the Python path, which refuses it by size
  _, rss_mb = cost.split()  # CPU seconds are printed, not asserted: speed is for benchmarks
  assert int(rss_mb) < 1000  # decoding the frame would take 8.5 GB


# --- out of memory is not corrupt data --------------------------------------------------------


def test_out_of_memory_while_reading_is_an_error_not_a_corrupt_record(tmp_path):
  """array_record's std::bad_alloc surfaced as CorruptRecordsError: `skip` dropped good records."""
  shard = tmp_path / "train.array_record-00000-of-00001"
  writer = ArrayRecordWriter(str(shard), "group_size:1,uncompressed")
  writer.write(b"small")
  writer.write(bytes(96 << 20))
  writer.close()
  child = run_child(
    f"""
    import re, resource
    from pipeline.storage.source import ShardedSource
    source = ShardedSource([{str(shard)!r}], [2])
    assert source.read([0]) == [b"small"]
    size = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
    resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20),) * 2)  # < the 96 MB record
    try:
      source.read([1])
    except Exception as e:
      print(type(e).__name__, e)
    """,
    memory=8 << 30,
  )
  assert child.returncode == 0, child.stderr[-2000:]
  assert child.stdout.startswith(f"MemoryError out of memory reading {shard.name}"), child.stdout


# --- the extension is expected where CI builds it ---------------------------------------------


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI=true only: elsewhere it is optional")
def test_ci_runs_with_the_c_extension_built():
  """setup.py only warns when the build fails; in CI a silent fallback would test the wrong path."""
  assert decode.native() is not None, "pipeline.image._jpeg was not built: see setup.py's warning"


# --- a full disk during conversion ------------------------------------------------------------

PAGE = 4096
NO_SPACE_AT_MARKER = """
import errno, os, sys
from pipeline.convert import shards
write_json = shards._write_json
def full_disk(path, data):
  if os.path.basename(path) == os.environ["FULL_AT"] + ".done":
    raise OSError(errno.ENOSPC, "No space left on device", path)
  write_json(path, data)
shards._write_json = full_disk
from pipeline.convert.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@contextlib.contextmanager
def small_disk(path: pathlib.Path, pages: int):
  """A tmpfs of `pages` pages at `path` (root only): writes past it fail with ENOSPC."""
  path.mkdir()
  mounted = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", f"size={pages * PAGE}", "tmpfs", str(path)],
    capture_output=True,
    text=True,
  )
  if mounted.returncode != 0:
    pytest.skip(f"cannot mount a small tmpfs (root only): {mounted.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", str(path)], check=True)


def test_a_shard_left_without_its_marker_by_a_full_disk_is_rewritten_in_place(tmp_path):
  """ENOSPC between a shard's rename and its done marker left the shard behind, unused: the
  re-run wrote a second copy beside it and ran out of space again.

  The first failure is injected (the last shard's marker write raises ENOSPC, as on a disk that
  filled up at that moment); the re-run is real, on a tmpfs with room for one copy of each shard.
  """
  src = tmp_path / "src"
  for c in range(2):
    for i in range(12):
      path = src / f"c{c}" / f"{i}.jpg"
      path.parent.mkdir(parents=True, exist_ok=True)
      pixels = np.random.default_rng(c * 100 + i).integers(0, 255, (96, 96, 3), dtype=np.uint8)
      Image.fromarray(pixels).save(path, "JPEG", quality=95)
  args = ["images", str(src), "--workers", "1", "--shard-size-mb", "0.1", "--no-progress"]

  def convert(out, *, full_at=""):
    code = ["-c", NO_SPACE_AT_MARKER] if full_at else ["-m", "pipeline.convert"]
    return subprocess.run(
      [sys.executable, *code, *args[:2], str(out), *args[2:]],
      cwd=ROOT,
      env={**os.environ, "PYTHONPATH": str(ROOT), "FULL_AT": full_at},
      capture_output=True,
      text=True,
      timeout=300,
    )

  whole = tmp_path / "whole"
  assert convert(whole).returncode == 0
  sizes = [
    s["bytes"]
    for s in json.loads((whole / "manifest.json").read_text())["splits"]["train"]["shards"]
  ]
  last = shards.shard_name("train", len(sizes) - 1, len(sizes))  # rewritten when the disk is
  assert len(sizes) >= 2 and sizes[-1] > 16 * PAGE  # fullest: a second copy does not fit
  # Room for the dataset and its small files, and 16 pages more: less than a second copy.
  with small_disk(tmp_path / "disk", sum(-(-s // PAGE) for s in sizes) + 16) as disk:
    clean = convert(disk / "clean")  # the disk is big enough for a conversion
    assert clean.returncode == 0, clean.stderr[-2000:]
    shutil.rmtree(disk / "clean")
    out = disk / "out"
    failed = convert(out, full_at=last)
    assert failed.returncode != 0 and "No space left on device" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    left = sorted(p.name for p in (out / shards.BUILD_DIR).iterdir())
    assert last in left and last + ".done" not in left
    rerun = convert(out)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    for name in (p.name for p in whole.glob("*.array_record-*")):
      assert (out / name).read_bytes() == (whole / name).read_bytes(), name


# --- a reader stays on the dataset it opened -------------------------------------------------


def _two_datasets(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """Two image folders that convert to the same shard names and per-shard counts: the files
  are different, the sizes equal."""
  srcs = []
  for version in (0, 1):
    src = tmp_path / f"src{version}"
    for c in range(2):
      for i in range(6):
        path = src / f"c{c}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(version * 1000 + c * 100 + i)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
        data = buf.getvalue()  # padded with a comment to 4000 bytes: records of equal size
        path.write_bytes(
          data[:2] + jpeg_modes.segment(0xFE, bytes(4000 - len(data) - 4)) + data[2:]
        )
    srcs.append(src)
  return srcs[0], srcs[1]


def _convert(src, out, **kw):
  return images.convert(
    images.Request(src, out, shard_size_mb=0.01, **kw), workers=1, progress=False
  )


def _pinned(tmp_path):
  """tmp_path/out converted from the first of `_two_datasets`, its manifest and its train
  shards' paths and pins, as a reader opens them; and the second source."""
  old_src, new_src = _two_datasets(tmp_path)
  out = tmp_path / "out"
  _convert(old_src, out)
  meta = manifest.load(out)
  return out, meta, *manifest.pinned_shards(out, meta, "train"), new_src


def test_shards_replaced_by_convert_overwrite_are_refused_at_open(tmp_path):
  """A reader pinned the shards it checked; `convert --overwrite` swaps in new files."""
  out, meta, paths, pins, new_src = _pinned(tmp_path)
  assert len(paths) >= 3
  for path, pinned in zip(paths, pins):
    backend.check_pinned(path, pinned)  # unchanged: fine
  _convert(new_src, out, overwrite=True)
  new = manifest.load(out)
  assert [s.file for s in new.splits["train"].shards] == [p.name for p in paths]
  assert [s.num_records for s in new.splits["train"].shards] == [
    s.num_records for s in meta.splits["train"].shards
  ]
  for path, pinned in zip(paths, pins):
    with pytest.raises(backend.ShardReplacedError, match=f"shard {path} was replaced after"):
      backend.check_pinned(path, pinned)
  with pytest.raises(manifest.ManifestError, match="changed while the dataset was being opened"):
    manifest.pinned_shards(out, meta, "train")  # the manifest it was given is gone


def test_a_source_opened_before_convert_overwrite_refuses_the_new_shards(tmp_path):
  """End to end through ShardedSource: passes once source.py pins and checks (see report)."""
  out, meta, paths, pins, new_src = _pinned(tmp_path)
  counts = [s.num_records for s in meta.splits["train"].shards]
  source = ShardedSource(paths, counts, pins)
  first = source.read([0])
  _convert(new_src, out, overwrite=True)
  assert source.read([0]) == first  # an open reader keeps reading the file it opened
  with pytest.raises(backend.ShardReplacedError, match="was replaced after"):
    source.read([len(source) - 1])


# --- tampered datasets ------------------------------------------------------------------------


@pytest.fixture
def photos(photos_dir, tmp_path) -> pathlib.Path:
  """A private copy of the converted photos (train 48, validation 16), safe to damage."""
  return shutil.copytree(photos_dir, tmp_path / "photos")


@pytest.mark.parametrize("where", ["same split", "another split"])
def test_a_manifest_listing_one_shard_twice_is_refused(photos, where):
  """Served every record twice (one shard listed twice, counts adjusted to match)."""
  d = json.loads((photos / "manifest.json").read_text())
  train = d["splits"]["train"]
  twice = train["shards"][0]
  other = train if where == "same split" else d["splits"]["validation"]
  other["shards"].append(dict(twice))
  other["num_records"] += twice["num_records"]
  (photos / "manifest.json").write_text(json.dumps(d))
  with pytest.raises(manifest.ManifestError, match=f"shard '{twice['file']}' is listed twice"):
    manifest.load(photos)


def test_verify_none_refuses_a_fifo_shard_instead_of_blocking(photos):
  shard = photos / manifest.load(photos).splits["train"].shards[0].file
  shard.unlink()
  os.mkfifo(shard)
  child = run_child(
    f"""
    import pipeline
    try:
      pipeline.make_dataset({str(photos)!r}, batch_size=4, verify="none")
    except Exception as e:
      print(type(e).__name__, e)
    """,
    memory=8 << 30,
    timeout=120,
  )
  assert child.stdout.strip() == f"ManifestError shard {shard} is not a regular file", child.stderr


def test_a_file_name_that_is_not_utf8_is_skipped_and_named(tmp_path, run_python):
  """Aborted the whole conversion with a UnicodeEncodeError naming no file."""
  src = os.fsencode(tmp_path / "src")
  image = jpeg_modes.sequential(8, 0xC0)
  for rel in (b"a/good.jpg", b"a/bad\xff.jpg", b"caf\xe9/x.jpg"):
    path = os.path.join(src, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(image)
  done = run_python("-m", "pipeline.convert", "images", str(tmp_path / "src"), str(tmp_path / "o"))
  assert done.returncode == 0, done.stderr
  m = manifest.load(tmp_path / "o")
  assert m.classes == ["a"] and m.splits["train"].num_records == 1
  assert m.skipped == [
    {"path": "a/bad\\xff.jpg", "reason": images.NOT_UTF8},
    {"path": "caf\\xe9", "reason": images.NOT_UTF8},
  ]


# --- checkpoints ------------------------------------------------------------------------------


def _tiny_run():
  """A small model state and a data iterator one element in: what a checkpoint holds."""
  import grain
  from flax import nnx

  _, state = nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  data = iter(grain.MapDataset.range(10).to_iter_dataset())
  next(data)
  return state, data


def test_a_file_where_the_checkpoint_folder_goes_is_refused_before_training(tmp_path):
  """Trained, then failed to save and timed out after ~300 s."""
  from train import UsageError
  from train.checkpoints import Checkpoints

  (tmp_path / "checkpoints").write_text("not a folder")
  with pytest.raises(UsageError, match="checkpoints is not a folder: move it aside"):
    Checkpoints(epath.Path(tmp_path), keep=3)


def test_a_checkpoint_copied_to_another_step_is_not_trusted(tmp_path, capfd):
  """Only what a finished save wrote: a copy named step 99999 restored as step 99999."""
  from train.checkpoints import Checkpoints

  state, data = _tiny_run()
  ckpt = Checkpoints(epath.Path(tmp_path), keep=3)
  ckpt.save(2, state, data)
  ckpt.close()
  shutil.copytree(tmp_path / "checkpoints" / "2", tmp_path / "checkpoints" / "99999")
  ckpt = Checkpoints(epath.Path(tmp_path), keep=3)
  step, _ = ckpt.restore(state, data)
  ckpt.close()
  assert step == 2
  assert (tmp_path / "unrestorable" / "99999").is_dir()
  assert "it was saved as step 2, not 99999" in capfd.readouterr().err


def test_a_dataset_with_a_hidden_bomb_record_serves_the_rest_quickly(tmp_path, write_dataset):
  """One such record cost ~52 s and 8.5 GB on the native path, and again on the Python retry."""
  from pipeline.catalog import records

  good = jpeg_modes.sequential(8, 0xC0)
  recs = [records.encode(good, 0), records.encode(jpeg_modes.hidden_frame_bomb(), 1)] * 4
  write_dataset(tmp_path / "data", recs, ["a", "b"])
  child = run_child(
    f"""
    import time, resource, pipeline
    start = time.process_time()
    ds = pipeline.make_dataset({str(tmp_path / "data")!r}, batch_size=4, train=False,
                               image_size=8, on_error="skip", shard_index=0, shard_count=1)
    it = iter(ds)
    served = sum(int(b["mask"].sum()) for b in it)
    print(served, it.skipped, time.process_time() - start,
          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)
    """,
    memory=6 << 30,
    timeout=300,
  )
  assert child.returncode == 0, child.stderr[-3000:]
  served, skipped, _, rss_mb = child.stdout.split()
  assert (int(served), int(skipped)) == (4, 4)
  assert int(rss_mb) < 2000, child.stdout  # one decoded bomb: 8.5 GB
