"""`manifest.json`: what a converted dataset holds (splits, shards, classes, skipped files).

    {"format": "grain-pipeline/1", "classes": ["cat", "dog"],
     "keys": {"image": ..., "label": ..., "filename": ...},
     "splits": {"train": {"num_records": 10, "shards": [
         {"file": "train.array_record-00000-of-00001", "num_records": 10, "sha256": "...",
          "bytes": 123456, "crc32c": "1a2b3c4d"}]}},
     "skipped": [{"path": "cat/bad.jpg", "reason": "truncated JPEG"}],
     "created_by": {"tool": "pipeline.convert images", "version": "0.1.0",
                    "args": {...}, "source": "/data/imagenet", "splits": ["train"]}}

`checked_shards` is what a reader calls at open: it refuses a dataset whose files do not
match the manifest (missing, not regular files, another size, counts that do not add up, and
for gs:// objects another CRC32C than the shard's: GCS keeps every object's CRC32C, so one
metadata request per shard checks its content). `pin` and `check_pinned` keep a reader on the
files it checked (local: device, inode, size, mtime; gs://: the object's generation): a shard
replaced later (a `convert --overwrite`, an object overwritten) is refused when the reader
opens it. Manifests written before shards had a "crc32c" still open, with the size check.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import reprlib
import stat
from typing import Any

from etils import epath

from pipeline import remote
from pipeline.records import Keys

FILENAME = "manifest.json"
FORMAT = "grain-pipeline/1"
BUILD_DIR = ".convert-build"  # where a conversion into the folder writes until it is done
VERIFY_LEVELS = ("none", "size", "sha256")


class ManifestError(ValueError):
  """A manifest that is unreadable or does not match its files; one line naming the file."""


class ShardReplacedError(OSError):
  """A shard that is not the file its reader pinned when the dataset was opened."""


@dataclasses.dataclass
class Shard:
  file: str
  num_records: int
  sha256: str
  bytes: int | None = None  # file size; manifests written before it existed lack it
  crc32c: str | None = None  # of the whole file, 8 hex digits (GCS keeps it per object)


@dataclasses.dataclass
class Split:
  num_records: int
  shards: list[Shard]


@dataclasses.dataclass
class Manifest:
  classes: list[str]
  splits: dict[str, Split]
  skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
  keys: Keys = Keys()
  created_by: dict[str, Any] = dataclasses.field(default_factory=dict)
  # the file it was read from, for messages; a TFDS build's is dataset_info.json. Not saved.
  read_from: str = dataclasses.field(default=FILENAME, compare=False)

  @property
  def num_classes(self) -> int:
    return len(self.classes)

  def shard_paths(self, data_dir, split: str) -> list[epath.Path]:
    """Paths of a split's shards, in order; a clear error names a missing split."""
    if split not in self.splits:
      raise KeyError(
        f"split {split!r} not in {epath.Path(data_dir) / self.read_from}; it has "
        f"{sorted(self.splits)}"
      )
    return [epath.Path(data_dir) / s.file for s in self.splits[split].shards]

  def to_json(self) -> dict[str, Any]:
    d = {"format": FORMAT, **dataclasses.asdict(self)}
    del d["read_from"]
    for split in d["splits"].values():
      for shard in split["shards"]:
        for key in ("bytes", "crc32c"):
          if shard[key] is None:
            del shard[key]
    return d


_SHOW = reprlib.Repr()  # a value in one short line, however big or deep
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother = 3, 60, 60
INT64 = 2**63  # counts and sizes beyond int64 are no file's


def _show(value: Any) -> str:
  return _SHOW.repr(value)


def _field(d: Any, key: str, kind: type, where: str) -> Any:
  if not isinstance(d, dict) or key not in d:
    raise ManifestError(f"{where}: missing field {key!r}")
  value = d[key]
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise ManifestError(f"{where}: field {key!r} is {_show(value)}, not {kind.__name__}")
  return value


def _count(d: Any, key: str, where: str) -> int:
  value = _field(d, key, int, where)
  if not 0 <= value < INT64:
    raise ManifestError(f"{where}: field {key!r} is {_show(value)}, not a count")
  return value


def _name(text: str) -> bool:
  """A name fit for paths and one-line messages: no control characters (NUL, newline)."""
  return text.isprintable()


