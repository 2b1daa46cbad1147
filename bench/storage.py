"""`python -m bench storage DATA_DIR`: the pipeline vs tf.data on slow storage.

    python -m bench storage data/photos --latency-ms 0,5,20,50 --rounds 3

Object storage (a GCS bucket through gcsfuse) answers each read after 5-100 ms. This serves
one copy of DATA_DIR's split through the storage rig (bench/rig.py: FUSE, a fixed latency
per read request, no page cache) and runs, each in a fresh process, on the same records:
- pipeline: `make_dataset(DIR, split, batch_size=128)`, nothing else set (224 px train);
  pipeline-nocache: the same with its record cache off (every epoch read from storage);
  pipeline-nocache-global: also order="global" (one request per image, as on local disk;
  through the rig the default is the block order, `pipeline.order.blocks`);
- tfdata: tf.data as `peers` runs it (parallel map with decode_and_crop_jpeg, AUTOTUNE),
  interleaving 8 TFRecord files with 256 KB read buffers.
The split is first re-sharded into --shard-size-mb shards (the issue's rig: 1 MB, >= 100
shards) and copied as TFRecord files with the same partition, once, into --work-dir.
Rounds are interleaved (for each round, each storage, each loader), plus a local-disk
column read without the rig (page cache warm). Per cell: img/s after the first batch
(median of rounds, min-max), first-batch s, peak RSS, and from the rig's counters over the
timed batches: read requests per image delivered (in steady state a loader reads ahead as
much as it consumes), KB per read request; most reads in flight at once over the whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
import types

from bench import measure, peers
from pipeline.catalog import manifest as manifest_lib

LOADERS = {
  "pipeline": "this pipeline, defaults",
  "pipeline-nocache": "this pipeline, record cache off",
  "pipeline-nocache-global": "this pipeline, record cache off, order='global'",
  "tfdata": "tf.data, interleave 8, 256 KB buffers",
}
TFDATA_CYCLE, TFDATA_BUFFER = 8, 256 * 1024
LOCAL = "local disk"


# ---------------------------------------------------------------- the data


def prepare(
  data_dir: str, split: str, shard_size_mb: float, work: str, class_order: bool = False
) -> pathlib.Path:
  """A dataset folder in `work` holding DATA_DIR's split re-sharded (0: shards as they are;
  `class_order`: its records sorted by label first, as an ImageNet class folder converts)
  and the same shards as TFRecord files in peers-tfrecord/ (named as `peers` names them);
  made once and reused while DATA_DIR's shards are unchanged."""
  from pipeline.convert import tfrecord

  meta = manifest_lib.load(data_dir)
  if split not in meta.splits:
    raise KeyError(f"split {split!r} not in {data_dir} (has {', '.join(meta.splits)})")
  shards = [os.fspath(p) for p in meta.shard_paths(data_dir, split)]
  key = hashlib.sha256(
    json.dumps(
      [
        os.path.abspath(data_dir),
        split,
        shard_size_mb,
        [s.sha256 for s in meta.splits[split].shards],
        *(["class order"] if class_order else []),
      ]
    ).encode()
  ).hexdigest()[:12]
  name = os.path.basename(os.path.abspath(data_dir))
  order = "-classes" if class_order else ""
  out = pathlib.Path(work) / f"{name}-{split}-{shard_size_mb:g}mb{order}-{key}"
  if (out / "manifest.json").exists():
    return out
  tmp = out.with_name(out.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  dataset = tmp / "dataset"
  if class_order and shard_size_mb <= 0:
    raise ValueError("--class-order re-shards the split: give --shard-size-mb > 0")
  if shard_size_mb > 0:
    recs = peers.records(shards)
    if class_order:
      from pipeline.catalog import records

      recs = sorted(recs, key=lambda r: records.parse(r, meta.keys)[1])
    peers.write_tfrecord(tmp / "all.tfrecord", recs)
    tfrecord.convert(
      tfrecord.Request(
        str(tmp / "all.tfrecord"),
        dataset,
        split=split,
        keys=meta.keys,
        classes=meta.classes,
        shard_size_mb=shard_size_mb,
      ),
      workers=1,
      progress=False,
    )
    (tmp / "all.tfrecord").unlink()
  else:
    dataset.mkdir()
    for path in shards:
      shutil.copy(path, dataset)
    only = manifest_lib.Manifest(meta.classes, {split: meta.splits[split]}, keys=meta.keys)
    manifest_lib.save(only, dataset)
  peers.tfrecord_copy(dataset, split)
  os.replace(dataset, tmp / "ready")
  shutil.rmtree(out, ignore_errors=True)
  os.replace(tmp / "ready", out)
  shutil.rmtree(tmp, ignore_errors=True)
  return out


def describe(dataset: pathlib.Path, split: str) -> dict:
  meta = manifest_lib.load(dataset)
  paths = meta.shard_paths(dataset, split)
  records = meta.splits[split].num_records
  record_bytes = sum(len(r) for r in peers.records([os.fspath(p) for p in paths]))
  return {
    "dir": os.fspath(dataset),
    "records": records,
    "shards": len(paths),
    "shards_mb": round(sum(os.path.getsize(p) for p in paths) / 1e6, 1),
    "mean_record_kb": round(record_bytes / records / 1e3, 1),
    "tfrecord_files": len(list((dataset / "peers-tfrecord").iterdir())),
  }


# ---------------------------------------------------------------- one run, in its own process


def run_one(
  loader: str, data_dir: str, split: str, batches: int, batch_size: int, max_rps: float = 0
) -> dict:
  """Times `batches` batches (the first apart) of one loader reading `data_dir`; the
  pipeline's with performance.max_requests_per_s=`max_rps` when set."""
  if loader.startswith("pipeline"):
    from pipeline import dataset

    perf = {"record_cache_mb": 0.0} if loader.startswith("pipeline-nocache") else {}
    perf = {**perf, "max_requests_per_s": max_rps} if max_rps else perf
    order = "global" if loader.endswith("-global") else None
    make = lambda: iter(
      dataset.make_dataset(data_dir, split, batch_size=batch_size, performance=perf, order=order)
    )
  else:
    args = types.SimpleNamespace(
      data_dir=data_dir,
      split=split,
      image_size=224,
      batch_size=batch_size,
      cycle_length=TFDATA_CYCLE,
      read_buffer_bytes=TFDATA_BUFFER,
    )
    make = peers.make_loader(loader, args)
  rig = pathlib.Path(data_dir)
  through_rig = (rig / ".rig-stats").exists()
  parts = {}

  def timed(starts: bool) -> None:  # the rig's counters up to the first batch, then after
    if through_rig:
      name = "first_batch" if starts else "timed"
      parts[name] = json.loads((rig / (".rig-reset" if starts else ".rig-stats")).read_text())

  result = measure.run(loader, make, batch_size, (batches - 1) * batch_size, timed)
  out = {**result.__dict__}
  if parts:
    out["rig"] = parts
  return out


def _child(loader: str, data_dir: str, args, timeout: float) -> dict:
  cmd = [sys.executable, "-m", "bench", "storage", data_dir, "--run-one", loader]
  cmd += measure.flags(
    split=args.split,
    batches=args.batches,
    batch_size=args.batch_size,
    max_requests_per_s=args.max_requests_per_s,
  )
  env = {**os.environ, "TQDM_DISABLE": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines or not lines[-1].startswith("{"):
    last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
    return {"error": f"exit {proc.returncode}: {last[0][:300]}"}
  return {**json.loads(lines[-1]), "printed": lines[:-1][-4:]}  # e.g. the pipeline's plan


# ---------------------------------------------------------------- the rounds


def measure_all(dataset: pathlib.Path, latencies, loaders, args) -> list[dict]:
  """Every (round, storage, loader) run, interleaved; one dict each."""
  from bench import rig

  runs = []
  storages = [LOCAL, *latencies]
  total, done = args.rounds * len(storages) * len(loaders), 0
  for round_ in range(args.rounds):
    for storage in storages:
      with contextlib.ExitStack() as stack:
        path, mounted = dataset, None
        if storage != LOCAL:
          caps = {"requests_per_s": args.requests_per_s, "mb_per_s": args.mb_per_s}
          mounted = stack.enter_context(rig.mount(dataset, storage, **caps))
          path = mounted.path
        for loader in loaders:
          if mounted:
            mounted.reset()
          start = time.perf_counter()
          run = _child(loader, os.fspath(path), args, args.timeout)
          run.update(round=round_, storage=storage, loader=loader)
          run["wall_s"] = round(time.perf_counter() - start, 1)
          if mounted and "error" not in run:
            run["rig"] = _io(run["rig"], run["images"])
          runs.append(run)
          done += 1
          print(f"[{done}/{total}] {_line(run)}", flush=True)
  return runs


def _io(parts: dict, images_timed: int) -> dict:
  """The rig's figures of one run: the timed batches' reads per image and KB per read;
  the most reads in flight over the whole run; what the first batch read."""
  first, timed = parts["first_batch"], parts["timed"]
  return {
    "reads_per_image": round(timed["reads"] / images_timed, 3),
    "kb_per_read": round(timed["bytes"] / timed["reads"] / 1e3, 1) if timed["reads"] else 0,
    "max_in_flight": max(first["max_in_flight"], timed["max_in_flight"]),
    "first_batch_reads": first["reads"],
    "first_batch_mb": round(first["bytes"] / 1e6, 1),
    "timed": timed,
  }


def _storage_name(storage) -> str:
  return storage if storage == LOCAL else f"{storage:g} ms"


def _line(run: dict) -> str:
  where = f"round {run['round'] + 1}, {_storage_name(run['storage'])}, {run['loader']}"
  if "error" in run:
    return f"{where}: FAILED ({run['error']})"
  rig = run.get("rig")
  io = (
    f"; {rig['reads_per_image']:.2f} reads/image, {rig['kb_per_read']:.0f} KB/read, "
    f"{rig['max_in_flight']} in flight; first batch read {rig['first_batch_reads']} times, "
    f"{rig['first_batch_mb']} MB"
    if rig
    else ""
  )
  return (
    f"{where}: {run['images_per_sec']:.0f} img/s, first batch {run['first_batch_s']:.2f} s, "
    f"peak RSS {run['peak_rss_mb']:.0f} MB{io}"
  )


def summarize(runs: list[dict], latencies, loaders) -> list[dict]:
  """One row per (loader, storage): medians over the rounds that ran."""
  rows = []
  for loader in loaders:
    for storage in [LOCAL, *latencies]:
      ok = [
        r for r in runs if r["loader"] == loader and r["storage"] == storage and "error" not in r
      ]
      row = {"loader": loader, "storage": _storage_name(storage), "rounds": len(ok)}
      if ok:
        rates = [r["images_per_sec"] for r in ok]
        row.update(
          images_per_sec=round(statistics.median(rates), 1),
          images_per_sec_min=round(min(rates), 1),
          images_per_sec_max=round(max(rates), 1),
          first_batch_s=round(statistics.median(r["first_batch_s"] for r in ok), 2),
          peak_rss_mb=round(statistics.median(r["peak_rss_mb"] for r in ok)),
        )
        rigs = [r["rig"] for r in ok if "rig" in r]
        if rigs:
          row.update(
            reads_per_image=statistics.median(r["reads_per_image"] for r in rigs),
            kb_per_read=statistics.median(r["kb_per_read"] for r in rigs),
            first_batch_reads=statistics.median(r["first_batch_reads"] for r in rigs),
            max_in_flight=max(r["max_in_flight"] for r in rigs),
          )
      rows.append(row)
  return rows


def table(rows: list[dict], latencies, loaders) -> str:
  """The issue's table (img/s: loaders x storages), then every figure per cell."""
  columns = [LOCAL, *(_storage_name(x) for x in latencies)]
  by = {(r["loader"], r["storage"]): r for r in rows}

  def rate(r):
    if not r or not r["rounds"]:
      return "failed"
    spread = f" ({r['images_per_sec_min']:.0f}–{r['images_per_sec_max']:.0f})"
    return f"{r['images_per_sec']:.0f}" + (spread if r["rounds"] > 1 else "")

  lines = [
    "| img/s, median (min–max) | " + " | ".join(columns) + " |",
    "|---|" + "---:|" * len(columns),
  ]
  lines += [
    f"| {LOADERS[ld]} | " + " | ".join(rate(by.get((ld, c))) for c in columns) + " |"
    for ld in loaders
  ]
  lines += [
    "",
    "| loader | storage | img/s | first batch (s) | peak RSS (MB) | reads/image | KB/read "
    "| most reads in flight |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if not r["rounds"]:
      lines.append(f"| {r['loader']} | {r['storage']} | failed | | | | | |")
      continue
    io = (
      f"{r['reads_per_image']:.2f} | {r['kb_per_read']:.0f} | {r['max_in_flight']}"
      if "reads_per_image" in r
      else "— | — | —"
    )
    lines.append(
      f"| {r['loader']} | {r['storage']} | {rate(r)} | {r['first_batch_s']:.2f} | "
      f"{r['peak_rss_mb']:.0f} | {io} |"
    )
  return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
  p = measure.parser(
    "storage", __doc__, "split", "rounds", "batches", "batch_size", "json", batches=12
  )
  p.add_argument(
    "--latency-ms",
    type=measure.numbers(float, 0),
    default=[0.0, 5.0, 20.0, 50.0],
    help="per read request, comma-separated (default 0,5,20,50); local disk is added",
  )
  p.add_argument(
    "--requests-per-s", type=float, default=0, help="the rig's request cap (default 0: none)"
  )
  p.add_argument(
    "--mb-per-s", type=float, default=0, help="the rig's bandwidth cap (default 0: none)"
  )
  p.add_argument(
    "--max-requests-per-s",
    type=float,
    default=0,
    help="the pipeline's performance.max_requests_per_s (default 0: not set)",
  )
  p.add_argument(
    "--shard-size-mb",
    type=float,
    default=1.0,
    help="re-shard the split into shards of this size first (default 1; 0 keeps its shards)",
  )
  p.add_argument(
    "--class-order",
    action="store_true",
    help="sort the split's records by label before re-sharding (as ImageNet's folders convert)",
  )
  p.add_argument(
    "--loaders", default="pipeline,tfdata", help=f"comma-separated: {','.join(LOADERS)}"
  )
  p.add_argument(
    "--work-dir",
    default="runs/storage-bench",
    help="where the re-sharded copy and its TFRecord twin are kept (default runs/storage-bench)",
  )
  p.add_argument("--timeout", type=float, default=600, help="seconds per run before giving up")
  p.add_argument("--run-one", choices=list(LOADERS), help=argparse.SUPPRESS)
  return p


def main(argv: list[str]) -> dict:
  p = parser()
  args = p.parse_args(argv)
  if args.run_one:  # the child: one loader, figures as the last line
    print(
      json.dumps(
        run_one(
          args.run_one,
          args.data_dir,
          args.split,
          args.batches,
          args.batch_size,
          args.max_requests_per_s,
        )
      )
    )
    return {}
  if args.batches < 2 or args.rounds < 1:
    raise ValueError("--batches must be >= 2 (the first is timed apart) and --rounds >= 1")
  loaders = [x.strip() for x in args.loaders.split(",") if x.strip()]
  unknown = sorted(set(loaders) - set(LOADERS))
  if unknown:
    raise ValueError(f"unknown loaders {unknown}: choose from {', '.join(LOADERS)}")
  if "tfdata" in loaders and importlib.util.find_spec("tensorflow") is None:
    print("tfdata skipped: tensorflow is not installed (pip install -e '.[peers]')", flush=True)
    loaders.remove("tfdata")
  from bench import rig

  rig.ensure_built()  # fails here, in one line, before any work
  dataset = prepare(args.data_dir, args.split, args.shard_size_mb, args.work_dir, args.class_order)
  info = describe(dataset, args.split)
  print(
    f"{info['records']} records ({info['mean_record_kb']} KB each on average) in "
    f"{info['shards']} ArrayRecord shards and {info['tfrecord_files']} TFRecord files: "
    f"{info['dir']}",
    flush=True,
  )
  runs = measure_all(dataset, args.latency_ms, loaders, args)
  rows = summarize(runs, args.latency_ms, loaders)
  print()
  print(table(rows, args.latency_ms, loaders))
  caps = f", rig caps: {args.requests_per_s or 'no'} requests/s, {args.mb_per_s or 'no'} MB/s"
  print(
    f"\n{args.rounds} interleaved round(s), {args.batches} batches of {args.batch_size} "
    f"per run{caps}   [{measure.machine()}]"
  )
  result = {
    "dataset": info,
    "latencies_ms": args.latency_ms,
    "requests_per_s": args.requests_per_s,
    "mb_per_s": args.mb_per_s,
    "max_requests_per_s": args.max_requests_per_s,
    "rounds": args.rounds,
    "batches": args.batches,
    "batch_size": args.batch_size,
    "rows": rows,
    "runs": runs,
  }
  return measure.finish(p, args, argv, result)


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
