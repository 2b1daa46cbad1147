"""A TFDS dataset already prepared in a local data dir to our shards, record bytes copied.

TFDS stores each example as a `tf.train.Example` (TFRecord or ArrayRecord files); its
first `Image` and `ClassLabel` features become the image and label keys, and the
ClassLabel names become the classes. Nothing is downloaded or prepared here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pipeline import __version__, tfds_folder
from pipeline import manifest as manifest_lib
from pipeline.convert import checks, shards, tfrecord


def convert(
  name: str,
  out: str | os.PathLike,
  *,
  data_dir: str | os.PathLike,
  split: str | Sequence[str] | None = None,
  shard_size_mb: float = shards.DEFAULT_SHARD_SIZE_MB,
  workers: int | None = None,
  max_pixels: int = checks.MAX_PIXELS,
  progress: bool = True,
  overwrite: bool = False,
) -> manifest_lib.Manifest:
  """Converts the prepared TFDS dataset `name` (e.g. "imagenet2012" or "mnist:3.0.1").

  `split` picks one split or several (default: all); records keep their TFDS order.
  Splits of another conversion already in `out` are replaced only with `overwrite`.
  """
  shards.check_workers(workers)
  shards.shard_bytes(shard_size_mb)
  if max_pixels < 1:
    raise ValueError(f"max_pixels must be a positive number of pixels, got {max_pixels}")
  if "://" not in os.fspath(data_dir) and not os.path.isdir(data_dir):
    raise FileNotFoundError(f"TFDS data dir {os.fspath(data_dir)} not found")
  import tensorflow_datasets as tfds

  builder = tfds.builder(name, data_dir=os.fspath(data_dir))
  info = builder.info
  if not info.splits:
    raise FileNotFoundError(f"{name} is not prepared in {data_dir} (run tfds build first)")
  names = list(info.splits) if split is None else [split] if isinstance(split, str) else split
  keys, classes = tfds_folder.keys_and_classes(info, builder.data_dir)
  file_format = info.file_format.value if info.file_format else "tfrecord"
  files: list[str] = []
  split_items = {}
  for s in names:
    if s not in info.splits:
      raise KeyError(f"split {s!r} not in {info.full_name}; it has {sorted(info.splits)}")
    shards.check_split_name(s)
    items, sizes = [], []
    for path, count in zip(info.splits[s].filepaths, info.splits[s].shard_lengths):
      files.append(os.fspath(path))
      if file_format == "tfrecord":
        spans = tfrecord.scan(files[-1])
        items += [("tfrecord", len(files) - 1, i, *span) for i, span in enumerate(spans)]
        sizes += [length for _, length in spans]
      elif file_format == "array_record":
        items += [("array_record", len(files) - 1, i) for i in range(count)]
        sizes += [os.path.getsize(files[-1]) // max(count, 1)] * count
      else:
        raise ValueError(f"{info.full_name}: unsupported file format {file_format}")
    split_items[s] = (items, sizes)
  args = {
    "name": name,
    "data_dir": os.fspath(data_dir),
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
  return shards.run(
    job, workers=workers, progress=progress, desc=f"convert {name}", overwrite=overwrite
  )
