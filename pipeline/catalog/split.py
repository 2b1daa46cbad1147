"""A split opened for reading: the dataset's manifest (a converted dataset's manifest.json, or
a TFDS ArrayRecord build's, `pipeline.catalog.tfds_folder`) and the split's shards, checked
against it and pinned, as one record source."""

from __future__ import annotations

from etils import epath

from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import tfds_folder
from pipeline.host import guards
from pipeline.storage import backend
from pipeline.storage.source import ShardedSource


def open(data_dir, split: str, verify: str = "size", deadline_s: float | None = None):
  """(manifest, source, pins): the split's shards, checked against the manifest (`verify`:
  `pipeline.catalog.manifest.pinned_shards`), each pinned to the file as opened, those listed
  with 0 records opened to check they hold none (no read would); on a mount
  each stat and read waits at most `deadline_s` (None: `backend.Mount`'s)."""
  data_dir = tfds_folder.resolve(data_dir, deadline_s)
  meta = manifest_lib.load(data_dir, deadline_s)  # first checks that this host can read it
  data_dir = epath.Path(data_dir)
  paths, pins = manifest_lib.pinned_shards(data_dir, meta, split, verify, deadline_s)
  counts = [s.num_records for s in meta.splits[split].shards]
  source = ShardedSource(paths, counts, pins)
  backend.of(data_dir).guard(source.open_empty, data_dir, deadline_s)
  guards.check_address_space(f"split {split!r} of {data_dir}")
  return meta, source, pins
