"""A TFDS build read in place: the version folder `tfds build --file_format=array_record`
leaves (dataset_info.json, features.json, label files, `NAME-SPLIT.array_record-NNNNN-of-MMMMM`
shards), local or gs://, or `tfds://name[:version]` under $TFDS_DATA_DIR.

`load` makes its `Manifest` in memory from what TFDS wrote (nothing is written into the
folder, no shard is opened): splits and record counts from dataset_info.json's shardLengths,
the classes and the image and label keys from features.json and the label files, as `python
-m pipeline.convert tfds` would (its copy's batches are the same, bit for bit), and checked as
strictly as a manifest.json (counts, shard names, classes named once). TFDS records
no digest or size per shard, so `Shard.sha256` is "" and `Shard.bytes` None: at open,
verify="size" checks each shard is a regular file, the reader checks its record count against
shardLengths, and verify="sha256" is refused. On a mount (or gs://) the look-up of tfds:// in
$TFDS_DATA_DIR, and the build's metadata files, are each one read within the read deadline.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from etils import epath

from pipeline.catalog import records, schema
from pipeline.catalog.schema import Manifest, ManifestError, Split
from pipeline.storage import backend

SCHEME = "tfds://"
INFO = "dataset_info.json"
FEATURES = "features.json"
TOOL = "tfds build (read in place)"
CHANNELS = (None, 1, 3)  # what the decoder turns into RGB as it is: no alpha, no 2-channel


def is_uri(data_dir) -> bool:
  return os.fspath(data_dir).startswith(SCHEME)


def is_build(folder) -> bool:
  """Whether `folder` holds a TFDS build's dataset_info.json (one stat)."""
  return (epath.Path(folder) / INFO).exists()


def versions(folder) -> list[str]:
  """The version folders of the dataset folder `folder` (those holding a build); lists it."""
  try:
    return sorted(p.parent.name for p in epath.Path(folder).glob(f"*/{INFO}"))
  except OSError:
    return []


def hint(folder) -> str:
  """What to pass instead when `folder` holds TFDS builds but is not one (the dataset's
  folder, above its version folders), or is a version folder that is not there; "" otherwise.
  Lists a folder: call it on errors."""
  folder = epath.Path(folder)
  if found := versions(folder):
    return f"; {folder} holds TFDS builds: pass a version folder, e.g. {folder / found[-1]}"
  if not folder.exists() and (found := versions(folder.parent)):
    return f"; {folder.parent} holds TFDS builds of versions {', '.join(found)}, not {folder.name}"
  return ""


def resolve(data_dir, deadline_s: float | None = None):
  """The version folder of `tfds://name[/config][:version]` (latest version if none) under
  $TFDS_DATA_DIR (default ~/tensorflow_datasets), looked up within `deadline_s` on a mount
  (`backend.Mount.guard`); any other data_dir as it is."""
  if not is_uri(data_dir):
    return data_dir
  import tensorflow_datasets as tfds

  name = os.fspath(data_dir)[len(SCHEME) :]
  root = tfds.core.constants.get_default_data_dir()
  return backend.of(root).guard(lambda: _resolve(data_dir, name, root), root, deadline_s)


def _resolve(data_dir, name: str, root) -> str:
  import tensorflow_datasets as tfds

  try:
    return os.fspath(tfds.core.read_only_builder.builder_from_files(name, data_dir=root).data_dir)
  except Exception:  # noqa: BLE001 - TFDS raises several kinds, each with a long story
    raise FileNotFoundError(f"{data_dir}: {missing(name, root)}") from None


def missing(name: str, root) -> str:
  """Why the TFDS dataset `name` (name[/config][:version]) has no build to read in the data
  dir `root`, naming the versions there are, if any."""
  base = name.split(":")[0]
  if found := versions(epath.Path(root) / base):
    return f"no TFDS build of {name!r} in {root}: it holds {base} {', '.join(found)}"
  return (
    f"no TFDS build of {name!r} in {root} (set TFDS_DATA_DIR): run `tfds build "
    f"{base.split('/')[0]} --file_format=array_record`, or pass its version folder"
  )


