"""`python -m bench peers DATA_DIR`: our pipeline vs its peers, one run, one table.

Each contender runs in its own fresh process (so first-batch time includes its start-up
and peak RSS is its own), on the same records, with the same augmentation (Inception
random-resized-crop, area 8-100%, aspect 3/4-4/3, flip, bilinear resize, uint8):
- tfdata: tf.data tuned as its performance guide says: files interleaved in parallel,
  `decode_and_crop_jpeg` in a parallel map, batch, prefetch, all AUTOTUNE. It reads the
  same Examples copied into TFRecord files (tf.data cannot read ArrayRecord).
- grain-baseline: a straightforward Grain DataLoader: 2 worker processes, PIL decode.
- torch: PyTorch DataLoader + torchvision (2 workers), when installed.
Peers need the `peers` extra: pip install -e '.[peers]'.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys
import tempfile

import grain

from bench import measure
from pipeline.catalog import manifest as manifest_lib
from pipeline.convert.tfrecord import masked_crc32c


def write_tfrecord(path: str | os.PathLike, recs) -> None:
  """Writes records as a TFRecord file (no TensorFlow needed)."""
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    for data in recs:
      length = struct.pack("<Q", len(data))
      f.write(length + struct.pack("<I", masked_crc32c(length)))
      f.write(data + struct.pack("<I", masked_crc32c(data)))
  os.replace(tmp, path)


def records(paths: list[str]):
  """Every record of the shards, in order, a shard at a time."""
  for path in paths:
    source = grain.sources.ArrayRecordDataSource([path])
    yield from source.__getitems__(list(range(len(source))))


def tfrecord_copy(data_dir: str | os.PathLike, split: str) -> str:
  """The split's shards copied once as TFRecord files (one each) into DATA_DIR/peers-tfrecord/
  (tf.data cannot read ArrayRecord); returns their glob."""
  meta = manifest_lib.load(data_dir)
  out = pathlib.Path(data_dir) / "peers-tfrecord"
  out.mkdir(exist_ok=True)
  for path in meta.shard_paths(data_dir, split):
    target = out / path.name.replace("array_record", "tfrecord")
    if not target.exists():
      write_tfrecord(target, records([os.fspath(path)]))
  return os.fspath(out / f"{split}.tfrecord-*")


def _tfdata(args):
  import tensorflow as tf

  tf.config.set_visible_devices([], "GPU")
  keys = manifest_lib.load(args.data_dir).keys
  pattern = tfrecord_copy(args.data_dir, args.split)
  size, autotune = args.image_size, tf.data.AUTOTUNE
  features = {
    keys.image: tf.io.FixedLenFeature([], tf.string),
    keys.label: tf.io.FixedLenFeature([], tf.int64),
  }

  def preprocess(record):
    ex = tf.io.parse_single_example(record, features)
    data = ex[keys.image]
    shape = tf.io.extract_jpeg_shape(data)
    begin, crop, _ = tf.image.sample_distorted_bounding_box(
      shape,
      bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
      area_range=(0.08, 1.0),
      aspect_ratio_range=(3 / 4, 4 / 3),
      max_attempts=10,
      use_image_if_no_bounding_boxes=True,
    )
    window = tf.stack([begin[0], begin[1], crop[0], crop[1]])
    image = tf.io.decode_and_crop_jpeg(data, window, channels=3)
    image = tf.image.random_flip_left_right(image)
    image = tf.image.resize(image, [size, size], method="bilinear")
    return tf.cast(image, tf.uint8), tf.cast(ex[keys.label], tf.int32)

  # Files read at once and bytes per read request (the storage bench sets both; default:
  # AUTOTUNE and TFRecordDataset's own buffer).
  cycle = getattr(args, "cycle_length", None) or autotune
  buffer = getattr(args, "read_buffer_bytes", None)

  def make():
    files = tf.data.Dataset.list_files(pattern, shuffle=True, seed=0)
    ds = files.interleave(
      lambda f: tf.data.TFRecordDataset(f, buffer_size=buffer),
      cycle_length=cycle,
      num_parallel_calls=autotune,
      deterministic=False,
    )
    ds = ds.shuffle(1024, seed=0).repeat()
    ds = ds.map(preprocess, num_parallel_calls=autotune, deterministic=False)
    ds = ds.batch(args.batch_size, drop_remainder=True).prefetch(autotune)
    return iter(ds.as_numpy_iterator())

  return make


class _PilTransform:
  """The baseline's per-record map: parse, full PIL decode, random crop, flip, resize."""

  def __init__(self, keys, size):
    self.keys, self.size = keys, size

  def random_map(self, record, rng):
    import io

    import numpy as np
    from PIL import Image

    from pipeline.catalog import records
    from pipeline.image import augment

    data, label, _ = records.parse(record, self.keys)
    im = Image.open(io.BytesIO(data)).convert("RGB")
    key = int(rng.integers(2**63))
    y, x, h, w = augment.random_resized_crop_box(im.height, im.width, key)
    im = im.resize((self.size, self.size), Image.BILINEAR, box=(x, y, x + w, y + h))
    if rng.random() < 0.5:
      im = im.transpose(Image.FLIP_LEFT_RIGHT)
    return {"image": np.asarray(im), "label": np.int32(label)}


