"""`manifest.json`: what a converted dataset holds (splits, shards, classes, skipped files).

    {"format": "grain-pipeline/1", "classes": ["cat", "dog"],
     "keys": {"image": ..., "label": ..., "filename": ...},
     "splits": {"train": {"num_records": 10, "shards": [
         {"file": "train.array_record-00000-of-00001", "num_records": 10, "sha256": "...",
          "bytes": 123456, "crc32c": "1a2b3c4d", "generation": "1700000000000000"}]}},
     "skipped": [{"path": "cat/bad.jpg", "reason": "truncated JPEG"}],
     "created_by": {"tool": "pipeline.convert images", "version": "0.1.0",
                    "args": {...}, "source": "/data/imagenet", "splits": ["train"]},
     "written_to": "gs://bucket/imagenet"}  # converted into a bucket: where "generation"s hold

`from_json` checks every field and names the bad one (`ManifestError`, one line naming the file);
`pipeline.catalog.manifest` reads and writes the file, `pipeline.catalog.tfds_folder` makes a
Manifest of a TFDS build.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
from typing import Any

from etils import epath

from pipeline.catalog.records import Keys
from pipeline.storage.backend import FILENAME  # storage probes it: the name is storage's

FORMAT = "grain-pipeline/1"


class ManifestError(ValueError):
  """A manifest that is unreadable or does not match its files; one line naming the file."""


@dataclasses.dataclass
class Shard:
  file: str
  num_records: int
  sha256: str
  bytes: int | None = None  # file size; manifests written before it existed lack it
  crc32c: str | None = None  # of the whole file, 8 hex digits (GCS keeps it per object)
  generation: str | None = None  # of the gs:// object written by the conversion (decimal)


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
  # the gs:// folder a conversion wrote it into: its shards' generations are of objects there
  # (a copy elsewhere has others), so they are checked only there
  written_to: str | None = None
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
    if d["written_to"] is None:
      del d["written_to"]
    for split in d["splits"].values():
      for shard in split["shards"]:
        for key in ("bytes", "crc32c", "generation"):
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
  gen = d.get("generation")
  if gen is not None and not (isinstance(gen, str) and gen.isdecimal() and gen.isascii()):
    raise ManifestError(f"{where}: field 'generation' is {_show(gen)}, not a decimal string")
  sha256 = _field(d, "sha256", str, where)
  return Shard(file, _count(d, "num_records", where), sha256, size, crc, gen)


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
  written_to = d.get("written_to")
  if written_to is not None and not (isinstance(written_to, str) and _name(written_to)):
    raise ManifestError(f"{where}: field 'written_to' is {_show(written_to)}, not a URL")
  return Manifest(
    classes=list(classes),
    splits=splits,
    skipped=list(skipped),
    keys=keys,
    created_by=dict(created_by),
    written_to=written_to,
  )
