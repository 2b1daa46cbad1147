"""`python -m bench throughput DATA_DIR`: images/s, first batch, peak RSS, stages.

    python -m bench throughput data/photos --batch-size 128 --epochs 3 --json out.json

`--loader` picks the contender (ours by default; `peers` runs each in its own process).
The per-stage breakdown times each stage alone on one thread over a sample of records
(`bench.costs`, as the doctor does): what one image costs in read, parse, decode (header,
crop window, crop-aware decode), resize+flip and batch.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench import costs as costs_lib
from bench import measure
from pipeline import augment
from pipeline import manifest as manifest_lib

LOADERS = ("pipeline", "grain-baseline", "tfdata", "torch")


def stage_breakdown(data_dir: str, split: str, image_size: int, sample: int = 256) -> dict:
  """Milliseconds per image (wall) for each stage run alone on one thread (`bench.costs`;
  decode includes the header and the crop window), and for stacking a batch."""
  head = augment.Head(image_size=image_size)
  costs = costs_lib.stage_costs(data_dir, split, head, sample, sample)[0]
  ms = {k: costs[k].wall_ms for k in ("read", "parse", "decode")}
  ms["resize_flip"] = costs["augment"].wall_ms
  outs = [np.zeros((image_size, image_size, 3), np.uint8) for _ in range(min(sample, 128))]
  start = time.perf_counter()
  np.stack(outs)
  ms["batch"] = (time.perf_counter() - start) / len(outs) * 1e3
  ms["total_per_image"] = sum(ms.values())
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
  p = measure.parser("throughput", __doc__, "split", "batch_size", "image_size", "epochs", "json")
  p.add_argument("--loader", choices=LOADERS, default="pipeline")
  p.add_argument("--threads", type=int, default=None, help="decode threads (default: cores)")
  p.add_argument("--prefetch", type=int, default=2, help="batches in flight")
  p.add_argument("--workers", type=int, default=0, help="worker processes (0: threads only)")
  p.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
  return p


def main(argv: list[str]) -> dict:
  p = parser()
  args = p.parse_args(argv)
  meta = manifest_lib.load(args.data_dir)
  num_images = int(args.epochs * meta.splits[args.split].num_records)
  result = measure.run(args.loader, make_loader(args.loader, args), args.batch_size, num_images)
  out = {**result.__dict__}
  print(result.row())
  if not args.no_stages and args.loader == "pipeline":
    out["stages_ms_per_image"] = stage_breakdown(args.data_dir, args.split, args.image_size)
    print(
      "per image, one thread:",
      ", ".join(f"{k} {v:.3f} ms" for k, v in out["stages_ms_per_image"].items()),
    )
  return measure.finish(p, args, argv, out)


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
