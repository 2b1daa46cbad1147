"""`python -m bench mixture DATA_DIR`: a 2-source mixture's images/s beside one source's.

    python -m bench mixture data/photos --rounds 5 --batches 20 [--order blocks]

The same images both ways: the split alone, and a mixture of two sources that are both the
split (weights 1:1: the same decode work per image, through the mixture's plan, per-source
decode heads, label checks and merge), in interleaved rounds (alone, mixture, alone, ...) so
a shared machine's drift falls on both; the median of each and their ratio.
"""

from __future__ import annotations

import statistics
import sys

import pipeline
from bench import measure


def main(argv: list[str]) -> dict:
  p = measure.parser(
    "mixture", __doc__, "split", "batch_size", "image_size", "rounds", "batches", "json"
  )
  p.add_argument(
    "--order", choices=("global", "blocks"), help="both streams' order (default: by storage)"
  )
  args = p.parse_args(argv)
  keywords = dict(batch_size=args.batch_size, image_size=args.image_size, seed=0)
  keywords.update(order=args.order)
  keywords.update(shard_index=0, shard_count=1)
  made = {
    "one source": lambda: pipeline.make_dataset(args.data_dir, args.split, **keywords),
    "2-source mixture": lambda: pipeline.make_dataset(
      {"a": args.data_dir, "b": args.data_dir}, args.split, weights={"a": 1, "b": 1}, **keywords
    ),
  }
  rates: dict[str, list[float]] = {name: [] for name in made}
  for _ in range(args.rounds):
    for name, make in made.items():
      it = lambda make=make: iter(make())
      run = measure.run(name, it, args.batch_size, args.batches * args.batch_size)
      rates[name].append(run.images_per_sec)
  medians = {name: statistics.median(r) for name, r in rates.items()}
  ratio = medians["2-source mixture"] / medians["one source"]
  for name, r in rates.items():
    print(f"{name:18s} median {medians[name]:7.0f} img/s  rounds {[round(x) for x in r]}")
  print(f"mixture / one source: {ratio:.3f}")
  return measure.finish(p, args, argv, {"rates": rates, "medians": medians, "ratio": ratio})


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
