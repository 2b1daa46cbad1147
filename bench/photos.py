"""`python -m bench photos OUT`: a reproducible set of JPEGs of ImageNet's sizes, converted.

    python -m bench photos /tmp/inet --images 2000 --seed 0

Cut from the built-in sample photos as `pipeline.convert builtin` cuts its own
(`builtin._photo`: random crops, flips, colour jitter, sharpening and noise; one class per
source photo), but with ImageNet's spread of sizes and qualities instead of one size: most
long sides 500 px (4:3 or 3:2, landscape about 3 in 4), some smaller, ~3% large (up to
1,200 px), JPEG quality 88-96, about 110 KB a file on average (ImageNet's train set is
~140 GB for 1.28M images). The same seed writes the same bytes, whatever the workers.
Writes OUT/raw/CLASS/*.jpg and the dataset OUT/photos (train only); prints the realized
mean file size and dimensions.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
from PIL import Image

from bench import measure
from pipeline.convert import builtin, images, shards

NOISE = 18.0  # the noise's std: with the qualities below it makes ~110 KB files on average
LONG_SIDE = 500  # ImageNet's typical longer side


def imagenet_size(rng: np.random.Generator) -> tuple[int, int]:
  """(width, height) drawn like ImageNet's: 85% long side 500, 12% 200-499, 3% 501-1,200;
  aspect 4:3 (60%), 3:2 (25%) or 1.05-2.0; landscape 72%, portrait 24%, square 4%."""
  kind = rng.random()
  long = (
    LONG_SIDE
    if kind < 0.85
    else int(rng.integers(200, 500) if kind < 0.97 else rng.integers(501, 1201))
  )
  shape = rng.random()
  aspect = 4 / 3 if shape < 0.6 else 3 / 2 if shape < 0.85 else float(rng.uniform(1.05, 2.0))
  short = round(long / aspect)
  orient = rng.random()
  return (long, short) if orient < 0.72 else (short, long) if orient < 0.96 else (long, long)


def _write(task: tuple[int, ...], *, directory: str, names: tuple[str, ...], seed: int) -> int:
  """Worker: writes photos number `task`, each from its own seeded generator."""
  for i in task:
    name = names[i % len(names)]
    rng = np.random.default_rng([seed, i, 51])
    im = builtin._photo(builtin._source(name), rng, imagenet_size, NOISE)
    quality = int(rng.integers(88, 97))
    im.save(os.path.join(directory, name, f"{name}_{i:05d}.jpg"), quality=quality)
  return len(task)


def make(directory: str, num_images: int, seed: int, workers: int | None = None) -> None:
  """Writes `num_images` photos as DIR/SOURCE/SOURCE_NNNNN.jpg; image i is class i % 9."""
  names = tuple(builtin.PHOTO_SOURCES)
  for name in names:
    os.makedirs(os.path.join(directory, name), exist_ok=True)
  tasks = [tuple(range(a, min(a + 25, num_images))) for a in range(0, num_images, 25)]
  work = functools.partial(_write, directory=directory, names=names, seed=seed)
  for _ in shards.ordered_map(work, tasks, min(workers or os.cpu_count() or 1, len(tasks))):
    pass


def describe(directory: str) -> dict:
  """The realized set: count, mean and median KB, mean and median width x height, the share
  with a side over 500 px."""
  paths = sorted(
    os.path.join(root, f)
    for root, _, files in os.walk(directory)
    for f in files
    if f.endswith(".jpg")
  )
  kb = np.array([os.path.getsize(p) / 1024 for p in paths])
  dims = np.array([Image.open(p).size for p in paths])
  return {
    "images": len(paths),
    "mean_kb": round(float(kb.mean()), 1),
    "median_kb": round(float(np.median(kb)), 1),
    "mean_size": [round(float(v)) for v in dims.mean(0)],
    "median_size": [round(float(v)) for v in np.median(dims, 0)],
    "share_over_500": round(float((dims.max(1) > LONG_SIDE).mean()), 3),
  }


def main(argv: list[str]) -> dict:
  p = measure.parser("photos", __doc__, "json", data_dir=None)
  p.add_argument("out", help="the folder to write (raw/ and photos/ in it); must not exist")
  p.add_argument("--images", type=measure.positive(int), default=2000)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--shard-size-mb", type=measure.positive(float), default=32.0)
  p.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
  args = p.parse_args(argv)
  if os.path.exists(args.out):
    p.exit(2, f"bench photos: {args.out} exists; give a new folder (nothing is overwritten)\n")
  raw = os.path.join(args.out, "raw")
  make(raw, args.images, args.seed, args.workers)
  request = images.Request(
    raw, os.path.join(args.out, "photos"), seed=0, shard_size_mb=args.shard_size_mb
  )
  images.convert(request, workers=args.workers)
  out = describe(raw)
  print(
    f"{args.out}/photos: {out['images']} JPEGs, mean {out['mean_kb']} KB (median "
    f"{out['median_kb']}), mean {out['mean_size'][0]}x{out['mean_size'][1]} px (median "
    f"{out['median_size'][0]}x{out['median_size'][1]}), {out['share_over_500']:.1%} with a "
    "side over 500 px"
  )
  return measure.finish(p, args, argv, out)


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
