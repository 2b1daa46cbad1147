"""`python -m bench throughput DATA_DIR`: images/s, first batch, peak RSS, stages.

    python -m bench throughput data/photos --batch-size 128 --epochs 3 --json out.json

`--loader` picks the contender (ours by default; `peers` runs each in its own process).
The per-stage breakdown times each stage alone on one thread over a sample of records:
what one image costs in read, parse, header+crop choice, decode, resize+flip and batch.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench import measure
from pipeline import augment, decode, records
from pipeline import manifest as manifest_lib
from pipeline.source import ShardedSource

LOADERS = ("pipeline", "grain-baseline", "tfdata", "torch")


def stage_breakdown(data_dir: str, split: str, image_size: int, sample: int = 256) -> dict:
  """Milliseconds per image for each stage run alone on one thread."""
  meta = manifest_lib.load(data_dir)
  source = ShardedSource(
    meta.shard_paths(data_dir, split), [s.num_records for s in meta.splits[split].shards]
  )
  n = min(sample, len(source))
  idx = np.random.default_rng(0).permutation(len(source))[:n].tolist()
  head = augment.Head(image_size=image_size)
  ms = {}

  def timed(name, fn, items):
    start = time.perf_counter()
    out = [fn(x) for x in items]
    ms[name] = (time.perf_counter() - start) / len(items) * 1e3
    return out

  start = time.perf_counter()
  recs = source.read(idx)  # batched, as the pipeline reads
  ms["read"] = (time.perf_counter() - start) / n * 1e3
  parsed = timed("parse", lambda r: records.parse(r, meta.keys)[0], recs)
  keys = iter(range(n))
  boxes = timed(
    "crop_choice",
    lambda d: head.box(*decode.image_size(d), augment.example_key(0, 0, next(keys))),
    parsed,
  )
  crops = timed(
    "decode",
    lambda db: decode.decode_crop(db[0], db[1], augment.dct_scale(db[1], image_size)),
    list(zip(parsed, boxes)),
  )
  timed("decode_full_image", decode.decode, parsed)
  outs = timed("resize_flip", lambda c: augment.resize(c[:, ::-1], image_size), crops)
  start = time.perf_counter()
  np.stack(outs)
  ms["batch"] = (time.perf_counter() - start) / n * 1e3
  ms["total_per_image"] = sum(v for k, v in ms.items() if k != "decode_full_image")
  return {k: round(v, 4) for k, v in ms.items()}


def make_loader(name: str, args) -> callable:
  """A zero-argument function returning a fresh batch iterator for contender `name`."""
  if name == "pipeline":
    from pipeline import dataset

    return lambda: iter(
      dataset.make_dataset(
        args.data_dir,
        args.split,
        batch_size=args.batch_size,
        image_size=args.image_size,
        shard_index=0,
        shard_count=1,
        performance=dict(
          num_threads=args.threads, prefetch=args.prefetch, num_workers=args.workers
        ),
      )
    )
  from bench import peers

  return peers.make_loader(name, args)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m bench throughput",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("data_dir", help="a converted dataset (manifest.json + shards)")
  p.add_argument("--split", default="train")
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument(
    "--epochs",
    type=float,
    default=3,
    help="images timed = epochs x split size (after the first batch)",
  )
  p.add_argument("--loader", choices=LOADERS, default="pipeline")
  p.add_argument("--threads", type=int, default=None, help="decode threads (default: cores)")
  p.add_argument("--prefetch", type=int, default=2, help="batches in flight")
  p.add_argument("--workers", type=int, default=0, help="worker processes (0: threads only)")
  p.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
  p.add_argument("--json", help="write the figures to this file")
  return p


def main(argv: list[str]) -> dict:
  args = parser().parse_args(argv)
  meta = manifest_lib.load(args.data_dir)
  num_images = int(args.epochs * meta.splits[args.split].num_records)
  result = measure.run(args.loader, make_loader(args.loader, args), args.batch_size, num_images)
  out = {
    **result.__dict__,
    "machine": measure.machine(),
    "command": "python -m bench throughput " + " ".join(argv),
  }
  print(result.row())
  if not args.no_stages and args.loader == "pipeline":
    out["stages_ms_per_image"] = stage_breakdown(args.data_dir, args.split, args.image_size)
    print(
      "per image, one thread:",
      ", ".join(f"{k} {v:.3f} ms" for k, v in out["stages_ms_per_image"].items()),
    )
  if args.json:
    measure.write_json(args.json, out)
  return out


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
