"""TFRecord (and prepared ArrayRecord) files of `tf.train.Example`s to our shards, bytes copied.

A TFRecord is `uint64 length | uint32 masked crc32c(length) | data | uint32 masked
crc32c(data)`; both checksums are verified without TensorFlow (CRC32C in numpy). Every record
is parsed, its label checked against the class count and its image decoded; records whose
image does not decode are skipped and listed, anything else wrong is an error naming the
file and record index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import numpy as np
from array_record.python import array_record_module
from google.protobuf import message as protobuf_message

from pipeline import __version__
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.convert import bucket, checks, shards

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


class TFRecordError(ValueError):
  """A damaged or unreadable input record; the message names the file and record index."""


def _make_table() -> list[int]:
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ (_POLY if c & 1 else 0)
    table.append(c)
  return table


_TABLE_LIST = _make_table()
_TABLE = np.array(_TABLE_LIST, np.uint32)


def _apply(tables: np.ndarray, c: np.ndarray) -> np.ndarray:
  """Applies a linear map on CRC registers given as four per-byte lookup tables."""
  return (
    tables[0][c & 0xFF]
    ^ tables[1][(c >> 8) & 0xFF]
    ^ tables[2][(c >> 16) & 0xFF]
    ^ (tables[3][c >> 24])
  )


@functools.cache
def _zeros_tables(n: int) -> np.ndarray:
  """Lookup tables of the map "register -> register after n zero bytes" (n a power of 2)."""
  if n == 16:
    v = np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]
    for _ in range(n):
      v = _TABLE[v & 0xFF] ^ (v >> 8)
    return v
  half = _zeros_tables(n // 2)
  return _apply(half, half)


def crc32c(data: bytes) -> int:
  """CRC-32C of `data`, vectorized: equal chunks in parallel, then combined pairwise.

  Leading zero bytes leave a zero register unchanged, so the data is zero-padded in front
  to whole chunks (and chunk counts to even ones); the initial register is folded into the
  first four bytes.
  """
  n = len(data)
  if n < 256:
    crc = 0xFFFFFFFF
    for b in data:
      crc = _TABLE_LIST[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF
  chunk = 64 if n >= 1 << 16 else 16
  k = -(-n // chunk)
  buf = np.zeros(k * chunk, np.uint8)
  buf[-n:] = np.frombuffer(data, np.uint8)
  buf[-n : -n + 4] ^= 0xFF
  columns = np.ascontiguousarray(buf.reshape(k, chunk).T)
  c = np.zeros(k, np.uint32)
  low_byte, index, looked_up = c.view(np.uint8)[0::4], np.empty(k, np.uint8), np.empty_like(c)
  for column in columns:
    np.bitwise_xor(low_byte, column, out=index)
    np.take(_TABLE, index, out=looked_up)
    np.right_shift(c, 8, out=c)
    np.bitwise_xor(c, looked_up, out=c)
  length = chunk
  while len(c) > 1:
    if len(c) % 2:  # a leading all-zero chunk changes nothing
      c = np.concatenate([np.zeros(1, np.uint32), c])
    c = _apply(_zeros_tables(length), c[0::2]) ^ c[1::2]
    length *= 2
  return int(c[0]) ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def scan(path: str) -> list[tuple[int, int]]:
  """(offset, length) of each record of a TFRecord file, checking headers and file size."""
  spans, size = [], bucket.stat(path).st_size
  with bucket.open_file(path) as f:
    offset = 0
    while offset < size:
      header = f.read(12)
      where = f"{path}: record {len(spans)} at byte {offset}"
      if len(header) < 12:
        raise TFRecordError(f"{where}: truncated header ({len(header)} of 12 bytes)")
      length, crc = struct.unpack("<QI", header)
      if masked_crc32c(header[:8]) != crc:
        raise TFRecordError(f"{where}: length checksum mismatch (not a TFRecord, or corrupt)")
      if offset + 16 + length > size:
        raise TFRecordError(
          f"{where}: truncated record ({length} bytes announced, {size - offset - 16} left)"
        )
      spans.append((offset, length))
      offset += 16 + length
      f.seek(offset)
  return spans


def read_record(f, path: str, index: int, offset: int, length: int) -> bytes:
  """Reads one record at a known offset and verifies its data checksum."""
  f.seek(offset + 12)
  data = f.read(length)
  (crc,) = struct.unpack("<I", f.read(4))
  if len(data) != length or masked_crc32c(data) != crc:
    raise TFRecordError(f"{path}: record {index} at byte {offset}: data checksum mismatch")
  return data


def read_items(
  task: Sequence[tuple],
  files: Sequence[str],
  open_file: Callable[[str], BinaryIO] = bucket.open_file,
) -> list[tuple[str, bytes]]:
  """(place, record bytes) for items ("tfrecord", file, index, offset, length) or
  ("array_record", file, index); `open_file` opens a TFRecord file for seeks and reads."""
  out, handles = [], {}
  with contextlib.ExitStack() as stack:
    for kind, file_index, index, *span in task:
      path = files[file_index]
      if path not in handles and kind == "tfrecord":
        handles[path] = stack.enter_context(open_file(path))
      elif path not in handles:
        handles[path] = stack.enter_context(
          contextlib.closing(array_record_module.ArrayRecordReader(path))
        )
      if kind == "tfrecord":
        out.append((f"{path}:{index}", read_record(handles[path], path, index, *span)))
      else:
        out.append((f"{path}:{index}", handles[path].read([index])[0]))
  return out


def process(
  task: Sequence[tuple],
  *,
  files: Sequence[str],
  keys: records.Keys,
  num_classes: int,
  max_pixels: int,
  open_file: Callable[[str], BinaryIO] = bucket.open_file,
) -> list[shards.Outcome]:
  """Worker: verifies each record (checksum, parse, label range, image) and passes its bytes;
  `open_file` opens the TFRecord files (e.g. through Beam's FileSystems)."""
  outcomes: list[shards.Outcome] = []
  for place, data in read_items(task, files, open_file):
    try:
      image, label, _ = records.parse(data, keys)
    except records.RecordError as e:
      raise records.RecordError(f"{place}: {e}") from None
    if not 0 <= label < num_classes:
      raise records.RecordError(f"{place}: label {label} out of range [0, {num_classes})")
    try:
      checks.inspect(image, max_pixels)
    except checks.BadImage as e:
      outcomes.append((None, {"path": place, "reason": str(e)}, None))
      continue
    outcomes.append((data, None, None))
  return outcomes


def load_classes(
  classes: str | os.PathLike | Sequence[str] | None, num_classes: int | None
) -> list[str]:
  """Class names from a names-per-line file or a list, or "0".."N-1" from a count."""
  where = "classes"
  if isinstance(classes, (str, os.PathLike)):
    where = os.fspath(classes)
    with open(classes) as f:
      classes = [line.strip() for line in f if line.strip()]
  if classes is not None:
    manifest_lib.check_classes(list(classes), where)
    if num_classes is not None and num_classes != len(classes):
      raise ValueError(f"num_classes {num_classes} != {len(classes)} class names")
    return list(classes)
  if num_classes is None or num_classes <= 0:
    raise ValueError(
      "the label range check needs the class count: pass num_classes "
      "(--num-classes) or class names (--classes FILE)"
    )
  return [str(i) for i in range(num_classes)]


@dataclasses.dataclass(frozen=True)
class Request:
  """TFRecord files (a glob or several, sorted) to copy into `out`, and how (`convert
  tfrecord`'s flags). Keys are detected from the first record unless given; labels must lie
  in [0, num_classes), or index `classes` (a names-per-line file or a list). Splits of
  another conversion already in `out` are replaced only with `overwrite`."""

  pattern: str | Sequence[str]
  out: str | os.PathLike
  _: dataclasses.KW_ONLY
  split: str = "train"
  keys: records.Keys | None = None
  num_classes: int | None = None
  classes: str | os.PathLike | Sequence[str] | None = None
  shard_size_mb: float = shards.DEFAULT_SHARD_SIZE_MB
  max_pixels: int = checks.MAX_PIXELS
  overwrite: bool = False


def copy_job(
  split_items: dict[str, tuple[list[tuple], list[int]]],
  files: list[str],
  request: Any,  # this module's Request or tfds': out, shard_size_mb, max_pixels
  classes: list[str],
  keys: records.Keys,
  created_by: dict[str, Any],
) -> shards.Job:
  """Plans copying records located by `read_items` items, per split in order, into the
  request's OUT (in its shard size, checking images against its `max_pixels`)."""
  shard_bytes = shards.shard_bytes(request.shard_size_mb)
  plans = [
    p
    for split, (items, sizes) in split_items.items()
    for p in shards.plan_split(split, items, sizes, shard_bytes)
  ]
  stats = [(f, st.st_size, st.st_mtime_ns) for f in files for st in [bucket.stat(f)]]
  work = functools.partial(
    process, files=files, keys=keys, num_classes=len(classes), max_pixels=request.max_pixels
  )
  return shards.Job(
    out=os.fspath(request.out),
    plans=plans,
    process=work,
    fp=shards.fingerprint(
      __version__, created_by["args"], classes, keys, stats, [(p.name, len(p.items)) for p in plans]
    ),
    classes=classes,
    splits=list(split_items),
    keys=keys,
    created_by=created_by,
  )


def _files(patterns: list[str]) -> list[str]:
  """The files matching any of `patterns` (local globs or gs:// ones), sorted."""
  files = sorted(
    {f for p in patterns for f in (bucket.glob(p) if bucket.is_url(p) else glob.glob(p))}
  )
  if not files:
    raise FileNotFoundError(f"no TFRecord files match {patterns}")
  return files


def _detect_keys(files: list[str], first: tuple) -> records.Keys:
  """The feature keys of the record `first` (a TFRecord item) names."""
  _, file_index, index, offset, length = first
  with bucket.open_file(files[file_index]) as f:
    data = read_record(f, files[file_index], index, offset, length)
  try:
    return records.detect_keys(data)
  except protobuf_message.DecodeError as e:
    raise records.RecordError(
      f"{files[file_index]}:{index}: not a tf.train.Example ({e})"
    ) from None


def plan(request: Request) -> shards.Job:
  """Lists the TFRecord files (glob, sorted), checks record headers and plans the shards."""
  shards.check_split_name(request.split)
  shards.shard_bytes(request.shard_size_mb)
  if request.max_pixels < 1:
    raise ValueError(f"max_pixels must be a positive number of pixels, got {request.max_pixels}")
  pattern, classes = request.pattern, request.classes
  patterns = [pattern] if isinstance(pattern, str) else [os.fspath(p) for p in pattern]
  files = _files(patterns)
  names = load_classes(classes, request.num_classes)
  items, sizes = [], []
  for file_index, path in enumerate(files):
    for index, (offset, length) in enumerate(scan(path)):
      items.append(("tfrecord", file_index, index, offset, length))
      sizes.append(length)
  if not items:
    raise TFRecordError(f"no records in {files}")
  keys = request.keys if request.keys is not None else _detect_keys(files, items[0])
  args = {
    "pattern": patterns,
    "split": request.split,
    "num_classes": len(names),
    "classes": os.fspath(classes) if isinstance(classes, (str, os.PathLike)) else None,
    "shard_size_mb": request.shard_size_mb,
    "max_pixels": request.max_pixels,
  }
  created_by = {
    "tool": "pipeline.convert tfrecord",
    "version": __version__,
    "args": args,
    "source": [f if bucket.is_url(f) else os.path.abspath(f) for f in files],
  }
  return copy_job({request.split: (items, sizes)}, files, request, names, keys, created_by)


def convert(
  request: Request, workers: int | None = None, progress: bool = True
) -> manifest_lib.Manifest:
  """Copies the records of TFRecord files into ArrayRecord shards in OUT, their bytes
  unchanged and in their order; adds the split to a dataset already in OUT (same classes)."""
  return bucket.convert(plan, request, workers, progress, "convert tfrecord")
