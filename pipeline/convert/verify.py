"""`verify OUT`: re-reads every shard and checks it against manifest.json (or a TFDS build's
dataset_info.json).

Checks each shard's existence, size, sha256 (and crc32c, and a gs:// object's generation)
where recorded and record count, parses every record, checks every label against the class
count and fully decodes every image. Problems name the shard and record index; the CLI exits
non-zero if there is any. On a mount every read waits at most the deadline (`--read-deadline-s`),
in the worker processes too: a mount that stops answering is one line, not a wait forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import stat
from collections.abc import Callable
from typing import TypeVar

import google_crc32c
from array_record.python import array_record_module
from etils import epath

from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.convert import bucket, checks, shards
from pipeline.convert.shards import Progress
from pipeline.storage import backend, remote

_RANGE = 256  # records per verification task
_READ_ERRORS = (RuntimeError, ValueError, OSError)
T = TypeVar("T")
Wait = Callable[[Callable[[], T]], T]  # how a read of one file waits (`_waits`)


@dataclasses.dataclass
class Report:
  """What `verify` found: records read per split, every problem, one line each, and what
  could not be checked."""

  data_dir: str
  num_records: dict[str, int]
  problems: list[str]
  unchecked: str = ""

  @property
  def ok(self) -> bool:
    return not self.problems

  def __str__(self) -> str:
    counts = ", ".join(f"{s}: {n}" for s, n in self.num_records.items())
    head = f"{self.data_dir}: {counts} records; "
    if self.ok:
      return head + "OK" + (f" ({self.unchecked})" if self.unchecked else "")
    lines = [head + f"{len(self.problems)} problems:"]
    return "\n".join(lines + [f"  {p}" for p in self.problems])


def _waits(path: str, deadline_s: float | None) -> Wait:
  """How each read of `path` waits: on a mount at most `deadline_s` (`backend.Mount.guard`:
  then one `RemoteStorageError` line), elsewhere as it is (gs:// reads have their own)."""
  storage = backend.of(path)
  if bucket.is_url(path):
    return lambda fn: fn()
  return lambda fn: storage.guard(fn, path, deadline_s)


def _size(path: str, wait: Wait) -> tuple[int | None, str | None]:
  """(size, generation) of a regular file or object: size None for anything else, generation
  a gs:// object's (else None)."""
  if bucket.is_url(path):
    size, pinned, _ = backend.look(path)
    return size, pinned[1] if pinned and pinned[0] == "gs" else None
  st = wait(lambda: os.stat(path))
  return (st.st_size if stat.S_ISREG(st.st_mode) else None), None


def _digests(path: str, wait: Wait) -> tuple[str, str]:
  """(sha256, crc32c) of a file, or of an object as read back (not its stored CRC32C)."""
  h, crc = hashlib.sha256(), google_crc32c.Checksum()
  with wait(lambda: epath.Path(path).open("rb")) as f:
    while block := wait(lambda: f.read(1 << 22)):
      h.update(block)
      crc.update(block)
  return h.hexdigest(), crc.hexdigest().decode()


def _check_file(
  path: str, shard: manifest_lib.Shard, source: str, wait: Wait
) -> tuple[bool, list[str]]:
  """Shard-level checks (a regular file, size, sha256, record count): (readable, problems).

  The file is stat'ed before it is opened: opening a FIFO would wait forever. A gs:// object
  is looked up (one metadata request) and read once for its digests."""
  try:
    size, generation = _size(path, wait)
  except FileNotFoundError:
    return False, [f"{shard.file}: missing"]
  if size is None:
    return False, [f"{shard.file}: not a regular file"]
  problems = []
  if None not in (generation, shard.generation) and generation != shard.generation:
    problems.append(
      f"{shard.file}: generation {generation} != {source} {shard.generation} (the object was "
      "replaced after conversion)"
    )
  if shard.bytes is not None and size != shard.bytes:
    problems.append(f"{shard.file}: {size} bytes, {source} says {shard.bytes}")
  if shard.sha256 or shard.crc32c is not None:
    digest, crc32c = _digests(path, wait)
    if shard.sha256 and digest != shard.sha256:
      problems.append(f"{shard.file}: sha256 {digest[:12]}... != {source} {shard.sha256[:12]}...")
    if shard.crc32c is not None and crc32c != shard.crc32c:
      problems.append(f"{shard.file}: crc32c {crc32c} != {source} {shard.crc32c}")
  try:
    reader = wait(lambda: array_record_module.ArrayRecordReader(path))
    count = reader.num_records()
    wait(reader.close)
  except remote.RemoteStorageError:
    raise
  except _READ_ERRORS as e:  # what the C++ reader raises on a damaged file
    return False, problems + [f"{shard.file}: unreadable ArrayRecord file ({e})"]
  if count != shard.num_records:
    problems.append(f"{shard.file}: {count} records, {source} says {shard.num_records}")
  return True, problems


def _check_record(data: bytes, keys: records.Keys, num_classes: int) -> str | None:
  try:
    image, label, _ = records.parse(data, keys)
  except records.RecordError as e:
    return str(e)
  if not 0 <= label < num_classes:
    return f"label {label} out of range [0, {num_classes})"
  try:
    checks.decode_rgb(image)
  except (checks.BadImage, ValueError) as e:
    return f"image does not decode ({e})"
  return None


def _check_range(
  task: tuple[str, int, int],
  *,
  data_dir: str,
  keys: records.Keys,
  num_classes: int,
  shard_info: dict[str, manifest_lib.Shard],
  source: str,
  deadline_s: float | None = None,
) -> tuple[int, list[str]]:
  """Worker: (records read, problems) for records [start, stop) of a shard; on a mount each
  read waits at most `deadline_s`."""
  name, start, stop = task
  path = os.path.join(data_dir, name)
  wait = _waits(path, deadline_s)
  if start == 0:
    readable, problems = _check_file(path, shard_info[name], source, wait)
  else:  # the task starting at record 0 reports a missing or odd file
    readable, problems = bucket.is_url(path) or wait(lambda: os.path.isfile(path)), []
  if not readable:
    return 0, problems
  read = 0
  try:
    reader = wait(lambda: array_record_module.ArrayRecordReader(path))
  except remote.RemoteStorageError:
    raise
  except _READ_ERRORS:  # reported by the task that starts at record 0
    return 0, problems
  try:
    stop, batch = min(stop, reader.num_records()), None
    if bucket.is_url(path):  # one request for the range; record by record if it fails
      with contextlib.suppress(*_READ_ERRORS):
        batch = reader.read(list(range(start, stop)))
    for index in range(start, stop):
      try:
        data = (
          batch[index - start]
          if batch is not None
          else wait(functools.partial(reader.read, [index]))[0]
        )
      except remote.RemoteStorageError:
        raise
      except _READ_ERRORS as e:
        problems.append(f"{name} record {index}: unreadable ({e})")
        continue
      read += 1
      if (problem := _check_record(data, keys, num_classes)) is not None:
        problems.append(f"{name} record {index}: {problem}")
    wait(reader.close)
  except remote.RemoteStorageError:
    raise
  except _READ_ERRORS as e:  # a damaged file can fail in close() as well
    problems.append(f"{name}: unreadable after record {start + read} ({e})")
  return read, problems


def verify(
  out: str | os.PathLike,
  *,
  workers: int | None = None,
  progress: bool = True,
  deadline_s: float | None = None,
) -> Report:
  """Checks every shard and record of the dataset in `out` against its manifest; on a mount
  each read (the manifest's, the shards', in the worker processes too) waits at most
  `deadline_s` (None: `backend.Mount`'s), then raises `RemoteStorageError`."""
  out = os.fspath(out)
  try:
    m = manifest_lib.load(out, deadline_s)
  except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
    return Report(out, {}, [f"manifest: {e}"])
  info = {s.file: s for split in m.splits.values() for s in split.shards}
  if not manifest_lib.written_here(out, m):  # a copy: its objects have other generations
    info = {f: dataclasses.replace(s, generation=None) for f, s in info.items()}
  tasks = [
    (s.file, a, a + _RANGE)
    for split in m.splits.values()
    for s in split.shards
    for a in range(0, max(s.num_records, 1), _RANGE)
  ]
  work = functools.partial(
    _check_range,
    data_dir=out,
    keys=m.keys,
    num_classes=m.num_classes,
    shard_info=info,
    source=m.read_from,
    deadline_s=deadline_s,
  )
  read: dict[str, int] = {}
  problems: list[str] = []
  if not m.classes:
    problems.append("manifest: no classes")
  if not m.splits:
    problems.append("manifest: no splits")
  for split, s in m.splits.items():
    if s.num_records != sum(sh.num_records for sh in s.shards):
      problems.append(
        f"manifest: split {split} has {s.num_records} records but its shards "
        f"hold {sum(sh.num_records for sh in s.shards)}"
      )
    if s.num_records == 0:
      problems.append(f"manifest: split {split} has no records")
  split_of = {s.file: name for name, split in m.splits.items() for s in split.shards}
  workers = min(workers or os.cpu_count() or 1, len(tasks))
  with Progress(
    sum(s.num_records for s in info.values()), f"verify {out}", "record", progress
  ) as bar:
    for (name, _, _), (count, found) in zip(tasks, shards.ordered_map(work, tasks, workers)):
      read[split_of[name]] = read.get(split_of[name], 0) + count
      problems += found
      bar.update(count)
  undigested = any(not s.sha256 for s in info.values())
  unchecked = f"{m.read_from} records no sha256: no digest compared" if undigested else ""
  return Report(out, {name: read.get(name, 0) for name in m.splits}, problems, unchecked)
