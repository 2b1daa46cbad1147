"""`python -m bench throughput DATA_DIR`: images/s, first batch, peak RSS, stages.

    python -m bench throughput data/photos --batch-size 128 --epochs 3 --json out.json

`--loader` picks the contender (ours by default; `peers` runs each in its own process).
The per-stage breakdown times each stage alone on one thread over a sample of records
(`bench.costs`, as the doctor does): what one image costs in read, parse, decode (header,
crop window, crop-aware decode), resize+flip and batch. The timed run's CPU per image is split
by thread (`bench.threads`: decode, read, Grain's prefetch, main; with page faults).
For ours, the same run also measures the physical limit: the cores' raw decode of the crop
windows the pipeline decodes (its train crops, DCT-scaled as it scales them; decode alone, a
thread per core, `bench.ceiling`'s timing) after the pipeline's run, and quotes img/s as a
share of it, and of its own decode stage run alone on the same records in memory (windows
decoded, flipped and resized into batches: no reading, no hand-off); and, where tensorflow
is installed, runs tf.data (`bench.peers`) in its own process and quotes img/s, first batch
and peak RSS (with --pss, PSS too) beside its.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import grain
import numpy as np

from bench import ceiling, first_batch, measure
from bench import costs as costs_lib
from bench import threads as by_thread
from pipeline.catalog import manifest as manifest_lib
from pipeline.host import parallelism
from pipeline.image import augment, decode
from pipeline.stages import decode as decode_stage
from pipeline.stages import plan

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


def crop_ceiling(
  data_dir: str,
  split: str,
  image_size: int,
  batch_size: int = 128,
  images: int = 400,
  threads: int | None = None,
) -> dict:
  """Images/s decoding the crop windows of the pipeline's train augmentation (its crop box of
  each image, at its DCT scale) with one thread per core, best of 2: decode alone; and the
  pipeline's decode stage alone on the same records (`decode_stage_rate`)."""
  jpegs = ceiling.load_jpegs(data_dir, split, images)
  head = augment.Head(image_size=image_size)
  keys = [augment.example_key(0, 0, i) for i in range(len(jpegs))]
  boxes = [head.box(*decode.image_size(d), key) for d, key in zip(jpegs, keys)]
  threads = threads or parallelism.available_cores()
  crop = lambda data, box, _: decode.decode_crop(data, box, head.dct_scale(box))
  rate = max(ceiling.decode_rate(crop, jpegs, boxes, 1, threads) for _ in range(2))
  stage, stage_cpu = decode_stage_rate(data_dir, split, head, len(jpegs), threads, batch_size)
  return {
    "images_per_sec": round(rate, 1),
    "decode_stage_images_per_sec": round(stage, 1),
    "decode_stage_cpu_us_per_image": round(stage_cpu, 1),
    "threads": threads,
    "images": len(jpegs),
  }


def decode_stage_rate(
  data_dir: str, split: str, head: augment.Head, images: int, threads: int, batch_size: int
) -> float:
  """(images/s, CPU us per image) of the pipeline's decode stage alone
  (`stages.decode.DecodeImages`: the native decoder's windows, flipped, resized into batches)
  on `threads` threads, over the split's first `images` records already in memory, best of 2
  passes after one to warm it: no reading, no hand-off."""
  meta = manifest_lib.load(data_dir)
  source = grain.sources.ArrayRecordDataSource(
    [os.fspath(p) for p in meta.shard_paths(data_dir, split)]
  )
  raw = source.__getitems__(list(range(min(images, len(source)))))
  stage = decode_stage.DecodeImages(
    head,
    keys=meta.keys,
    seed=0,
    num_threads=threads,
    prefetch=2,
    on_error="raise",
    cache_mb=0,
    decoder=decode_stage.batch_decoder(head, meta.keys, 0),
  )

  def batch(i: int, first: int) -> plan.Batch:
    indices = np.arange(first, min(first + batch_size, len(raw)))
    return plan.Batch(i, np.zeros(len(indices), np.int64), indices, raw[first : indices[-1] + 1])

  seconds, cpu = [], []
  for _ in range(3):  # the first pass warms the threads and their arenas
    todo = [batch(i, first) for i, first in enumerate(range(0, len(raw), batch_size))]
    start, start_cpu = time.perf_counter(), time.process_time()
    for started in [stage.start(b) for b in todo]:
      stage.finish(started)
    seconds.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return len(raw) / min(seconds[1:]), min(cpu[1:]) / len(raw) * 1e6


