"""`python -m bench.ops_speed DATA_DIR`: what ops cost beside the fused head, as ratios.

Each variant is a `make_dataset` configuration on the same photos: the fused default (uint8,
no op), a trivial image op (identity, a flip), big_vision's bit_i1k train pp string (with
and without its host-side `value_range`, which makes float32 images: 4x the bytes), and
randaug(2, 15). Rounds interleave the variants (the machine is shared and noisy); each
round builds a fresh iterator, takes one batch (start-up is not measured), then times
`--batches` batches. The table gives the median images/s of the rounds and the ratio to the
fused default measured in the same rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from pipeline import dataset
from pipeline import manifest as manifest_lib


def identity(image, rng):
  return image


def flip(image, rng):
  return image[:, ::-1]


def variants(num_classes: int) -> dict[str, dict]:
  head = "decode_jpeg_and_inception_crop(224)|flip_lr"
  tail = f'|onehot({num_classes}, key="label", key_result="labels")|keep("image", "labels")'
  return {
    "fused default": {},
    "identity image op": {"ops": [identity]},
    "flip image op": {"ops": [flip]},
    "bit_i1k pp_train": {"pp": head + "|value_range(-1, 1)" + tail},
    "bit_i1k pp_train, no value_range": {"pp": head + tail},
    "randaug(2,15) (vit_i1k)": {"pp": head + "|randaug(2, 15)" + tail},
  }


def rate(data_dir: str, settings: dict, batch_size: int, batches: int, threads: int) -> float:
  ds = dataset.make_dataset(
    data_dir, batch_size=batch_size, performance={"num_threads": threads}, **settings
  )
  it = iter(ds)
  next(it)
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  seconds = time.perf_counter() - start
  close = getattr(it, "close", None)
  if close:
    close()
  return batches * batch_size / seconds


def main(argv: list[str]) -> dict:
  p = argparse.ArgumentParser(prog="python -m bench.ops_speed", description=__doc__.split("\n")[0])
  p.add_argument("data_dir")
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--batches", type=int, default=30)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--only", default="", help="comma-separated variant names (substrings)")
  args = p.parse_args(argv)
  meta = manifest_lib.load(__import__("etils.epath").epath.Path(args.data_dir))
  todo = variants(meta.num_classes)
  if args.only:
    keep = [s.strip() for s in args.only.split(",")]
    todo = {k: v for k, v in todo.items() if k == "fused default" or any(s in k for s in keep)}
  rates: dict[str, list[float]] = {k: [] for k in todo}
  ratios: dict[str, list[float]] = {k: [] for k in todo}
  for r in range(args.rounds):
    this = {}
    for name, settings in todo.items():
      this[name] = rate(args.data_dir, settings, args.batch_size, args.batches, args.threads)
      rates[name].append(this[name])
      print(f"round {r + 1}: {name:34s} {this[name]:8.1f} img/s", file=sys.stderr, flush=True)
    for name in todo:
      ratios[name].append(this[name] / this["fused default"])
  print(
    f"\n{args.data_dir}: batch {args.batch_size}, {args.batches} batches x {args.rounds} "
    f"interleaved rounds, {args.threads} threads; medians"
  )
  print(f"{'variant':36s} {'img/s':>8s} {'vs fused':>9s}")
  table = {}
  for name in todo:
    img_s, ratio = statistics.median(rates[name]), statistics.median(ratios[name])
    table[name] = {"img_s": img_s, "ratio": ratio, "rounds": rates[name]}
    print(f"{name:36s} {img_s:8.1f} {ratio:8.2f}x")
  return table


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main(sys.argv[1:])
