"""Fuzzing: random and mutated bytes through parsing, decoding and the native batch path.

Only `records.RecordError` and `decode.DecodeError` may escape: never a crash, a hang or
unbounded memory. Images are decoded in a sandbox process (this file run as a script), so a
segfault in a C decoder fails the test and names the input instead of killing pytest, and an
address-space limit and a timeout catch runaway allocations and hangs.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import random
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import traceback
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import pipeline
from pipeline.catalog import records
from pipeline.dataset import BadRecordError
from pipeline.image import augment, decode
from pipeline.stages import decode as decode_stage

ROOT = pathlib.Path(__file__).resolve().parents[2]
SANDBOX_MEMORY = 3 << 30  # address space of the sandbox: a pixel-limited image fits
MAX_RSS_MB = 1500  # what the sandbox may have touched at its peak
CALL_TIMEOUT_S = 30  # one input through every decode path (loaded 2-core CI machine)
OUT = 32  # output image size
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# --- sample inputs --------------------------------------------------------------------------


def _pixels(h: int, w: int, seed: int = 0) -> np.ndarray:
  """Noise on a gradient: compresses like a photo, not like a flat image."""
  rng = np.random.default_rng(seed)
  grad = np.linspace(0, 200, w, dtype=np.float32)[None, :, None]
  return np.clip(grad + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)


def _save(array: np.ndarray, fmt: str, mode: str | None = None, **kw) -> bytes:
  im = Image.fromarray(array)
  if mode:
    im = im.convert(mode)
  buf = io.BytesIO()
  im.save(buf, fmt, **kw)
  return buf.getvalue()


def _sample_images() -> dict[str, bytes]:
  """Small real images in every JPEG flavour the C decoder meets, and Pillow's formats."""
  a, b = _pixels(48, 64), _pixels(37, 53, seed=1)
  gray16 = a[..., 0].astype(np.uint16) * 257
  return {
    "jpeg420": _save(a, "JPEG", quality=90),
    "jpeg444": _save(b, "JPEG", quality=95, subsampling=0),
    "jpeg422": _save(b, "JPEG", subsampling=1),
    "jpeg_gray": _save(a, "JPEG", mode="L"),
    "jpeg_progressive": _save(b, "JPEG", progressive=True),
    "jpeg_restart": _save(a, "JPEG", restart_marker_blocks=1),
    "jpeg_cmyk": _save(b, "JPEG", mode="CMYK"),
    "png": _save(b, "PNG"),
    "png16": _save(gray16, "PNG"),
    "gif": _save(a, "GIF", mode="P"),
    "bmp": _save(b, "BMP"),
    "webp": _save(a, "WEBP", quality=80),
    "tiff": _save(b, "TIFF", compression="tiff_lzw"),
  }


IMAGES = _sample_images()
JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC9, 0xCA}
BIG = st.sampled_from([4095, 4096, 9000, 20000, 65500, 65535])


def set_jpeg_size(data: bytes, h: int, w: int) -> bytes:
  """Rewrites the frame header's height and width (the bytes a decoder sizes buffers by)."""
  out, i = bytearray(data), 2
  while i + 9 < len(out) and out[i] == 0xFF:
    marker, length = out[i + 1], struct.unpack(">H", out[i + 2 : i + 4])[0]
    if marker in JPEG_SOF:
      out[i + 5 : i + 9] = struct.pack(">HH", h, w)
      return bytes(out)
    i += 2 + length
  return data


def set_png_size(data: bytes, h: int, w: int) -> bytes:
  """Rewrites IHDR's width and height and fixes its CRC, so only the size is a lie."""
  out = bytearray(data)
  out[16:24] = struct.pack(">II", w, h)
  out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])))
  return bytes(out)


@st.composite
def mutated(draw, base: bytes) -> bytes:
  """`base` after 1-6 random edits: bit flips, byte writes, cuts, inserts, deletions."""
  data = bytearray(base)
  for _ in range(draw(st.integers(1, 6))):
    kind = draw(st.sampled_from(["flip", "byte", "truncate", "insert", "delete"]))
    if not data:
      break
    pos = draw(st.integers(0, len(data) - 1))
    if kind == "flip":
      data[pos] ^= 1 << draw(st.integers(0, 7))
    elif kind == "byte":
      data[pos] = draw(st.sampled_from([0x00, 0xFF, 0xD8, 0xD9, 0xC0, 0xDA, 0x7F]))
    elif kind == "truncate":
      del data[pos:]
    elif kind == "insert":
      data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
    else:
      del data[pos : pos + draw(st.integers(1, 256))]
  return bytes(data)


@st.composite
def bad_images(draw) -> bytes:
  """Real images mutated, some with a forged size in the header."""
  name = draw(st.sampled_from(sorted(IMAGES)))
  data = IMAGES[name]
  if draw(st.booleans()):  # at most one side huge: huge squares are tested below
    h, w, big = draw(st.integers(0, 300)), draw(st.integers(0, 300)), draw(BIG)
    h, w = draw(st.sampled_from([(h, w), (big, w), (h, big)]))
    data = set_png_size(data, h, w) if name.startswith("png") else set_jpeg_size(data, h, w)
  if draw(st.integers(0, 3)):
    data = draw(mutated(data))
  return data


