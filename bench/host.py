"""`python -m bench host DATA_DIR`: this host's pipeline, measured and projected, in one JSON.

    python -m bench host data/photos --json host.json        # a few minutes; under 8

The pipeline alone at the plan it chooses on this host (workers x threads), from local disk
and through the storage rig (`bench.rig`: 20 ms a read, 250 requests/s, no page cache), in the
block and the global order, `--batches` batches timed after the first; beside each, what the
host model projects for this many cores (`parallelism.project`, as `bench scaling` projects
it: costs from a `bench scaling --json` file, else the measured `parallelism.COSTS`; the block
order with the block store's costs measured here, `bench.scaling.store_costs`).
"""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np

from bench import costs as costs_lib
from bench import measure, rig, scaling
from pipeline import dataset
from pipeline.host import parallelism

ORDERS = ("blocks", "global")


def projection(args, cores: int) -> dict:
  """The model's plan and img/s for `cores` in each order (`bench.scaling.hosts`)."""
  source = costs_lib.open_split(args.data_dir, args.split)[1]
  records = source.read(list(range(min(256, len(source)))))
  record_kb = float(np.mean([len(r) for r in records])) / 1024
  measured = scaling.store_costs(records)
  costs, store = (
    parallelism.COSTS,
    {
      "us_per_image": measured["store_us"],
      "gil_us_per_image": measured["store_gil_us"],
      "block_records": measured["block_records"],
    },
  )
  if args.costs:
    with open(args.costs) as f:
      scaled = json.load(f)
    costs, store = parallelism.Costs(**scaled["costs"]), scaled["store"]
  row = scaling.hosts(
    costs, [cores], args.batch_size, [args.batch_size], args.image_size,
    record_kb=record_kb, store=store,
  )[0]  # fmt: skip
  keep = ("workers", "threads", "projected_img_s", "bound_by")
  return {"global": {k: row[k] for k in keep}, "blocks": {k: row["blocks"][k] for k in keep}}


def run_one(args, data_dir: str, order: str) -> dict:
  """The pipeline alone at its own plan: img/s, first batch, the tree's peak RSS, its planned
  memory and, with --pss, what the loader holds (the tree's peak PSS above its PSS once the
  imports are done; sampled from smaps inside the timed run, hence asked for)."""
  spec = dataset.Spec.of(
    data_dir, args.split, batch_size=args.batch_size, image_size=args.image_size,
    order=order, shard_index=0, shard_count=1,
  )  # fmt: skip

  def make():
    make.stages = dataset.build(spec)
    return iter(dataset.chain(make.stages))

  before = measure.tree_pss() if args.pss else 0
  with measure.RssSampler(pss=True) if args.pss else contextlib.nullcontext() as pss:
    got = measure.run(order, make, args.batch_size, args.batches * args.batch_size)
  stages = make.stages
  return {
    "workers": stages.workers,
    "threads": stages.decode.num_threads,
    "images_per_sec": round(got.images_per_sec),
    "first_batch_s": round(got.first_batch_s, 2),
    "peak_rss_mb": round(got.peak_rss_mb),
    "planned_memory_mb": round(stages.read.memory.total / 2**20),
    **({"loader_pss_mb": round((pss.peak - before) / 2**20)} if args.pss else {}),
  }


def main(argv: list[str]) -> dict:
  p = measure.parser("host", __doc__, "split", "batch_size", "image_size", "batches", "json")
  p.add_argument("--costs", help="a `bench scaling --json` file (default: parallelism.COSTS)")
  p.add_argument("--latency-ms", type=float, default=20.0, help="the rig's latency per read")
  p.add_argument("--requests-per-s", type=float, default=250.0, help="the rig's request cap")
  p.add_argument("--pss", action="store_true", help="also the loader's peak PSS above imports")
  args = p.parse_args(argv)
  start, cores = time.perf_counter(), parallelism.available_cores()
  projected = projection(args, cores)
  rows = []
  for where in ("local", f"rig {args.latency_ms:g} ms, {args.requests_per_s:g}/s"):
    with contextlib.ExitStack() as stack:
      data_dir = args.data_dir
      if where != "local":
        try:
          mounted = rig.mount(args.data_dir, args.latency_ms, requests_per_s=args.requests_per_s)
          data_dir = str(stack.enter_context(mounted).path)
        except rig.RigUnavailable as e:  # no FUSE here: the local rows only, and why
          rows.append({"storage": where, "skipped": str(e)})
          print(f"{where:24s} skipped: {e}")
          continue
      for order in ORDERS:
        row = run_one(args, data_dir, order)
        rows.append({"storage": where, "order": order, **row, "model": projected[order]})
        model = projected[order]
        print(
          f"{where:24s} {order:7s} {row['workers']}x{row['threads']:<3d} "
          f"{row['images_per_sec']:7,d} img/s (model at {cores} cores: {model['workers']}x"
          f"{model['threads']}, {model['projected_img_s']:,} img/s)  first batch "
          f"{row['first_batch_s']:.2f} s  peak RSS {row['peak_rss_mb']:,} MB"
          + (f", the loader's PSS {row['loader_pss_mb']:,} MB" if args.pss else "")
          + f" (planned {row['planned_memory_mb']:,})"
        )
  result = {"cores": cores, "rows": rows, "seconds": round(time.perf_counter() - start)}
  return measure.finish(p, args, argv, result)
