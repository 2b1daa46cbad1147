"""`python -m bench ops DATA_DIR`: what ops cost beside the fused head, as ratios.

Each variant is a `make_dataset` configuration on the same photos: the fused default (uint8,
no op), a trivial image op (identity, a flip), big_vision's bit_i1k train pp string (with
and without its host-side `value_range`, which makes float32 images: 4x the bytes), and
randaug(2, 15). Rounds interleave the variants (the machine is shared and noisy); each
round builds a fresh iterator, takes one batch (start-up is not measured), then times
`--batches` batches. The table gives the median images/s of the rounds and the ratio to the
fused default measured in the same rounds, and the same for the process's CPU time per image
(all its threads), which other tenants of a shared machine disturb less than wall time:
"cpu ratio" = fused CPU per image / the variant's, so 0.9 means 11% more CPU per image.
"""

from __future__ import annotations

import statistics
import sys
import time

from etils import epath

from bench import measure
from pipeline import dataset
from pipeline.catalog import manifest as manifest_lib


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


def rate(data_dir: str, settings: dict, batch_size: int, batches: int, threads: int) -> tuple:
  """(images/s, CPU seconds per image) of `batches` batches after the first."""
  ds = dataset.make_dataset(
    data_dir, batch_size=batch_size, performance={"num_threads": threads}, **settings
  )
  it = iter(ds)
  next(it)
  start, cpu = time.perf_counter(), time.process_time()
  for _ in range(batches):
    next(it)
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
  close = getattr(it, "close", None)
  if close:
    close()
  images = batches * batch_size
  return images / seconds, cpu / images


def main(argv: list[str]) -> dict:
  p = measure.parser(
    "ops", __doc__, "batch_size", "batches", "rounds", "threads", batches=30, threads=2
  )
  p.add_argument("--only", default="", help="comma-separated variant names (substrings)")
  args = p.parse_args(argv)
  meta = manifest_lib.load(epath.Path(args.data_dir))
  todo = variants(meta.num_classes)
  if args.only:
    keep = [s.strip() for s in args.only.split(",")]
    todo = {k: v for k, v in todo.items() if k == "fused default" or any(s in k for s in keep)}
  rates: dict[str, list[float]] = {k: [] for k in todo}
  ratios: dict[str, list[float]] = {k: [] for k in todo}
  cpus: dict[str, list[float]] = {k: [] for k in todo}
  cpu_ratios: dict[str, list[float]] = {k: [] for k in todo}
  for r in range(args.rounds):
    this = {}
    for name, settings in todo.items():
      this[name] = rate(args.data_dir, settings, args.batch_size, args.batches, args.threads)
      rates[name].append(this[name][0])
      cpus[name].append(this[name][1])
      print(
        f"round {r + 1}: {name:34s} {this[name][0]:8.1f} img/s {this[name][1] * 1e6:7.0f} "
        "CPU us/img",
        file=sys.stderr,
        flush=True,
      )
    for name in todo:
      ratios[name].append(this[name][0] / this["fused default"][0])
      cpu_ratios[name].append(this["fused default"][1] / this[name][1])
  print(
    f"\n{args.data_dir}: batch {args.batch_size}, {args.batches} batches x {args.rounds} "
    f"interleaved rounds, {args.threads} threads; medians"
  )
  print(f"{'variant':36s} {'img/s':>8s} {'vs fused':>9s} {'CPU us/img':>11s} {'cpu ratio':>10s}")
  table = {}
  for name in todo:
    img_s, ratio = statistics.median(rates[name]), statistics.median(ratios[name])
    cpu, cpu_ratio = statistics.median(cpus[name]), statistics.median(cpu_ratios[name])
    table[name] = {"img_s": img_s, "ratio": ratio, "cpu_s": cpu, "cpu_ratio": cpu_ratio}
    print(f"{name:36s} {img_s:8.1f} {ratio:8.2f}x {cpu * 1e6:11.0f} {cpu_ratio:9.2f}x")
  return table


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