def _shard(d: Any, where: str) -> Shard:
  file = _field(d, "file", str, where)
  if not _name(file) or not file or os.path.basename(file) != file or file in (".", ".."):
    raise ManifestError(
      f"{where}: shard file {_show(file)} is not a file name in the dataset folder"
    )
  size = d.get("bytes")
  if size is not None and (
    not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < INT64
  ):
    raise ManifestError(f"{where}: field 'bytes' is {_show(size)}, not a size")
  crc = d.get("crc32c")
  if crc is not None and not (isinstance(crc, str) and len(crc) == 8 and _is_hex(crc)):
    raise ManifestError(f"{where}: field 'crc32c' is {_show(crc)}, not 8 hex digits")
  sha256 = _field(d, "sha256", str, where)
  return Shard(file, _count(d, "num_records", where), sha256, size, crc)


def _is_hex(text: str) -> bool:
  return all(c in "0123456789abcdef" for c in text)


def _utf8(text: str) -> bool:
  """Whether `text` encodes as UTF-8 (JSON's "\\ud800" is a lone surrogate, which does not)."""
  try:
    text.encode()
  except UnicodeEncodeError:
    return False
  return True


def _strings(value: Any) -> bool:
  return isinstance(value, list) and all(isinstance(v, str) for v in value)


def check_classes(classes: list[str], where: str) -> None:
  """Refuses a class named twice (its second label would read as the first), naming `where`."""
  first: dict[str, int] = {}
  for label, name in enumerate(classes):
    if (seen := first.setdefault(name, label)) != label:
      raise ManifestError(f"{where}: class {name!r} is named twice (labels {seen} and {label})")


def _provenance(created_by: Any, where: str) -> None:
  """`created_by` and its `added` entries: objects, whose "splits" (if any) are split names
  and "reencoded" (if any) a list; what `pipeline.convert` reads back when it adds a split."""
  entries = [created_by]
  if isinstance(created_by, dict) and "added" in created_by:
    added = created_by["added"]
    entries += added if isinstance(added, list) else [None]
  for e in entries:
    if not isinstance(e, dict):
      raise ManifestError(f"{where}: created_by and its 'added' entries must be objects")
    if not _strings(e.get("splits", [])) or not isinstance(e.get("reencoded", []), list):
      raise ManifestError(f"{where}: created_by {_show(e)} has malformed splits or reencoded")


def splits_from_json(splits_json: dict[str, Any], where: str) -> dict[str, Split]:
  """Splits from their JSON form: names without control characters, counts, shards that are
  files of the dataset folder, each listed once; `ManifestError` names `where`."""
  splits, listed = {}, {}
  for name, s in splits_json.items():
    if not _name(name):
      raise ManifestError(f"{where}: split name {_show(name)} holds control characters")
    shards = _field(s, "shards", list, f"{where} split {name!r}")
    splits[name] = Split(
      _count(s, "num_records", f"{where} split {name!r}"),
      [_shard(sh, f"{where} split {name!r} shard {i}") for i, sh in enumerate(shards)],
    )
    for i, sh in enumerate(splits[name].shards):  # else its records would be served twice
      if sh.file in listed:
        raise ManifestError(
          f"{where}: shard {sh.file!r} is listed twice ({listed[sh.file]} and split {name!r} "
          f"shard {i})"
        )
      listed[sh.file] = f"split {name!r} shard {i}"
  return splits


def from_json(d: dict[str, Any], where: str = FILENAME) -> Manifest:
  """A Manifest from its JSON form; `ManifestError` names `where` and the bad field."""
  if not isinstance(d, dict):
    raise ManifestError(f"{where}: not a JSON object")
  if d.get("format", FORMAT) != FORMAT:
    raise ManifestError(f"{where}: format {_show(d['format'])} is not {FORMAT!r}")
  classes = _field(d, "classes", list, where)
  if not _strings(classes):
    raise ManifestError(f"{where}: classes must be strings")
  check_classes(classes, where)
  splits = splits_from_json(_field(d, "splits", dict, where), where)
  keys = d.get("keys", {})
  try:
    keys = Keys(**keys)
  except TypeError:
    raise ManifestError(f"{where}: keys {_show(keys)} are not image/label/filename") from None
  if not all(isinstance(k, str) and _utf8(k) for k in dataclasses.astuple(keys)):
    raise ManifestError(f"{where}: keys {_show(d['keys'])}: feature keys must be UTF-8 strings")
  skipped, created_by = d.get("skipped", []), d.get("created_by", {})
  if not isinstance(skipped, list) or not all(
    isinstance(e, dict) and _strings(list(e.values())) and {"path", "reason"} <= e.keys()
    for e in skipped
  ):
    raise ManifestError(f"{where}: skipped must be a list of {{path, reason}} objects")
  _provenance(created_by, where)
  return Manifest(
    classes=list(classes),
    splits=splits,
    skipped=list(skipped),
    keys=keys,
    created_by=dict(created_by),
  )