def beside_tfdata(argv: list[str], ours: dict) -> dict:
  """tf.data's run (`--loader tfdata`, its own process) and ours as ratios of it; or why not."""
  if importlib.util.find_spec("tensorflow") is None:
    return {"skipped": "tensorflow not installed (pip install -e '.[peers]')"}
  with tempfile.NamedTemporaryFile(suffix=".json") as f:
    cmd = [sys.executable, "-m", "bench", "throughput", *argv]
    cmd += ["--loader", "tfdata", "--no-stages", "--no-reference", "--json", f.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
      return {"skipped": f"tf.data failed: {proc.stderr.strip().splitlines()[-1:]}"}
    tf = json.load(open(f.name))
  out = {
    "images_per_sec": tf["images_per_sec"],
    "first_batch_s": tf["first_batch_s"],
    "first_batch_cpu_s": tf["first_batch_cpu_s"],
    "peak_rss_mb": tf["peak_rss_mb"],
    "ours_x_images_per_sec": round(ours["images_per_sec"] / tf["images_per_sec"], 3),
    "ours_x_first_batch": round(ours["first_batch_s"] / tf["first_batch_s"], 3),
    # by CPU to the first batch: steadier than its time where other work shares the cores
    "ours_x_first_batch_cpu": round(ours["first_batch_cpu_s"] / tf["first_batch_cpu_s"], 3),
    "ours_x_peak_rss": round(ours["peak_rss_mb"] / tf["peak_rss_mb"], 3),
  }
  if ours.get("cpu_us_per_image") and tf.get("cpu_us_per_image"):  # images per CPU second
    out["cpu_us_per_image"] = tf["cpu_us_per_image"]
    out["ours_x_images_per_cpu_s"] = round(tf["cpu_us_per_image"] / ours["cpu_us_per_image"], 3)
  for k in ("peak_pss_mb", "loader_pss_mb"):  # with --pss
    if k in tf:
      out[k], out[f"ours_x_{k[:-3]}"] = tf[k], round(ours[k] / tf[k], 3)
  return out


def make_loader(name: str, args) -> callable:
  """A zero-argument function returning a fresh batch iterator for contender `name`."""
  if name == "pipeline":
    from pipeline import dataset

    def make():  # keeps its stages (the memory split planned); notes its first batch's phases
      make.start = time.perf_counter()
      spec = dataset.Spec.of(
        args.data_dir,
        args.split,
        batch_size=args.batch_size,
        image_size=args.image_size,
        order=args.order,
        shard_index=0,
        shard_count=1,
        performance=dict(
          num_threads=args.threads,
          prefetch=args.prefetch,
          num_workers=args.workers,
          memory_mb=args.memory_mb,
        ),
      )
      make.stages = dataset.build(spec)
      planned = time.perf_counter()
      it = iter(dataset.chain(make.stages))
      make.points = (make.start, planned, time.perf_counter())
      return it

    make.timeline = first_batch.Timeline()  # main() runs the loader within its patches
    return make
  from bench import peers

  return peers.make_loader(name, args)


def parser() -> argparse.ArgumentParser:
  p = measure.parser("throughput", __doc__, "split", "batch_size", "image_size", "epochs", "json")
  p.add_argument("--loader", choices=LOADERS, default="pipeline")
  p.add_argument("--threads", type=int, default=None, help="decode threads (default: cores)")
  p.add_argument("--prefetch", type=int, default=2, help="batches in flight")
  p.add_argument("--workers", type=int, default=0, help="worker processes (0: threads only)")
  p.add_argument("--order", choices=("global", "blocks"), default="global")
  p.add_argument("--memory-mb", type=float, default=None, help="performance.memory_mb")
  p.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
  p.add_argument(
    "--pss",
    action="store_true",
    help="the peak PSS beside the planned memory (reading smaps costs CPU: off for speed)",
  )
  p.add_argument(
    "--no-reference",
    action="store_true",
    help="skip the crop-window decode ceiling and tf.data beside ours",
  )
  return p


def main(argv: list[str]) -> dict:
  p = parser()
  args = p.parse_args(argv)
  meta = manifest_lib.load(args.data_dir)
  num_images = int(args.epochs * meta.splits[args.split].num_records)
  loader, before = make_loader(args.loader, args), measure.tree_pss() if args.pss else 0

  def cpu_timed(starting: bool) -> None:
    cpu_timed.spent = time.process_time() - cpu_timed.at if not starting else 0.0
    cpu_timed.at = time.process_time()
    snapshot = by_thread.Snapshot()
    if not starting:  # the bench's own RSS sampler is no loader's CPU: not counted
      cpu_timed.by_thread = snapshot.since(cpu_timed.threads)
      cpu_timed.spent -= cpu_timed.by_thread.get(measure.SAMPLER, {}).get("cpu_s", 0.0)
    cpu_timed.threads = snapshot

  cpu_timed.spent = 0.0
  with measure.RssSampler(pss=True) if args.pss else contextlib.nullcontext() as pss:
    timeline = loader.timeline if args.loader == "pipeline" else None
    with timeline.patched() if timeline else contextlib.nullcontext():
      result = measure.run(args.loader, loader, args.batch_size, num_images, cpu_timed)
  out = {**result.__dict__}
  if cpu_timed.spent:  # the steady state's CPU per image, this process (workers, sampler: not)
    out["cpu_us_per_image"] = round(cpu_timed.spent / result.images * 1e6, 1)
    out["cpu_by_thread"] = by_thread.per_image(cpu_timed.by_thread, result.images)
  print(result.row())
  if args.loader == "pipeline":  # where the first batch's time went
    end = loader.start + result.first_batch_s
    out["first_batch_phases_s"] = loader.timeline.phases(*loader.points, end)
    said = first_batch.line(
      out["first_batch_phases_s"], result.first_batch_s, result.first_batch_cpu_s
    )
    print(f"{'':28s} {said}")
  if out.get("cpu_by_thread"):  # where this process's CPU went, by thread
    print(f"{'':28s} {by_thread.line(out['cpu_by_thread'])}")
  if args.pss:  # the tree's peak PSS: whole, and above its PSS once the loader's imports are done
    out["peak_pss_mb"] = round(pss.peak / 2**20)
    out["loader_pss_mb"] = round((pss.peak - before) / 2**20)
  if args.pss and args.loader == "pipeline":  # the loader's memory: planned, and its peak PSS
    split = loader.stages.read.memory
    out["memory"] = dict(
      planned_mb=round(split.total / 2**20), budget_mb=round(split.budget / 2**20)
    )
    out["memory"].update(measured_mb=out["loader_pss_mb"], plan=split.describe())
    print(f"{'':28s} {split.describe()}; measured: peak PSS {out['memory']['measured_mb']:,} MB")
  if not args.no_reference and args.loader == "pipeline":
    limit = crop_ceiling(args.data_dir, args.split, args.image_size, args.batch_size)
    limit["pipeline_share"] = round(result.images_per_sec / limit["images_per_sec"], 3)
    stage = result.images_per_sec / limit["decode_stage_images_per_sec"]
    limit["pipeline_share_of_decode_stage"] = round(stage, 3)
    if not args.workers and out.get("cpu_us_per_image"):  # the same share by CPU per image
      by_cpu = limit["decode_stage_cpu_us_per_image"] / out["cpu_us_per_image"]
      limit["pipeline_share_of_decode_stage_by_cpu"] = round(by_cpu, 3)
    out["crop_ceiling"] = limit
    print(
      f"{'':28s} {limit['pipeline_share']:.0%} of the cores' raw crop-window decode "
      f"({limit['images_per_sec']:.0f} img/s, {limit['threads']} threads, decode alone); "
      f"{stage:.0%} of its decode stage alone ({limit['decode_stage_images_per_sec']:.0f} "
      "img/s: the same windows flipped and resized into batches, records in memory)"
    )
    if "pipeline_share_of_decode_stage_by_cpu" in limit:
      print(
        f"{'':28s} by CPU per image: the pipeline {out['cpu_us_per_image']:.0f} us, its decode "
        f"stage alone {limit['decode_stage_cpu_us_per_image']:.0f} us: "
        f"{limit['pipeline_share_of_decode_stage_by_cpu']:.0%} (steadier on a loaded machine)"
      )
    out["tfdata"] = tf = beside_tfdata(argv, out)
    if "skipped" in tf:
      print(f"{'':28s} tf.data: skipped, {tf['skipped']}")
    else:
      parts = [
        f"img/s x{tf['ours_x_images_per_sec']:.2f}",
        f"first batch x{tf['ours_x_first_batch']:.2f} (by CPU x{tf['ours_x_first_batch_cpu']:.2f})",
      ]
      if "ours_x_images_per_cpu_s" in tf:  # steadier than img/s where other work shares the cores
        parts.append(f"images per CPU second x{tf['ours_x_images_per_cpu_s']:.2f}")
      parts.append(f"peak RSS x{tf['ours_x_peak_rss']:.2f}")
      if "ours_x_peak_pss" in tf:
        pss = (
          f"peak PSS x{tf['ours_x_peak_pss']:.2f} (above imports x{tf['ours_x_loader_pss']:.2f})"
        )
        parts.append(pss)
      print(f"{'':28s} x tf.data: " + ", ".join(parts))
  if not args.no_stages and args.loader == "pipeline":
    out["stages_ms_per_image"] = stage_breakdown(args.data_dir, args.split, args.image_size)
    print(
      "per image, one thread:",
      ", ".join(f"{k} {v:.3f} ms" for k, v in out["stages_ms_per_image"].items()),
    )
  return measure.finish(p, args, argv, out)


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
