"""`python -m bench gets DATA_DIR`: storage requests (GETs) per image from a gs:// bucket.

    python -m bench gets runs/storage-bench/photos-train-8mb-classes-...  --batches 20

Serves DATA_DIR from the local Cloud Storage emulator the tests use (`tests/gcs_emulator.py`,
which counts the object downloads it serves; `pip install -e '.[dev]'`), then reads
`gs://bkt/ds` with `make_dataset` (record cache off, no workers) in each order, and counts
the GETs made while --batches batches of --batch-size are taken after the first (the reads
ahead included): records per GET is what a bucket's request budget sees from array_record's
own GCS client, without a FUSE layer cutting reads into 1 MiB requests.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench import measure

EMULATOR = measure.ROOT / "tests" / "gcs_emulator.py"


def count(orders: list[str], data_dir: str, batches: int, batch_size: int) -> list[dict]:
  """Each order's GETs and records read over `batches` batches after the first."""
  import gcsfs

  import pipeline
  from pipeline import dataset

  counter = pathlib.Path(os.environ["GCS_EMULATOR_COUNT"])
  gcsfs.GCSFileSystem(token="anon").put(data_dir, "bkt/ds", recursive=True)
  out = []
  for order in orders:
    perf = dict(record_cache_mb=0, num_workers=0)
    spec = pipeline.Spec.of("gs://bkt/ds", batch_size=batch_size, order=order, performance=perf)
    st = dataset.build(spec)
    it = iter(dataset.chain(st))
    next(it)
    gets, records = int(counter.read_text()), st.read.stats.request_records
    for _ in range(batches):
      next(it)
    gets, records = int(counter.read_text()) - gets, st.read.stats.request_records - records
    it.close()
    out.append(
      dict(order=order, gets=gets, records=records, records_per_get=round(records / gets, 2))
    )
  return out


def main(argv: list[str]) -> list[dict]:
  p = measure.parser("gets", __doc__, "batches", "batch_size")
  p.add_argument("--orders", default="global,blocks", help="comma-separated (default both)")
  args = p.parse_args(argv)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  env = {
    **os.environ,
    "STORAGE_EMULATOR_HOST": url,
    "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "EPATH_USE_TF": "false",
    "GCS_EMULATOR_COUNT": os.path.join(tempfile.mkdtemp(), "gets"),
  }
  server = subprocess.Popen(
    [sys.executable, str(EMULATOR), str(port), "bkt"],
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    for _ in range(300):
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b/bkt", timeout=1).read()
        break
      except OSError:
        time.sleep(0.1)
    spec = [args.orders.split(","), args.data_dir, args.batches, args.batch_size]
    rows = measure.child("bench.gets", spec, env=env)  # epath keeps its gs:// backend per process
  finally:
    server.kill()
    server.wait()
  for r in rows:
    print(
      f"{r['order']:7s} {r['gets']:6,} GETs for {r['records']:6,} records read: "
      f"{r['records_per_get']:.2f} records per GET"
    )
  return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
  print(json.dumps(count(*json.loads(sys.argv[2]))))
