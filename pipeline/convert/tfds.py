"""A TFDS dataset already prepared in a local data dir to our shards, record bytes copied
(into a local folder, or a gs:// one through `pipeline.convert.bucket`).

TFDS stores each example as a `tf.train.Example` (TFRecord or ArrayRecord files); its
first `Image` and `ClassLabel` features become the image and label keys, and the
ClassLabel names become the classes. Nothing is downloaded or prepared here. A split
without labels (TFDS's label -1, as ImageNet's test split) cannot be trained or evaluated
on: it is skipped with one line on stderr, and the other splits are converted.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from pipeline import __version__
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records, tfds_folder
from pipeline.convert import bucket, checks, shards, tfrecord


def convert(
  name: str,
  out: str | os.PathLike,
  *,
  data_dir: str | os.PathLike | None = None,
  split: str | Sequence[str] | None = None,
  shard_size_mb: float = shards.DEFAULT_SHARD_SIZE_MB,
  workers: int | None = None,
  max_pixels: int = checks.MAX_PIXELS,
  progress: bool = True,
  overwrite: bool = False,
) -> manifest_lib.Manifest:
  """Converts the prepared TFDS dataset `name` (e.g. "imagenet2012" or "mnist:3.0.1").

  `data_dir` is a TFDS data dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets, as
  tfds:// reads) or the build's version folder. `split` picks one split or several
  (default: all); unlabeled ones are skipped. Records keep their TFDS order. Splits of
  another conversion already in `out` are replaced only with `overwrite`.
  """
  shards.check_workers(workers)
  shards.shard_bytes(shard_size_mb)
  if bucket.is_url(out):
    bucket.check(os.fspath(out))  # no gcsfs, credentials or network: one line, at once
  if max_pixels < 1:
    raise ValueError(f"max_pixels must be a positive number of pixels, got {max_pixels}")
  import tensorflow_datasets as tfds

  data_dir = os.fspath(data_dir or tfds.core.constants.get_default_data_dir())
  if "://" not in data_dir and not os.path.isdir(data_dir):
    raise FileNotFoundError(
      f"{name}: TFDS data dir {data_dir} not found: run `tfds build {name} "
      "--file_format=array_record`, or pass --data-dir"
    )
  builder = _builder(name, data_dir)
  info = builder.info
  keys, classes = tfds_folder.keys_and_classes(info, builder.data_dir)
  file_format = info.file_format.value if info.file_format else "tfrecord"
  if file_format not in ("tfrecord", "array_record"):
    raise ValueError(f"{info.full_name}: unsupported file format {file_format}")
  checked = tfds_folder.checked_splits(info, builder.data_dir)
  names = list(checked) if split is None else [split] if isinstance(split, str) else split
  files: list[str] = []
  split_items = {}
  for s in names:
    if s not in checked:
      raise KeyError(f"split {s!r} not in {info.full_name}; it has {sorted(checked)}")
    shards.check_split_name(s)
    paths = [os.path.join(builder.data_dir, sh.file) for sh in checked[s].shards]
    counts = [sh.num_records for sh in checked[s].shards]
    split_files, items, sizes = _locate(paths, counts, file_format, len(files))
    if unlabeled := _unlabeled(items[:1], files + split_files, keys):
      print(f"convert tfds: skipped split {s!r} of {info.full_name}: {unlabeled}", file=sys.stderr)
      continue
    files += split_files
    split_items[s] = (items, sizes)
  if not split_items:
    raise ValueError(f"{info.full_name}: no split with labels among {names}")
  args = {
    "name": name,
    "data_dir": data_dir,
    "split": names,
    "shard_size_mb": shard_size_mb,
    "max_pixels": max_pixels,
  }
  created_by = {
    "tool": "pipeline.convert tfds",
    "version": __version__,
    "args": args,
    "source": f"{info.full_name} in {os.path.abspath(data_dir)}",
  }
  job = tfrecord.copy_job(
    split_items,
    files,
    out,
    classes=classes,
    keys=keys,
    created_by=created_by,
    shard_size_mb=shard_size_mb,
    max_pixels=max_pixels,
  )
  run = bucket.run if bucket.is_url(out) else shards.run
  return run(job, workers=workers, progress=progress, desc=f"convert {name}", overwrite=overwrite)


def _builder(name: str, data_dir: str):
  """The builder of `name` prepared in `data_dir`, a data dir or the build's version folder;
  a build that is not there names the versions that are."""
  import tensorflow_datasets as tfds

  if tfds_folder.is_build(data_dir):
    builder = tfds.builder_from_directory(data_dir)
    wanted = name.split(":")
    found = [builder.info.full_name.rsplit("/", 1)[0], str(builder.info.version)]
    if wanted != found[: len(wanted)]:
      raise ValueError(f"{data_dir} holds {':'.join(found)}, not {name}")
    return builder
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception:  # noqa: BLE001 - TFDS raises several kinds, some listing every dataset
    builder = None
  if builder is None or not builder.info.splits:
    raise FileNotFoundError(f"{name}: {tfds_folder.missing(name, data_dir)}")
  return builder


def _locate(
  paths: list[str], counts: list[int], file_format: str, first: int
) -> tuple[list[str], list[tuple], list[int]]:
  """A split's files (`paths`, holding `counts` records), and its records as
  `tfrecord.read_items` items (file indices counted from `first`) with their sizes."""
  files, items, sizes = [], [], []
  for path, count in zip(paths, counts):
    files.append(path)
    index = first + len(files) - 1
    if file_format == "tfrecord":
      spans = tfrecord.scan(files[-1])
      items += [("tfrecord", index, i, *span) for i, span in enumerate(spans)]
      sizes += [length for _, length in spans]
    else:
      items += [("array_record", index, i) for i in range(count)]
      sizes += [os.path.getsize(files[-1]) // max(count, 1)] * count
  return files, items, sizes


def _unlabeled(first: list[tuple], files: list[str], keys: records.Keys) -> str:
  """Why a split whose first record is the item in `first` has no labels; "" if it has."""
  for place, data in tfrecord.read_items(first, files):
    try:
      label = records.parse(data, keys)[1]
    except records.RecordError:  # the conversion names it with its place
      return ""
    if label == records.UNLABELED:
      return f"unlabeled (label {records.UNLABELED} in {place}); the pipeline needs class labels"
  return ""