def _grain_baseline(args):
  from absl import flags

  flags.FLAGS.mark_as_parsed()
  meta = manifest_lib.load(args.data_dir)
  paths = [os.fspath(p) for p in meta.shard_paths(args.data_dir, args.split)]
  transform = _PilTransform(meta.keys, args.image_size)

  class Augment(grain.transforms.RandomMap):
    def random_map(self, element, rng):
      return transform.random_map(element, rng)

  def make():
    source = grain.sources.ArrayRecordDataSource(paths)
    sampler = grain.samplers.IndexSampler(len(source), shuffle=True, seed=0, num_epochs=None)
    loader = grain.DataLoader(
      data_source=source,
      sampler=sampler,
      worker_count=2,
      operations=[Augment(), grain.transforms.Batch(args.batch_size, drop_remainder=True)],
    )
    return iter(loader)

  return make


def _torch(args):
  import numpy as np
  import torch
  from torchvision.transforms import v2

  meta = manifest_lib.load(args.data_dir)
  paths = [os.fspath(p) for p in meta.shard_paths(args.data_dir, args.split)]
  aug = v2.Compose(
    [v2.RandomResizedCrop(args.image_size, antialias=False), v2.RandomHorizontalFlip()]
  )

  class Records(torch.utils.data.Dataset):
    def __init__(self):
      self.source = None

    def __len__(self):
      return meta.splits[args.split].num_records

    def __getitem__(self, i):
      from torchvision.io import decode_jpeg

      from pipeline.catalog import records

      if self.source is None:
        self.source = grain.sources.ArrayRecordDataSource(paths)
      data, label, _ = records.parse(self.source[i], meta.keys)
      image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
      return aug(image).permute(1, 2, 0), label

  def make():
    loader = torch.utils.data.DataLoader(
      Records(),
      batch_size=args.batch_size,
      shuffle=True,
      num_workers=2,
      drop_last=True,
      persistent_workers=True,
    )

    def forever():
      while True:
        for images, labels in loader:
          yield {"image": np.asarray(images), "label": np.asarray(labels)}

    return forever()

  return make


def make_loader(name: str, args):
  return {"tfdata": _tfdata, "grain-baseline": _grain_baseline, "torch": _torch}[name](args)


def _available(module: str) -> bool:
  import importlib.util

  return importlib.util.find_spec(module) is not None


def main(argv: list[str]) -> list[dict]:
  p = measure.parser("peers", __doc__, "split", "batch_size", "image_size", "epochs", "json")
  p.add_argument(
    "--loaders",
    default="pipeline,tfdata,grain-baseline,torch",
    help="comma-separated contenders; missing peers are skipped",
  )
  args = p.parse_args(argv)
  needs = {"tfdata": "tensorflow", "torch": "torchvision"}
  results = []
  for name in args.loaders.split(","):
    if name in needs and not _available(needs[name]):
      print(f"{name:28s} skipped: {needs[name]} not installed (pip install -e '.[peers]')")
      continue
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
      cmd = [
        sys.executable,
        "-m",
        "bench",
        "throughput",
        args.data_dir,
        "--no-stages",
        "--no-reference",
      ]
      cmd += measure.flags(
        split=args.split,
        batch_size=args.batch_size,
        image_size=args.image_size,
        epochs=args.epochs,
        loader=name,
        json=f.name,
      )
      proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
      if proc.returncode:
        print(f"{name:28s} FAILED:\n{proc.stderr[-2000:]}")
        continue
      results.append(json.load(open(f.name)))
      print(proc.stdout.strip().splitlines()[-1])
  base = next((r for r in results if r["name"] == "tfdata"), None)
  if base:
    print(f"\nratios vs tf.data ({measure.machine()}):")
    for r in results:
      print(
        f"  {r['name']:26s} throughput x{r['images_per_sec'] / base['images_per_sec']:.2f}"
        f"   first batch x{r['first_batch_s'] / base['first_batch_s']:.2f}"
        f"   peak RSS x{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}"
      )
  measure.finish(p, args, argv, {"results": results})
  return results
