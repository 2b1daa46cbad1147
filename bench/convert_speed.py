"""`python -m bench convert SRC`: conversion images/s and MB/s vs a sequential converter.

    python -m bench convert data/raw/photos --workers 2 --repeats 3 --json out.json
    python -m bench convert data/raw/photos --workers 2 --emulator --dask   # in .venv-beam

The baseline is the straightforward converter: one process reads each file, checks it by a
full Pillow decode to RGB, writes the record and hashes the shard. Ours is
`pipeline.convert.images.convert` (strict entropy-complete check at 1/8 DCT scale; with more
shards than workers each worker writes whole shards), timed with one worker and with
`--workers`, process start included. Files are read once first, so all find them cached.
`--emulator` adds SRC copied into a local Cloud Storage emulator (`tests/gcs_emulator.py`,
in memory, on this machine) converted from gs:// into gs:// with `--workers`; its CPU
seconds leave out the emulator's. `--dask` adds Beam's DaskRunner on a warm LocalCluster of
`--workers` processes (started once, before the timed runs; extra `beam`). The contenders
take turns: round 1 runs each once, then round 2...; each row's best round is shown.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time

import psutil
from PIL import Image

from bench import measure
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.convert import images, shards
from tests import gcs_emulator


def _source(path: str) -> str:
  """An image folder, or the folder a converted dataset (holding manifest.json) came from."""
  if os.path.exists(os.path.join(path, manifest_lib.FILENAME)):
    return manifest_lib.load(path).created_by["source"]
  return path


def sequential_convert(src: str, out: str, shard_size_mb: float) -> int:
  """The baseline: read, fully decode with Pillow, encode, write, hash; one file at a time."""
  by_class, _ = images.scan(src)
  classes = sorted(by_class)
  files = [(rel, label) for label, name in enumerate(classes) for rel in by_class[name]]
  sizes = [os.path.getsize(os.path.join(src, rel)) for rel, _ in files]
  written = 0
  for plan in shards.plan_split("train", files, sizes, int(shard_size_mb * (1 << 20))):
    shard = shards.AtomicShard(out, plan.name)
    for rel, label in plan.items:
      with open(os.path.join(src, rel), "rb") as f:
        data = f.read()
      try:
        Image.open(io.BytesIO(data)).convert("RGB")
      except OSError:
        continue
      shard.write(records.encode(data, label, rel))
      written += 1
    shard.commit()
  return written


def _cpu_seconds(exclude: int | None = None) -> float:
  """CPU time of this process and its descendants so far (but the process `exclude`), reaped
  workers included (these are children of the forkserver, which outlives them)."""
  me = psutil.Process()
  total = sum(me.cpu_times()[:4])
  for child in me.children(recursive=True):
    try:
      if child.pid != exclude:
        total += sum(child.cpu_times()[:4])
    except psutil.NoSuchProcess:
      pass
  return total


def _timed(run, exclude: int | None = None) -> tuple[float, float, int]:
  """(wall seconds, CPU seconds, images converted) of one run."""
  cpu, start = _cpu_seconds(exclude), time.perf_counter()
  count = run()
  wall = time.perf_counter() - start
  time.sleep(0.2)  # lets the forkserver reap the workers, adding their CPU time to its own
  return wall, _cpu_seconds(exclude) - cpu, count


@contextlib.contextmanager
def _emulator(src: str):
  """A local Cloud Storage holding `src` at gs://bkt/src (`tests/gcs_emulator.py`); yields its
  process id. Points gcsfs and array_record at it for the rest of this process and its workers
  (gcsfs reads the setting once, at import): a command's own process, not a library call."""
  with gcs_emulator.serving("bkt") as (env, pid):
    os.environ.update(env)
    import gcsfs

    gcsfs.GCSFileSystem(token="anon").put(src, "bkt/src", recursive=True)
    yield pid


@contextlib.contextmanager
def _dask(workers: int):
  """A warm dask.distributed LocalCluster of `workers` processes; yields Beam's arguments."""
  import distributed

  with distributed.LocalCluster(
    n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None
  ) as cluster:
    yield ["--dask_client_address", cluster.scheduler_address]


