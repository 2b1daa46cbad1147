"""A TFDS dataset already prepared in a local data dir to our shards, record bytes copied
(into a local folder, or a gs:// one through `pipeline.convert.bucket`).

TFDS stores each example as a `tf.train.Example` (TFRecord or ArrayRecord files); its
first `Image` and `ClassLabel` features become the image and label keys, and the
ClassLabel names become the classes. Nothing is downloaded or prepared here. A split
without labels (TFDS's label -1, as ImageNet's test split) cannot be trained or evaluated
on: it is skipped with one line on stderr, and the other splits are converted.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from pipeline import __version__
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records, tfds_folder
from pipeline.convert import bucket, checks, shards, tfrecord


@dataclasses.dataclass(frozen=True)
class Request:
  """The prepared TFDS dataset `name` (e.g. "imagenet2012" or "mnist:3.0.1") to convert into
  `out`, and how (`convert tfds`' flags).

  `data_dir` is a TFDS data dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets, as
  tfds:// reads) or the build's version folder. `split` picks one split or several
  (default: all); unlabeled ones are skipped. Splits of another conversion already in `out`
  are replaced only with `overwrite`.
  """

  name: str
  out: str | os.PathLike
  _: dataclasses.KW_ONLY
  data_dir: str | os.PathLike | None = None
  split: str | Sequence[str] | None = None
  shard_size_mb: float = shards.DEFAULT_SHARD_SIZE_MB
  max_pixels: int = checks.MAX_PIXELS
  overwrite: bool = False


def _data_dir(request: Request) -> str:
  """The TFDS data dir to read, checked: it is there."""
  import tensorflow_datasets as tfds

  data_dir = os.fspath(request.data_dir or tfds.core.constants.get_default_data_dir())
  if "://" not in data_dir and not os.path.isdir(data_dir):
    raise FileNotFoundError(
      f"{request.name}: TFDS data dir {data_dir} not found: run `tfds build {request.name} "
      "--file_format=array_record`, or pass --data-dir"
    )
  return data_dir


def _file_format(info) -> str:
  file_format = info.file_format.value if info.file_format else "tfrecord"
  if file_format not in ("tfrecord", "array_record"):
    raise ValueError(f"{info.full_name}: unsupported file format {file_format}")
  return file_format


def _splits(
  builder, checked: dict, names: Sequence[str], keys: records.Keys, file_format: str
) -> tuple[list[str], dict]:
  """The files of the labelled splits among `names` (of the `checked` ones) and their
  records, as `copy_job` takes them; an unlabeled split is skipped with a line on stderr."""
  info = builder.info
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
  return files, split_items


def plan(request: Request) -> shards.Job:
  """Finds the prepared build, reads its splits' record locations and plans the shards;
  records keep their TFDS order."""
  shards.shard_bytes(request.shard_size_mb)
  if request.max_pixels < 1:
    raise ValueError(f"max_pixels must be a positive number of pixels, got {request.max_pixels}")
  data_dir = _data_dir(request)
  builder = _builder(request.name, data_dir)
  keys, classes = tfds_folder.keys_and_classes(builder.info, builder.data_dir)
  file_format = _file_format(builder.info)
  checked = tfds_folder.checked_splits(builder.info, builder.data_dir)
  split = request.split
  names = list(checked) if split is None else [split] if isinstance(split, str) else split
  files, split_items = _splits(builder, checked, names, keys, file_format)
  args = {
    "name": request.name,
    "data_dir": data_dir,
    "split": names,
    "shard_size_mb": request.shard_size_mb,
    "max_pixels": request.max_pixels,
  }
  created_by = {
    "tool": "pipeline.convert tfds",
    "version": __version__,
    "args": args,
    "source": f"{builder.info.full_name} in {os.path.abspath(data_dir)}",
  }
  return tfrecord.copy_job(split_items, files, request, classes, keys, created_by)


def convert(
  request: Request, workers: int | None = None, progress: bool = True
) -> manifest_lib.Manifest:
  """Converts a prepared TFDS dataset to ArrayRecord shards and manifest.json in OUT."""
  shards.shard_bytes(request.shard_size_mb)
  return bucket.convert(plan, request, workers, progress, f"convert {request.name}")


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
