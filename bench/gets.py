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
import sys
import tempfile

from bench import measure
from tests import gcs_emulator


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
    per_get = round(records / gets, 2) if gets else None  # the reads ahead covered them all
    out.append(dict(order=order, gets=gets, records=records, records_per_get=per_get))
  return out


def main(argv: list[str]) -> list[dict]:
  p = measure.parser("gets", __doc__, "batches", "batch_size")
  p.add_argument("--orders", default="global,blocks", help="comma-separated (default both)")
  args = p.parse_args(argv)
  counter = {"GCS_EMULATOR_COUNT": os.path.join(tempfile.mkdtemp(), "gets")}
  with gcs_emulator.serving("bkt", counter) as (emulator, _):
    env = {**os.environ, **emulator, **counter}
    spec = [args.orders.split(","), args.data_dir, args.batches, args.batch_size]
    rows = measure.child("bench.gets", spec, env=env)  # epath keeps its gs:// backend per process
  for r in rows:
    per_get = (
      f"{r['records_per_get']:.2f} records per GET"
      if r["gets"]
      else "the batches before them had read these ahead: raise --batches"
    )
    print(f"{r['order']:7s} {r['gets']:6,} GETs for {r['records']:6,} records read: {per_get}")
  return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
  print(json.dumps(count(*json.loads(sys.argv[2]))))