def _is_local(path: epath.Path) -> bool:
  return "://" not in os.fspath(path)


def _regular_size(path: epath.Path) -> int | None:
  """The size of a regular file, None if `path` is something else; never opens it."""
  if _is_local(path):
    st = os.stat(path)
    return st.st_size if stat.S_ISREG(st.st_mode) else None
  st = remote.call(path.stat, path)
  return None if st.is_directory else st.length


def load(data_dir) -> Manifest:
  """Reads `data_dir/manifest.json`; a missing one is `FileNotFoundError`, a damaged one
  `ManifestError`, each naming the file; a bucket this host cannot read (no gcsfs, no
  credentials) is one `RemoteStorageError` line (`pipeline.remote.check`). A TFDS ArrayRecord
  build (its version folder, or tfds://name[:version]) has none: `pipeline.tfds_folder`
  makes its Manifest."""
  from pipeline import tfds_folder

  if tfds_folder.is_uri(data_dir):
    return tfds_folder.load(data_dir)
  remote.check(data_dir)
  path, missing = epath.Path(data_dir) / FILENAME, False
  try:
    size = _regular_size(path)
  except FileNotFoundError:
    missing = True
  if missing and tfds_folder.is_build(data_dir):
    return tfds_folder.load(data_dir)
  if missing:
    if _is_local(path) and os.path.isdir(os.path.join(os.fspath(data_dir), BUILD_DIR)):
      raise FileNotFoundError(
        f"{path} not found: a conversion into {data_dir} is running or was interrupted; "
        "re-run it to finish"
      ) from None
    raise FileNotFoundError(
      f"{path} not found: convert the dataset first (python -m pipeline.convert --help)"
      + tfds_folder.hint(data_dir)
    ) from None
  if size is None:
    raise ManifestError(f"{path} is not a regular file")
  read = remote.on_mount if _is_local(path) else remote.call
  text = read(path.read_bytes, path)
  try:
    data = json.loads(text)
  except (ValueError, UnicodeDecodeError) as e:
    raise ManifestError(f"{path} is not valid JSON (truncated or damaged?): {e}") from None
  except RecursionError:
    raise ManifestError(f"{path} is nested too deeply to be a manifest") from None
  return from_json(data, os.fspath(path))


def dumps(manifest: Manifest) -> str:
  """The text of manifest.json."""
  return json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n"


def save(manifest: Manifest, data_dir) -> None:
  """Writes the manifest atomically (temporary name, then rename over the old one)."""
  path = epath.Path(data_dir) / FILENAME
  tmp = path.parent / f".{FILENAME}.tmp-{os.getpid()}"
  tmp.write_text(dumps(manifest))
  tmp.replace(path)


def _sha256(path: epath.Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    while block := f.read(1 << 22):
      h.update(block)
  return h.hexdigest()


def _gcs_object(path) -> dict | None:
  """A gs:// object's metadata (size, generation, crc32c) from gcsfs, fresh (not a listing
  cached earlier): one request. None where gcsfs is not installed (then only a size is known)."""
  if importlib.util.find_spec("gcsfs") is None:
    return None
  from etils.epath.backend import fsspec_backend

  fs = fsspec_backend.fs(os.fspath(path))
  fs.invalidate_cache(os.fspath(path))
  return fs.info(os.fspath(path))


def _look(path) -> tuple[int | None, tuple | None, str | None]:
  """(size, pin, crc32c) of a shard from one stat or one object metadata request, never a read:
  size None if it is not a regular file (or object); pin (see `pin`) and crc32c (8 hex digits,
  gs:// objects only) None where not known."""
  if _is_local(path):
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
      return None, None, None
    return st.st_size, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), None
  gs = os.fspath(path).startswith("gs://")
  info = remote.call(lambda: _gcs_object(path), path) if gs else None  # deadline, retries
  if info is None:
    st = remote.call(epath.Path(path).stat, path)
    return (None if st.is_directory else st.length), None, None
  if info.get("type") != "file":
    return None, None, None
  size, crc = int(info["size"]), info.get("crc32c")
  return (
    size,
    ("gs", str(info.get("generation")), size),
    base64.b64decode(crc).hex() if crc else None,
  )


