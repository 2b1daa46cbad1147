"""`python -m bench ceiling DATA_DIR`: the cores' raw JPEG decode rate, the hardware limit.

    python -m bench ceiling data/photos --images 400 --json ceiling.json

Decodes the split's JPEGs (already in memory: no reading, parsing, cropping or resizing)
with libjpeg-turbo, whole and DCT-scaled to 1/2, on one thread and on one thread per core,
so a pipeline's images/s can be quoted as a share of what the cores can decode at all.
Two bindings of libjpeg-turbo are timed (ours and simplejpeg); the faster sets the ceiling.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from collections.abc import Callable

import grain
import numpy as np
import simplejpeg
import tqdm

from bench import measure
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.host.parallelism import available_cores
from pipeline.image import decode

SCALES = (1, 2)


def load_jpegs(data_dir: str, split: str, limit: int | None) -> list[bytes]:
  """The split's first `limit` images as encoded bytes (JPEG only)."""
  meta = manifest_lib.load(data_dir)
  source = grain.sources.ArrayRecordDataSource(
    [os.fspath(p) for p in meta.shard_paths(data_dir, split)]
  )
  n = len(source) if limit is None else min(limit, len(source))
  images = [records.parse(r, meta.keys)[0] for r in source.__getitems__(list(range(n)))]
  jpegs = [d for d in images if d[:3] == b"\xff\xd8\xff"]
  if not jpegs:
    raise ValueError(f"{data_dir} split {split!r} holds no JPEG images to decode")
  return jpegs


def decoders() -> dict[str, Callable[[bytes, tuple[int, int], int], np.ndarray]]:
  """name -> fn(jpeg, (h, w), scale) returning the image decoded at 1/scale."""
  return {
    "pipeline.image._jpeg": lambda d, hw, s: decode.decode_crop(d, (0, 0, *hw), s),
    "simplejpeg": lambda d, hw, s: simplejpeg.decode_jpeg(
      d, colorspace="RGB", min_height=hw[0] // s, min_width=hw[1] // s
    ),
  }


def decode_rate(
  fn: Callable, jpegs: list[bytes], sizes: list[tuple[int, int]], scale: int, threads: int
) -> float:
  """Images/s decoding every JPEG once, split evenly over `threads` threads."""

  def work(k: int) -> None:
    for i in range(k, len(jpegs), threads):
      fn(jpegs[i], sizes[i], scale)

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    pool.submit(work, 0).result()  # start the threads before the clock
    start = time.perf_counter()
    list(pool.map(work, range(threads)))
    return len(jpegs) / (time.perf_counter() - start)


def measure_ceiling(jpegs: list[bytes], threads: int, repeats: int = 2) -> dict:
  """Every (decoder, scale, 1 thread / `threads` threads), best of `repeats` runs."""
  sizes = [decode.image_size(d) for d in jpegs]
  mpix = float(np.mean([h * w for h, w in sizes])) / 1e6
  thread_counts = sorted({1, threads})
  rows = []
  todo = [(n, s, t) for n in decoders() for s in SCALES for t in thread_counts]
  for name, scale, t in tqdm.tqdm(todo, desc="ceiling", unit="run"):
    rate = max(decode_rate(decoders()[name], jpegs, sizes, scale, t) for _ in range(repeats))
    rows.append(
      {
        "decoder": name,
        "scale": f"1/{scale}",
        "threads": t,
        "images_per_sec": round(rate, 1),
        "megapixels_per_sec": round(rate * mpix, 1),
      }
    )
  best = {
    f"1/{s}": max(
      r["images_per_sec"] for r in rows if r["scale"] == f"1/{s}" and r["threads"] == threads
    )
    for s in SCALES
  }
  return {
    "images": len(jpegs),
    "mean_megapixels": round(mpix, 3),
    "threads": threads,
    "rows": rows,
    "ceiling_images_per_sec": best,
  }


def table(result: dict) -> str:
  lines = ["| decoder | scale | threads | images/s | source MP/s |", "|---|---|---:|---:|---:|"]
  lines += [
    f"| {r['decoder']} | {r['scale']} | {r['threads']} | {r['images_per_sec']:.0f} | "
    f"{r['megapixels_per_sec']:.0f} |"
    for r in result["rows"]
  ]
  return "\n".join(lines)


def main(argv: list[str]) -> dict:
  p = measure.parser("ceiling", __doc__, "split", "threads", "repeats", "json")
  p.add_argument("--images", type=int, default=400, help="JPEGs decoded per run")
  args = p.parse_args(argv)
  jpegs = load_jpegs(args.data_dir, args.split, args.images)
  result = measure_ceiling(jpegs, args.threads or available_cores(), args.repeats)
  measure.finish(p, args, argv, result)
  print(table(result))
  print(
    f"ceiling ({result['threads']} threads): "
    + ", ".join(f"{k} {v:.0f} img/s" for k, v in result["ceiling_images_per_sec"].items())
    + f"   [{result['machine']}]"
  )
  return result


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