def keys_and_classes(info, folder) -> tuple[records.Keys, list[str]]:
  """The record keys and class names of the TFDS build in `folder`: its first `Image` and
  first `ClassLabel`; refuses, naming the file, an image the decoder cannot serve as it is
  and a class named twice."""
  import tensorflow_datasets as tfds

  features, where = info.features, epath.Path(folder) / FEATURES
  found = ", ".join(f"{k}: {type(f).__name__}" for k, f in sorted(features.items()))
  image = next((k for k, f in features.items() if isinstance(f, tfds.features.Image)), None)
  label = next((k for k, f in features.items() if isinstance(f, tfds.features.ClassLabel)), None)
  if image is None:
    raise ManifestError(f"{where}: no Image feature ({found}); the pipeline reads images")
  if label is None:
    raise ManifestError(
      f"{where}: no ClassLabel feature ({found}); the pipeline needs class labels: "
      "declare the label as tfds.features.ClassLabel(names=...) and rebuild"
    )
  f = features[image]
  channels = f.shape[-1] if len(f.shape) == 3 else None
  if np.dtype(f.np_dtype) != np.uint8 or channels not in CHANNELS:
    raise ManifestError(
      f"{where}: image {image!r} is {np.dtype(f.np_dtype)} of shape {f.shape}; the decoder "
      "serves uint8 images of 1 or 3 channels: store 8-bit RGB or grayscale and rebuild"
    )
  filename = "file_name" if "file_name" in features else ""
  classes = list(features[label].names)
  schema.check_classes(
    classes, os.fspath(tfds.features.ClassLabel.get_names_filepath(folder, label))
  )
  return records.Keys(image=image, label=label, filename=filename), classes


def load(data_dir, deadline_s: float | None = None) -> Manifest:
  """The Manifest of a TFDS ArrayRecord build (a version folder or tfds://); refusals are one
  line (`ManifestError`) naming the file and what to do. On a mount, tfds:// is looked up and
  the build's metadata read each within `deadline_s`, else `RemoteStorageError`, one line."""
  import tensorflow_datasets  # noqa: F401 - imported before the wait: an import is no read

  where = epath.Path(resolve(data_dir, deadline_s)) / INFO
  return backend.of(where).guard(lambda: _load(where.parent), where, deadline_s)


def _load(folder: epath.Path) -> Manifest:
  import tensorflow_datasets as tfds

  where = folder / INFO
  try:
    builder = tfds.builder_from_directory(folder)
    info = builder.info
  except Exception as e:  # noqa: BLE001 - TFDS raises several kinds, some over many lines
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    raise ManifestError(
      f"{where}: not a readable TFDS build ({type(e).__name__}: {first})"
    ) from None
  file_format = info.file_format.value if info.file_format else "tfrecord"
  if file_format != "array_record":
    *name, version = info.full_name.split("/")  # name[/config]/version
    root = folder.parents[len(name)]
    fix = (
      f"convert it once: python -m pipeline.convert tfds {'/'.join(name)}:{version} OUT "
      f"--data-dir {root}"
      if file_format == "tfrecord"
      else "rebuild it with tfds build --file_format=array_record"
    )
    raise ManifestError(
      f"{where}: a {file_format} build, which cannot be read in place (no random access): {fix}"
    )
  keys, classes = keys_and_classes(info, folder)
  # stands in for the shards' digests where a dataset needs an identity (the record cache)
  fingerprint = hashlib.sha256(info.as_proto.SerializeToString(deterministic=True)).hexdigest()
  return Manifest(
    classes=classes,
    splits=checked_splits(info, builder.data_dir),
    keys=keys,
    created_by={"tool": TOOL, "source": os.fspath(folder), "fingerprint": fingerprint},
    read_from=INFO,
  )


def checked_splits(info, folder) -> dict[str, Split]:
  """The splits of the TFDS build in `folder` (its `info`), checked as strictly as those of a
  manifest.json (`schema.splits_from_json`): shardLengths are counts of records, and the
  shard files its templates name are files of `folder`, each listed once."""
  where = os.fspath(epath.Path(folder) / INFO)
  splits = {}
  for name, split in info.splits.items():
    lengths = list(split.shard_lengths)
    if split.num_examples and not lengths:
      raise ManifestError(f"{where}: split {name!r} lists no shardLengths; rebuild it")
    if (bad := next((n for n in lengths if not 0 <= n < schema.INT64), None)) is not None:
      raise ManifestError(
        f"{where}: split {name!r} has shardLengths {lengths}: {bad} is not a count of records"
      )
    paths = split.filepaths
    if any(p.parent != epath.Path(folder) for p in paths):
      raise ManifestError(f"{where}: split {name!r} has shards outside {folder}")
    shards = [{"file": p.name, "num_records": n, "sha256": ""} for p, n in zip(paths, lengths)]
    splits[name] = {"num_records": sum(lengths), "shards": shards}
  return schema.splits_from_json(splits, where)