def _checked(data_dir, meta: Manifest, split: str, verify: str) -> tuple[list[epath.Path], list]:
  """`checked_shards`, plus the pin of each shard taken by the same stat or request."""
  if verify not in VERIFY_LEVELS:
    raise ValueError(f"verify must be one of {VERIFY_LEVELS}, not {verify!r}")
  where = epath.Path(data_dir) / meta.read_from
  if split not in meta.splits:
    raise ManifestError(f"split {split!r} not in {where}; it has {sorted(meta.splits)}")
  s = meta.splits[split]
  total = sum(sh.num_records for sh in s.shards)
  if s.num_records != total:
    raise ManifestError(
      f"{where}: split {split!r} says {s.num_records} records but its shards hold {total}"
    )
  paths = [epath.Path(data_dir) / sh.file for sh in s.shards]
  pins = []
  if verify == "none":  # but never a FIFO or device a reader would block on (local: one stat)
    for path in paths:
      pinned = None
      if _is_local(path):
        with contextlib.suppress(FileNotFoundError):  # missing: the reader says so at open
          if not (pinned := _look(path)[1]):
            raise ManifestError(f"shard {path} is not a regular file")
      pins.append(pinned)
    return paths, pins
  for path, sh in zip(paths, s.shards):
    try:
      size, pinned, crc = _look(path)
    except FileNotFoundError:
      raise ManifestError(f"shard {path} is missing") from None
    if size is None:
      raise ManifestError(f"shard {path} is not a regular file")
    if sh.bytes is not None and size != sh.bytes:
      raise ManifestError(
        f"shard {path} has {size} bytes, {where} says {sh.bytes}: it changed after conversion"
      )
    if crc is not None and sh.crc32c is not None and crc != sh.crc32c:
      raise ManifestError(
        f"shard {path} has crc32c {crc}, {where} says {sh.crc32c}: it changed after conversion"
      )
    if verify == "sha256" and not sh.sha256:
      raise ManifestError(f"{where} records no sha256 of {path.name}: use verify='size'")
    if verify == "sha256" and (digest := _sha256(path)) != sh.sha256:
      raise ManifestError(
        f"shard {path} has sha256 {digest[:12]}..., {where} says "
        f"{sh.sha256[:12]}...: it changed after conversion"
      )
    pins.append(pinned)
  return paths, pins


def checked_shards(data_dir, meta: Manifest, split: str, verify: str = "size") -> list[epath.Path]:
  """The split's shard paths after checking them against the manifest, for a reader to open.

  Always: the split exists and its `num_records` is the sum of its shards' counts.
  verify="size" (cheap: one stat, or for gs:// one metadata request, per shard): each shard is
  a regular file of the recorded size (manifests without sizes skip the size check), and a
  gs:// object has the recorded CRC32C; "sha256": also its full digest; "none": no per-file
  checks but, where local, that each is a regular file (a reader would block forever on a
  FIFO). Raises `ManifestError` naming the file.
  """
  return _checked(data_dir, meta, split, verify)[0]


def pin(path) -> tuple | None:
  """What identifies the shard at `path` now, without reading it: local files (device, inode,
  size, mtime), one stat; gs:// objects ("gs", generation, size), one metadata request; None
  where neither is known (gs:// without gcsfs)."""
  return _look(path)[1]


def cache_key(pinned: tuple | None) -> str:
  """The part of a pin that names the shard's content across restarts and remounts (not the
  inode, which gcsfuse numbers anew per mount): what record cache entries are tied to."""
  if pinned is None:
    return "unpinned"
  return f"gs:{pinned[1]}" if pinned[0] == "gs" else f"{pinned[2]}:{pinned[3]}"


def check_pinned(path, pinned: tuple | None) -> None:
  """Refuses a shard that is no longer the file pinned when the dataset was opened.

  Call it just after opening the shard: files are replaced by rename (objects by a new
  generation), so if the path is still the pinned one then, the reader opened the pinned file.
  Raises `ShardReplacedError` (an OSError, as readers report a file that went away).
  """
  if pinned is None:
    return
  try:
    now = pin(path)
  except FileNotFoundError:
    now = None
  if now != tuple(pinned):
    raise ShardReplacedError(
      f"shard {path} was replaced after this dataset was opened (a conversion with "
      "--overwrite, an object written again?): open the dataset again to read the new one"
    )


def pinned_shards(data_dir, meta: Manifest, split: str, verify: str = "size"):
  """`checked_shards`, plus each shard's `pin`, taken while `meta` is still the manifest in
  `data_dir` (a conversion swaps shards in only after removing or replacing it)."""
  paths, pins = _checked(data_dir, meta, split, verify)
  try:
    still = load(data_dir) == meta
  except (FileNotFoundError, ManifestError):
    still = False
  if not still:
    raise ManifestError(
      f"{epath.Path(data_dir) / FILENAME} changed while the dataset was being opened "
      "(a conversion into it?): open it again"
    )
  return paths, pins