def main(argv: list[str]) -> dict:
  p = measure.parser("convert", __doc__, "repeats", "json", data_dir=None)
  p.add_argument("src", help="image folder SRC/CLASS/IMAGE, or a converted dataset folder")
  p.add_argument(
    "--workers",
    type=int,
    default=os.cpu_count(),
    help="worker processes for ours (default: all cores)",
  )
  p.add_argument(
    "--shard-size-mb",
    type=float,
    default=8,
    help="default 8 (as `make data`): more shards than workers, as for ImageNet",
  )
  p.add_argument(
    "--emulator", action="store_true", help="add gs:// to gs:// through a local GCS emulator"
  )
  p.add_argument("--dask", action="store_true", help="add Beam's DaskRunner (extra beam)")
  args = p.parse_args(argv)
  src = _source(args.src)
  by_class, _ = images.scan(src)
  paths = [os.path.join(src, rel) for files in by_class.values() for rel in files]
  total_bytes = 0
  for path in paths:  # read once so that every contender finds the files in the page cache
    with open(path, "rb") as f:
      total_bytes += len(f.read())

  contenders = {
    "sequential (Pillow full decode, 1 process)": lambda out: sequential_convert(
      src, out, args.shard_size_mb
    ),
    "pipeline.convert, 1 worker": lambda out: _count(
      images.convert(
        images.Request(src, out, shard_size_mb=args.shard_size_mb), workers=1, progress=False
      )
    ),
    f"pipeline.convert, {args.workers} workers": lambda out: _count(
      images.convert(
        images.Request(src, out, shard_size_mb=args.shard_size_mb),
        workers=args.workers,
        progress=False,
      )
    ),
  }
  with contextlib.ExitStack() as stack:
    emulator = None
    if args.emulator:
      emulator = stack.enter_context(_emulator(src))
      contenders[f"pipeline.convert gs:// to gs:// (emulator), {args.workers} workers"] = (
        lambda out: _count(
          images.convert(
            images.Request(
              "gs://bkt/src", f"gs://bkt/{os.path.basename(out)}", shard_size_mb=args.shard_size_mb
            ),
            workers=args.workers,
            progress=False,
          )
        )
      )
    if args.dask:
      from pipeline.convert import beam

      dask_args = stack.enter_context(_dask(args.workers))

      def dask(out: str):
        request = images.Request(src, out, shard_size_mb=args.shard_size_mb)
        return beam.convert_images(
          request, runner="DaskRunner", pipeline_args=dask_args, progress=False
        )

      with tempfile.TemporaryDirectory(prefix="bench-convert-") as out:
        dask(out)  # warms the workers: Beam and the converters imported
      contenders[f"Beam DaskRunner, warm cluster of {args.workers} workers"] = lambda out: _count(
        dask(out)
      )
    load = os.getloadavg()[0]
    runs = {name: [] for name in contenders}
    for _ in range(args.repeats):
      for name, run in contenders.items():
        with tempfile.TemporaryDirectory(prefix="bench-convert-") as out:
          runs[name].append(_timed(lambda: run(out), emulator))  # noqa: B023 (called at once)
  rows = {}
  for name, found in runs.items():
    wall, cpu, count = min(found)
    rows[name] = {
      "seconds": wall,
      "cpu_seconds": cpu,
      "images": count,
      "images_per_s": count / wall,
      "mb_per_s": total_bytes / wall / 1e6,
      "images_per_cpu_s": count / cpu,
      "rounds_images_per_s": [c / w for w, _, c in found],
    }
  base = next(iter(rows.values()))
  print(
    f"Conversion of {len(paths)} images ({total_bytes / 1e6:.0f} MB) from `{src}`, "
    f"best of {args.repeats} interleaved rounds; {measure.machine()}; load average "
    f"{load:.1f} at the start."
    "\nCPU seconds count every process (workers included): on a busy machine they show "
    "the work done where wall time shows the share of the cores it got.\n"
  )
  print("| converter | seconds | images/s | MB/s | speed-up | CPU s | images/CPU s |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for name, r in rows.items():
    print(
      f"| {name} | {r['seconds']:.2f} | {r['images_per_s']:.0f} | {r['mb_per_s']:.1f} | "
      f"{base['seconds'] / r['seconds']:.2f}x | {r['cpu_seconds']:.2f} | "
      f"{r['images_per_cpu_s']:.0f} |"
    )
  result = {"source": src, "images": len(paths), "bytes": total_bytes, "workers": args.workers}
  return measure.finish(p, args, argv, {**result, "rows": rows})


def _count(m: manifest_lib.Manifest) -> int:
  return sum(s.num_records for s in m.splits.values())