# --- the sandbox ----------------------------------------------------------------------------


def _attempt(fn) -> dict:
  try:
    value = fn()
  except Exception as e:  # noqa: BLE001 - the parent judges what escaped
    return {
      "error": type(e).__name__,
      "message": str(e)[:300],
      "trace": traceback.format_exc()[-2000:],
    }
  if isinstance(value, np.ndarray):
    return {"shape": list(value.shape), "dtype": str(value.dtype)}
  return {"value": value}


def _native_batch(record: bytes, seed: int) -> list:
  """The native batch path on one record (raw bytes exercise its Example parser), drawn as
  the "train" path draws it (example (seed, 0, 0))."""
  head = augment.Head(OUT)
  decoder = decode_stage.batch_decoder(head, records.Keys(), seed)
  if decoder is None:
    return []
  labels, index = np.zeros(2, np.int64), np.zeros(2, np.int64)
  dims, arena = np.zeros((2, 2), np.int32), np.empty(2 * head.slot_bytes(), np.uint8)
  return decoder([record, None], index, index, labels, dims, arena, 0, 2)


def _every_path(data: bytes, req: dict) -> dict:
  """Runs `data` through each decode entry point the pipeline uses."""
  key = augment.example_key(req["seed"], 0, 0)
  out = {
    "image_size": _attempt(lambda: decode.image_size(data)),
    "decode": _attempt(lambda: decode.decode(data)),
    "train": _attempt(lambda: augment.Head(OUT, train=True)(data, key)),
    "eval": _attempt(lambda: augment.Head(OUT, train=False)(data, key)),
    "batch_of_record": _attempt(lambda: _native_batch(records.encode(data, 1), req["seed"])),
    "batch_of_raw_bytes": _attempt(lambda: _native_batch(data, req["seed"])),
  }
  if "value" in out["image_size"]:
    h, w = out["image_size"]["value"]
    fy, fx, fh, fw = req["box"]
    ch, cw = max(1, round(fh * h)), max(1, round(fw * w))
    box = (round(fy * (h - ch)), round(fx * (w - cw)), ch, cw)
    out["decode_crop"] = _attempt(
      lambda: decode.decode_crop(data, box, req["scale"], fast_dct=req["fast_dct"])
    )
    out["decode_crop"].update(box=box, scale=req["scale"])
  return out


def serve() -> None:
  """Sandbox loop: a JSON header line, then its payload bytes; answers one JSON line each."""
  resource.setrlimit(resource.RLIMIT_AS, (SANDBOX_MEMORY, SANDBOX_MEMORY))
  stdin, stdout = sys.stdin.buffer, sys.stdout
  stdout.write("ready\n")
  stdout.flush()
  for line in stdin:
    req = json.loads(line)
    data = stdin.read(req["size"])
    results = _every_path(data, req)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stdout.write(json.dumps({"results": results, "maxrss_mb": peak_mb}) + "\n")
    stdout.flush()


