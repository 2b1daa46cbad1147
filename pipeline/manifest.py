"""`manifest.json`: what a converted dataset holds (splits, shards, classes, skipped files).

    {"format": "grain-pipeline/1", "classes": ["cat", "dog"],
     "keys": {"image": ..., "label": ..., "filename": ...},
     "splits": {"train": {"num_records": 10, "shards": [
         {"file": "train.array_record-00000-of-00001", "num_records": 10, "sha256": "..."}]}},
     "skipped": [{"path": "cat/bad.jpg", "reason": "truncated JPEG"}],
     "created_by": {"tool": "pipeline.convert images", "version": "0.1.0",
                    "args": {...}, "source": "/data/imagenet"}}
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from etils import epath

from pipeline.records import Keys

FILENAME = "manifest.json"
FORMAT = "grain-pipeline/1"


@dataclasses.dataclass
class Shard:
  file: str
  num_records: int
  sha256: str


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

  @property
  def num_classes(self) -> int:
    return len(self.classes)

  def shard_paths(self, data_dir, split: str) -> list[epath.Path]:
    """Paths of a split's shards, in order; a clear error names a missing split."""
    if split not in self.splits:
      raise KeyError(f"split {split!r} not in {epath.Path(data_dir) / FILENAME}; "
                     f"it has {sorted(self.splits)}")
    return [epath.Path(data_dir) / s.file for s in self.splits[split].shards]

  def to_json(self) -> dict[str, Any]:
    return {"format": FORMAT, **dataclasses.asdict(self)}


def from_json(d: dict[str, Any]) -> Manifest:
  return Manifest(
      classes=list(d["classes"]),
      splits={
          name: Split(s["num_records"], [Shard(**sh) for sh in s["shards"]])
          for name, s in d["splits"].items()
      },
      skipped=list(d.get("skipped", [])),
      keys=Keys(**d.get("keys", {})),
      created_by=dict(d.get("created_by", {})),
  )


def load(data_dir) -> Manifest:
  path = epath.Path(data_dir) / FILENAME
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: convert the dataset first "
                            "(python -m pipeline.convert --help)")
  return from_json(json.loads(path.read_text()))


def save(manifest: Manifest, data_dir) -> None:
  """Writes the manifest atomically (temporary name, then rename)."""
  path = epath.Path(data_dir) / FILENAME
  tmp = path.parent / f".{FILENAME}.tmp-{os.getpid()}"
  tmp.write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n")
  tmp.replace(path)