class Sandbox:
  """A decoding child process; a crash or hang becomes an answer, and the next call restarts it."""

  def __init__(self, log: pathlib.Path):
    self.proc: subprocess.Popen | None = None
    self.log = log  # the child's stderr, shown when it dies

  def _start(self) -> None:
    env = {
      **os.environ,
      "PYTHONPATH": str(ROOT),
      "OPENBLAS_NUM_THREADS": "1",
      "OMP_NUM_THREADS": "1",
    }
    with open(self.log, "wb") as log:
      self.proc = subprocess.Popen(
        [sys.executable, __file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        cwd=ROOT,
        env=env,
      )
    ready = self._read_line(120)
    assert ready == b"ready\n", f"sandbox did not start: {self._why()}"

  def _read_line(self, timeout: float) -> bytes | None:
    if not select.select([self.proc.stdout], [], [], timeout)[0]:
      return None
    return self.proc.stdout.readline()

  def _why(self) -> str:
    rc = self.proc.wait(5)
    what = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    return f"{what}; stderr: {self.log.read_bytes()[-1500:].decode(errors='replace')}"

  def run(
    self,
    data: bytes,
    seed: int = 0,
    box=(0.0, 0.0, 1.0, 1.0),
    scale: int = 1,
    fast_dct: bool = False,
  ) -> dict:
    """Every decode path's outcome for `data`, or {"fatal": why} if the process died or hung.

    `box` is the crop window as fractions (y, x, h, w) of the size read from the header.
    """
    if self.proc is None or self.proc.poll() is not None:
      self._start()
    header = json.dumps(
      {"size": len(data), "seed": seed, "box": box, "scale": scale, "fast_dct": fast_dct}
    )
    try:
      self.proc.stdin.write(header.encode() + b"\n" + data)
      self.proc.stdin.flush()
      line = self._read_line(CALL_TIMEOUT_S)
    except BrokenPipeError:
      line = b""
    if line is None:
      self.proc.kill()
      self.proc.wait()
      self.proc = None
      return {"fatal": f"no answer within {CALL_TIMEOUT_S} s (hang)"}
    if not line:
      why = self._why()
      self.proc = None
      return {"fatal": f"sandbox died: {why}"}
    return json.loads(line)

  def close(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.stdin.close()
      self.proc.wait(30)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
  box = Sandbox(tmp_path_factory.mktemp("sandbox") / "stderr.log")
  yield box
  box.close()


def check_answer(answer: dict, data: bytes) -> dict:
  """The contract: clear errors only, shapes as promised, paths agree, memory bounded."""
  where = f"input of {len(data)} bytes starting {data[:48]!r}"
  assert "fatal" not in answer, f"{answer['fatal']} on {where}"
  results = answer["results"]
  for path, r in results.items():
    assert r.get("error") in (None, "DecodeError"), (
      f"{path} let {r['error']} escape on {where}:\n{r['trace']}"
    )
  size = results["image_size"]
  if "error" in size:  # every path reads the header first
    assert all("error" in r for k, r in results.items() if not k.startswith("batch_")), where
    if decode.native() is not None:  # the native path hands the record back
      assert results["batch_of_record"]["value"], (where, results["batch_of_record"])
  else:
    h, w = size["value"]
    assert 0 < h * w <= decode.MAX_PIXELS
    if "shape" in results["decode"]:
      assert results["decode"]["shape"] == [h, w, 3]
    crop = results["decode_crop"]
    if "shape" in crop:  # at 1/scale (C decoder) or full size (Pillow ignores the scale)
      _, _, ch, cw = crop["box"]
      s = crop["scale"]
      assert crop["shape"] in ([ch, cw, 3], [max(1, ch // s), max(1, cw // s), 3]), (crop, where)
      assert crop["dtype"] == "uint8"
  for path in ("train", "eval"):
    if "shape" in results[path]:
      assert results[path] == {"shape": [OUT, OUT, 3], "dtype": "uint8"}
  for path in ("batch_of_record", "batch_of_raw_bytes"):  # never raises: hands records back
    assert "value" in results[path], (path, results[path], where)
    assert all(slot == 0 for slot, _ in results[path]["value"])
  for _, message in results["batch_of_record"]["value"]:  # broken: in the Python path's words
    assert message is None or message[:300] == results["train"].get("message"), (results, where)
  assert answer["maxrss_mb"] < MAX_RSS_MB, f"sandbox peaked at {answer['maxrss_mb']:.0f} MB"
  return results


# --- records ---------------------------------------------------------------------------------


def parses_or_raises_record_error(data: bytes) -> None:
  try:
    image, label, filename = records.parse(data)
  except records.RecordError as e:
    assert str(e)
    return
  assert isinstance(image, bytes) and isinstance(filename, str)
  assert isinstance(label, int) and -(2**63) <= label < 2**63


@settings(FUZZ, max_examples=400)
@given(st.binary(max_size=2048))
def test_random_bytes_parse_or_raise_record_error(data):
  parses_or_raises_record_error(data)


RECORD = records.encode(IMAGES["jpeg420"][:200], 3, "n01440764/ILSVRC2012_val_00000293.JPEG")


@settings(FUZZ, max_examples=400)
@given(mutated(RECORD))
def test_mutated_records_parse_or_raise_record_error(data):
  parses_or_raises_record_error(data)


FEATURE_KEYS = st.sampled_from(["image/encoded", "image/class/label", "image/filename", "x"])
FEATURE = st.one_of(
  st.tuples(st.just("bytes"), st.lists(st.binary(max_size=16), max_size=3)),
  st.tuples(st.just("int64"), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3)),
  st.tuples(st.just("float"), st.lists(st.floats(width=32), max_size=3)),
)


@settings(FUZZ, max_examples=300)
@given(st.dictionaries(FEATURE_KEYS, FEATURE))
def test_any_example_parses_exactly_or_names_the_missing_feature(features):
  from tensorflow_datasets.proto import tf_example_pb2

  example = tf_example_pb2.Example()
  for key, (kind, values) in features.items():
    getattr(example.features.feature[key], f"{kind}_list").value.extend(values)
  image, label = features.get("image/encoded"), features.get("image/class/label")
  keys = records.DEFAULT_KEYS
  if not (image and image[0] == "bytes" and image[1]):
    with pytest.raises(records.RecordError, match=keys.image):
      records.parse(example.SerializeToString())
  elif not (label and label[0] == "int64" and label[1]):
    with pytest.raises(records.RecordError, match=keys.label):
      records.parse(example.SerializeToString())
  else:
    name = features.get("image/filename", ("", []))
    expected_name = name[1][0].decode("utf-8", "replace") if name[0] == "bytes" and name[1] else ""
    assert records.parse(example.SerializeToString()) == (image[1][0], label[1][0], expected_name)


@settings(FUZZ, max_examples=50)
@given(st.binary(min_size=1, max_size=256))
def test_detect_keys_on_garbage_raises_record_error(data):
  try:
    records.detect_keys(data)
  except records.RecordError:
    pass


# --- the native Example parser against protobuf ----------------------------------------------


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1
  out = bytearray()
  while True:
    out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
    n >>= 7
    if not n:
      return bytes(out)


def _padded_varint(n: int, size: int) -> bytes:
  """`n` as a varint of exactly `size` bytes (continuation bits on zero bytes: legal wire
  format up to protobuf's limit for the field)."""
  return bytes((n >> 7 * i) & 0x7F | (0x80 if i < size - 1 else 0) for i in range(size))


def _field(number: int, wire: int, payload: bytes | int) -> bytes:
  """One protobuf field: a varint (wire 0) or a length-delimited payload (wire 2), or raw."""
  tag = _varint(number << 3 | wire)
  if wire == 0:
    return tag + _varint(payload)
  if wire == 2:
    return tag + _varint(len(payload)) + payload
  return tag + payload  # fixed64/fixed32 bytes, or a group's raw body


def _bytes_list(*values: bytes) -> bytes:
  return _field(1, 2, b"".join(_field(1, 2, v) for v in values))


def _int64_list(*values: int, packed: bool = True) -> bytes:
  if packed:
    return _field(3, 2, _field(1, 2, b"".join(_varint(v) for v in values)))
  return _field(3, 2, b"".join(_field(1, 0, v) for v in values))


def _entry(key: bytes, *features: bytes) -> bytes:
  """A map entry: key, then each Feature payload as another `value` field (protobuf merges)."""
  return _field(1, 2, _field(1, 2, key) + b"".join(_field(2, 2, f) for f in features))


IMAGE_KEY, LABEL_KEY = b"image/encoded", b"image/class/label"


def _example(*entries: bytes, extra: bytes = b"") -> bytes:
  return _field(1, 2, b"".join(entries)) + extra


def _edge_records() -> dict[str, bytes]:
  """Records whose wire format protobuf reads by its merge rules: the traps of issue 20."""
  img = _entry(IMAGE_KEY, _bytes_list(b"\xff\xd8\xff-a", b"second"))
  label = lambda *f: _entry(LABEL_KEY, *f)
  return {
    "plain": _example(img, label(_int64_list(3))),
    "unpacked": _example(img, label(_int64_list(3, 4, packed=False))),
    "negative": _example(img, label(_int64_list(-5))),
    "oneof_later_int64_wins": _example(img, label(_int64_list(9) + _int64_list(0, 1))),
    "oneof_switch_back": _example(img, label(_int64_list(9) + _bytes_list(b"x") + _int64_list(7))),
    "oneof_bytes_last": _example(img, label(_int64_list(9) + _bytes_list(b"x"))),
    "values_merge": _example(img, label(_int64_list(9), _int64_list(1))),
    "values_merge_across_kinds": _example(img, label(_int64_list(9), _bytes_list(b"x"))),
    "empty_then_value": _example(img, label(_int64_list(packed=False), _int64_list(6))),
    "duplicate_key_last_wins": _example(img, label(_int64_list(9)), label(_int64_list(2))),
    "features_merge": _example(img) + _example(label(_int64_list(4))),
    "features_replace_key": _example(img, label(_int64_list(1))) + _example(label(_int64_list(8))),
    "image_entry_replaced": _example(img, label(_int64_list(1)), _entry(IMAGE_KEY, _bytes_list())),
    "image_lists_merge": _example(
      _entry(IMAGE_KEY, _bytes_list(), _bytes_list(b"late")), label(_int64_list(1))
    ),
    "key_repeated_in_entry": _example(
      img, _field(1, 2, _field(1, 2, b"x") + _field(1, 2, LABEL_KEY) + _field(2, 2, _int64_list(5)))
    ),
    "unknown_fields": _example(
      img,
      label(_int64_list(2)),
      extra=_field(7, 0, 1) + _field(9, 1, bytes(8)) + _field(10, 5, bytes(4)),
    ),
    "unknown_in_entry": _example(
      img, _field(1, 2, _field(3, 0, 7) + _field(1, 2, LABEL_KEY) + _field(2, 2, _int64_list(5)))
    ),
    "wrong_wire_for_features": _field(1, 0, 5) + _example(img, label(_int64_list(2))),
    "group": _example(img, label(_int64_list(2)), extra=_field(5, 3, _field(1, 0, 1)) + b"\x2c"),
    "bad_utf8_key": _example(img, label(_int64_list(2)), _entry(b"\xff\xfe", _int64_list(1))),
    "bad_utf8_key_replaced": _example(
      img,
      _field(1, 2, _field(1, 2, b"\xf8") + _field(1, 2, LABEL_KEY) + _field(2, 2, _int64_list(5))),
    ),
    "float_list_odd_packed": _example(
      img, label(_int64_list(2)), _entry(b"f", _field(2, 2, b"\x0a\x03abc"))
    ),
    "field_zero": _example(img, label(_int64_list(2)), extra=b"\x00\x00"),
    "ten_byte_varint": _example(img, label(_int64_list(2**63 + 5))),
    "overlong_varint": _example(
      img, label(_field(3, 2, _field(1, 0, 0)[:1] + b"\xff" * 10 + b"\x01"))
    ),
    # issue 31: protobuf reads a length of up to 5 bytes, refuses 6 or more
    **{
      f"length_varint_{size}_bytes": _example(
        img, label(b"\x1a" + _padded_varint(len(_int64_list(3)) - 2, size) + _int64_list(3)[2:])
      )
      for size in (1, 5, 6, 10)
    },
    "truncated_packed": _example(img, label(_field(3, 2, _field(1, 2, b"\x05\x85")))),
    "no_label": _example(img),
    "issue_20": _example(img, label(_int64_list(9) + _field(2, 2, b"") + _int64_list(0))),
  }


EDGE_RECORDS = _edge_records()


def _reference(record: bytes) -> tuple[bytes, int] | None:
  try:
    image, label, _ = records.parse(record)
  except records.RecordError:
    return None
  return image, label


def _native(record: bytes) -> tuple[bytes, int] | None:
  got = decode.native().parse_example(record, IMAGE_KEY, LABEL_KEY)
  return None if got is None else (record[got[0] : got[0] + got[1]], got[2])


def _parse_corpus(n: int, seed: int) -> list[bytes]:
  """The edge records, real ones, and `n` mutations of them: flips, splices of fields, cuts."""
  rng = random.Random(seed)
  bases = [*EDGE_RECORDS.values(), RECORD, records.encode(b"\xff\xd8\xffimg", 7, "x.jpg")]
  pieces = [_int64_list(1), _bytes_list(b"z"), _field(2, 2, _int64_list(4)), _field(3, 0, 1)]
  corpus = list(bases)
  while len(corpus) < len(bases) + n:
    data = bytearray(rng.choice(bases))
    for _ in range(rng.randint(1, 4)):
      pos = rng.randrange(len(data) + 1)
      kind = rng.randrange(6)
      if kind == 0 and data:
        data[pos % len(data)] ^= 1 << rng.randrange(8)
      elif kind == 1 and data:
        data[pos % len(data)] = rng.choice([0x00, 0x01, 0x08, 0x0A, 0x12, 0x1A, 0x7F, 0x80, 0xFF])
      elif kind == 2:
        data[pos:pos] = rng.choice(pieces)
      elif kind == 3:
        del data[pos : pos + rng.randint(1, 8)]
      elif kind == 4:
        other = rng.choice(bases)
        a = rng.randrange(len(other))
        data[pos:pos] = other[a : a + rng.randint(1, 24)]
      else:
        del data[pos:]
    corpus.append(bytes(data))
  return corpus


def _structured_corpus(n: int, seed: int) -> list[bytes]:
  """`n` well-formed but tangled Examples: the protobuf merge rules, not byte damage."""
  rng = random.Random(seed)
  keys = [IMAGE_KEY] * 4 + [LABEL_KEY] * 4 + [b"x", b"", "é".encode()]
  likely = {IMAGE_KEY: "bytes", LABEL_KEY: "int64"}

  def a_list(key: bytes) -> bytes:
    kinds = ["bytes", "int64", "int64u", "float", "unknown", "empty"]
    kind = likely.get(key, "") if rng.random() < 0.6 else rng.choice(kinds)
    if kind == "bytes":
      return _bytes_list(*[rng.randbytes(rng.randint(0, 4)) for _ in range(rng.randint(0, 3))])
    if kind in ("int64", "int64u"):
      values = [rng.randint(-(2**63), 2**63 - 1) for _ in range(rng.randint(0, 3))]
      return _int64_list(*values, packed=kind == "int64" and rng.random() < 0.7)
    if kind == "float":
      return _field(2, 2, _field(1, 2, rng.randbytes(4 * rng.randint(0, 2))))
    if kind == "unknown":
      return _field(rng.randint(4, 9), 0, rng.randint(0, 300))
    return b""

  def an_entry() -> bytes:
    key = rng.choice(keys)
    parts = [_field(1, 2, key)] if rng.random() < 0.95 else []
    if rng.random() < 0.05:  # a second key: the last one counts
      parts.append(_field(1, 2, rng.choice(keys + [b"\xff"])))
    parts += [_field(2, 2, b"".join(a_list(key) for _ in range(rng.choice([1, 1, 2, 3]))))
              for _ in range(rng.choice([0, 1, 1, 1, 2]))]  # fmt: skip
    if rng.random() < 0.03:  # an unknown field: protobuf drops the entry from the map
      parts.append(_field(3, 0, 1))
    rng.shuffle(parts)
    return _field(1, 2, b"".join(parts))

  corpus = []
  for _ in range(n):
    features = [
      b"".join(an_entry() for _ in range(rng.randint(0, 5))) for _ in range(rng.choice([1, 1, 2]))
    ]
    extra = _field(rng.randint(2, 20), 0, 5) if rng.random() < 0.1 else b""
    corpus.append(b"".join(_field(1, 2, f) for f in features) + extra)
  return corpus


def check_native_parse_agrees(corpus: list[bytes]) -> int:
  """Native parse == protobuf's wherever the native parser answers; returns how often it did."""
  answered = 0
  for i, record in enumerate(corpus):
    native = _native(record)
    if native is not None:
      answered += 1
      assert native == _reference(record), f"record {i}: {record!r}"
  return answered


needs_native = pytest.mark.usefixtures("native")


@needs_native
@pytest.mark.parametrize("name", sorted(EDGE_RECORDS))
def test_the_native_parser_gives_protobufs_answer_or_declines(name):
  record = EDGE_RECORDS[name]
  native, reference = _native(record), _reference(record)
  assert native in (None, reference)
  if name == "issue_20":  # served 9 where protobuf reads 0: a float_list reset the oneof
    assert reference[1] == 0 and native == reference
  if name in ("plain", "unpacked", "negative", "oneof_later_int64_wins", "values_merge"):
    assert native == reference is not None  # the common shapes are answered, not declined
  if name.startswith("length_varint_"):  # issue 31: a 6-byte length was served
    size = int(name.split("_")[2])
    assert (reference is not None) == (size <= 5)
    assert native == reference


@needs_native
def test_the_native_parser_agrees_with_protobuf_on_a_mutated_corpus():
  corpus = _parse_corpus(3000, seed=20)
  answered = check_native_parse_agrees(corpus)
  references = sum(_reference(r) is not None for r in corpus)
  assert answered > references * 0.8, (answered, references)  # declining is the exception


@needs_native
def test_the_native_parser_agrees_with_protobuf_on_tangled_examples():
  corpus = _structured_corpus(3000, seed=20)
  answered = check_native_parse_agrees(corpus)
  assert answered > 0.5 * sum(_reference(r) is not None for r in corpus)


@needs_native
@pytest.mark.slow
def test_the_native_parser_agrees_with_protobuf_on_a_long_corpus():
  check_native_parse_agrees(_structured_corpus(100_000, seed=1000))
  for seed in range(10):
    check_native_parse_agrees(_parse_corpus(10_000, seed=1000 + seed))
  for seed in range(20):
    check_native_parse_agrees(_parse_corpus(10_000, seed=1000 + seed))


@needs_native
def test_the_batch_path_serves_protobufs_label():
  """Issue 20: the batch path served 9, protobuf and `convert verify` read 0."""
  img = _entry(IMAGE_KEY, _bytes_list(IMAGES["jpeg420"]))
  record = _example(img, _entry(LABEL_KEY, _int64_list(9) + _field(2, 2, b"") + _int64_list(0)))
  assert records.parse(record)[1] == 0
  head = augment.Head(OUT)
  index, labels = np.zeros(1, np.int64), np.full(1, -1, np.int64)
  arena, dims = np.empty(head.slot_bytes(), np.uint8), np.zeros((1, 2), np.int32)
  decoder = decode_stage.batch_decoder(head, records.Keys(), 0)
  handed_back = decoder([record], index, index, labels, dims, arena, 0, 1)
  assert handed_back == [] and labels.tolist() == [0]


# --- the extension under AddressSanitizer and UBSan ------------------------------------------

SANITIZED_RUN = """
import importlib.util, random, sys
import numpy as np
from pipeline.image import augment, decode
from pipeline.catalog import records
from tests import jpeg_modes
from tests.image import test_fuzz as f
spec = importlib.util.spec_from_file_location("sanitized._jpeg", sys.argv[1])
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
n = int(sys.argv[2])
for record in f._parse_corpus(n // 2, seed=7) + f._structured_corpus(n // 2, seed=7):
  native.parse_example(record, f.IMAGE_KEY, f.LABEL_KEY)
rng = random.Random(7)
bases = [*f.IMAGES.values(), *jpeg_modes.RARE.values(), jpeg_modes.hidden_frame_bomb()]
head = augment.Head(f.OUT)
args = (head.native_params(), f.OUT, head.slot_bytes())
labels, dims = np.zeros(2, np.int64), np.zeros((2, 2), np.int32)
arena = np.empty(2 * head.slot_bytes(), np.uint8)
for n in range(int(sys.argv[3])):
  data = bytearray(rng.choice(bases))
  for _ in range(rng.randint(0, 4)):
    data[rng.randrange(len(data))] = rng.randrange(256)
  if rng.random() < 0.2:
    del data[rng.randrange(len(data)):]
  data = bytes(data)
  native.frame(data)
  box = (rng.randrange(8), rng.randrange(8), rng.randint(1, 40), rng.randint(1, 40))
  for call in (lambda: native.header(data),
               lambda: native.decode_crop(data, *box, rng.choice([1, 2, 4, 8]), n % 2)):
    try:
      call()
    except ValueError:
      pass
  index = np.array([n, n + 1], np.int64)
  decoder = native.BatchDecoder(*args, n, f.IMAGE_KEY, f.LABEL_KEY)
  decoder([records.encode(data, 1), data], index, index, labels, dims, arena, 0, 2)
big = 2**63 - 8  # sizes whose sums overflow a signed long: refused, never wrapped
for box in [(0, big, 8, 16), (big, 0, 16, 8), (1, 1, big, big)]:
  try:
    native.decode_crop(f.IMAGES["jpeg420"], *box, 1)
  except ValueError:
    pass
try:
  decoder = native.BatchDecoder(args[0], f.OUT, 2**62, 0, f.IMAGE_KEY, f.LABEL_KEY)
  decoder([b"x", b"y"], index, index, labels, dims, arena, 0, 2)
except ValueError:
  pass
print("clean")
"""


def build_sanitized_extension(
  out: pathlib.Path, source: pathlib.Path | None = None
) -> pathlib.Path:
  """`pipeline/image/_jpeg.c` built with -fsanitize=address,undefined (any error aborts)."""
  import sysconfig

  target = out / "_jpeg.so"
  subprocess.run(
    ["cc", "-shared", "-fPIC", "-g", "-O1", "-Wall", "-Wextra", "-Werror",
     "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
     f"-I{sysconfig.get_paths()['include']}", str(source or ROOT / "pipeline/image/_jpeg.c"),
     "-o", str(target)],
    check=True, capture_output=True, text=True,
  )  # fmt: skip
  return target


def run_sanitized(
  tmp_path: pathlib.Path, source: pathlib.Path | None = None, records_n=20000, images_n=3000
) -> subprocess.CompletedProcess:
  """Builds the sanitized extension and runs SANITIZED_RUN on it in a child process."""
  if shutil.which("cc") is None:
    pytest.skip("no C compiler (cc) to build the sanitized extension")
  runtimes = [
    subprocess.run(
      ["cc", f"-print-file-name={name}"], capture_output=True, text=True
    ).stdout.strip()
    for name in ("libasan.so", "libubsan.so")
  ]
  if not all(os.path.isabs(r) and os.path.exists(r) for r in runtimes):
    pytest.skip(f"no sanitizer runtimes next to the compiler ({runtimes})")
  library = build_sanitized_extension(tmp_path, source)
  env = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "PYTHONMALLOC": "malloc",  # Python objects from malloc: ASan guards the records' bytes too
    "LD_PRELOAD": " ".join(runtimes),
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",  # CPython itself is not leak-clean
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
  }
  return subprocess.run(
    [sys.executable, "-c", SANITIZED_RUN, str(library), str(records_n), str(images_n)],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
  )  # fmt: skip


@pytest.mark.slow
def test_the_extension_runs_the_fuzz_corpus_clean_under_asan_and_ubsan(tmp_path):
  run = run_sanitized(tmp_path)
  assert run.returncode == 0 and run.stdout.strip() == "clean", run.stderr[-4000:]
  assert "runtime error" not in run.stderr, run.stderr[-4000:]


@pytest.mark.slow
def test_the_sanitized_run_catches_a_planted_overflow(tmp_path):
  """The harness itself: a parser that trusts a length 3 bytes too far is caught by ASan."""
  source = (ROOT / "pipeline" / "image" / "_jpeg.c").read_text()
  bound = "len > (uint64_t)(m->end - m->p) ||"
  assert bound in source
  planted = tmp_path / "_jpeg.c"
  planted.write_text(source.replace(bound, "len > (uint64_t)(m->end - m->p) + 3 ||"))
  run = run_sanitized(tmp_path, planted, records_n=2000, images_n=10)
  assert run.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in run.stderr


# --- images through the sandbox --------------------------------------------------------------


def test_sample_images_decode_cleanly_in_the_sandbox(sandbox):
  for name, data in IMAGES.items():
    results = check_answer(sandbox.run(data, box=(0.2, 0.3, 0.5, 0.5), scale=2), data)
    assert all("shape" in r or "value" in r for r in results.values()), (name, results)


BOXES = st.tuples(*[st.floats(0, 1)] * 4)
SCALES = st.sampled_from([1, 2, 4, 8])


@settings(FUZZ, max_examples=300)
@given(bad_images(), st.integers(0, 2**32 - 1), BOXES, SCALES, st.booleans())
def test_mutated_images_decode_or_raise_decode_error(sandbox, data, seed, box, scale, fast):
  check_answer(sandbox.run(data, seed, box, scale, fast), data)


@settings(FUZZ, max_examples=300)
@given(
  st.sampled_from([b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"RIFF"]),
  st.binary(max_size=1024),
  BOXES,
  SCALES,
)
def test_random_bytes_behind_image_signatures_raise_decode_error(sandbox, magic, tail, box, scale):
  data = magic + tail
  check_answer(sandbox.run(data, box=box, scale=scale), data)


@pytest.mark.parametrize(
  "fmt,h,w",
  [("jpeg", 65500, 65500), ("jpeg", 9500, 9500), ("png", 20000, 20000), ("png", 9500, 9500)],
)
def test_decompression_bombs_are_refused_by_the_pixel_limit(sandbox, fmt, h, w):
  assert h * w > decode.MAX_PIXELS
  data = (
    set_jpeg_size(IMAGES["jpeg420"], h, w) if fmt == "jpeg" else set_png_size(IMAGES["png"], h, w)
  )
  results = check_answer(sandbox.run(data), data)
  for path in ("image_size", "decode", "train", "eval"):
    assert results[path]["error"] == "DecodeError"
    assert "pixel" in results[path]["message"] or "bomb" in results[path]["message"], results
  if decode.native() is not None:  # handed to the Python path, which refuses it as above
    assert results["batch_of_record"]["value"] == [[0, None]]


def test_a_forged_size_just_under_the_pixel_limit_costs_bounded_memory(sandbox):
  data = set_jpeg_size(IMAGES["jpeg420"], 9000, 9000)  # 81 Mpx in the header, a few KiB of data
  results = check_answer(sandbox.run(data), data)
  assert results["image_size"]["value"] == [9000, 9000]
  for path in ("decode", "train", "eval"):
    assert results[path]["error"] == "DecodeError"  # libjpeg: premature end of data


def test_crop_windows_outside_the_jpeg_are_refused():
  data = IMAGES["jpeg420"]  # 48 x 64
  for box in [(40, 0, 16, 16), (0, 60, 8, 8), (-1, 0, 8, 8), (0, 0, 0, 8), (0, 0, 2**31 - 1, 8)]:
    with pytest.raises(decode.DecodeError, match="outside"):
      decode.decode_crop(data, box)
  with pytest.raises(ValueError, match="scale"):
    decode.decode_crop(data, (0, 0, 8, 8), 3)


def test_sizes_that_overflow_are_refused_not_wrapped():
  """`x + w` and `itemsize * n` overflowed signed arithmetic (UB) on private arguments."""
  big = 2**63 - 8
  for box in [(0, big, 8, 16), (big, 0, 16, 8), (1, 1, big, big)]:
    with pytest.raises(decode.DecodeError, match="outside"):
      decode.decode_crop(IMAGES["jpeg420"], box)
  native = decode.native()
  if native is not None:
    head, index = augment.Head(OUT), np.zeros(2, np.int64)
    labels, dims, arena = np.zeros(2, np.int64), np.zeros((2, 2), np.int32), np.empty(64, np.uint8)
    decoder = native.BatchDecoder(head.native_params(), OUT, 2**62, 0, IMAGE_KEY, LABEL_KEY)
    with pytest.raises(ValueError, match="arena: 2 items of 4611686018427387904 bytes is not a"):
      decoder([b"x", b"y"], index, index, labels, dims, arena, 0, 2)


def test_a_segfault_in_the_sandbox_fails_the_check_instead_of_pytest(sandbox):
  """The harness itself: a process that dies of SIGSEGV is reported, then replaced."""
  sandbox.run(IMAGES["png"])
  os.kill(sandbox.proc.pid, signal.SIGSEGV)
  answer = sandbox.run(IMAGES["png"])
  assert "SIGSEGV" in answer["fatal"]
  with pytest.raises(AssertionError, match="SIGSEGV"):
    check_answer(answer, IMAGES["png"])
  assert "results" in sandbox.run(IMAGES["png"])


# --- the whole pipeline on a shard of mutated records --------------------------------------


def test_the_pipeline_serves_exactly_the_records_that_decode(tmp_path, write_dataset):
  """Runs after the sandbox tests above: by now these decode paths are known not to crash."""
  rng = random.Random(0)
  recs = []
  for i in range(40):
    name = sorted(IMAGES)[i % len(IMAGES)]
    data, edits = bytearray(IMAGES[name]), rng.choice([0, 0, 1, 3])
    for _ in range(edits):
      data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    rec = records.encode(bytes(data), i % 3, f"{i}.{name}")
    recs.append(rec[: rng.randrange(len(rec))] if i % 13 == 5 else rec)
  expected = {}  # index -> hash of the eval image, for the records that parse and decode
  for i, rec in enumerate(recs):
    try:
      image = augment.Head(OUT, train=False)(records.parse(rec)[0], key=0)
      expected[i] = hashlib.sha1(image.tobytes()).hexdigest()
    except (records.RecordError, decode.DecodeError):
      pass
  assert 10 < len(expected) < 40
  write_dataset(tmp_path / "data", recs, ["a", "b", "c"])

  def dataset(on_error):
    return pipeline.make_dataset(
      tmp_path / "data",
      batch_size=8,
      train=False,
      image_size=OUT,
      on_error=on_error,
      shard_index=0,
      shard_count=1,
      performance=dict(num_threads=2),
    )

  served = [
    hashlib.sha1(image.tobytes()).hexdigest()
    for b in dataset("skip")
    for image, real in zip(b["image"], b["mask"], strict=True)
    if real
  ]
  assert served == list(expected.values())
  first_bad = min(set(range(40)) - set(expected))
  with pytest.raises(BadRecordError, match=f"00001 record {first_bad}:"):
    list(dataset("raise"))


if __name__ == "__main__":
  serve()
