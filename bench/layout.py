"""`python -m bench layout DATA_DIR`: one file per image vs ArrayRecord shards.

    python -m bench layout data/photos --json layout.json

Tests the common claim that packing records into shards makes reading much faster. The
split's JPEGs are written out as one file per image (a temporary image folder), then both
layouts are read in file order and in random order: files one by one and on a thread pool,
shards one record per call and a batch per call (what the pipeline does). Each reading runs
warm (pages in the page cache) and cold: every file's pages are dropped with
posix_fadvise(DONTNEED) first, which needs no root, and the share of pages still cached is
measured with mincore(2) and reported beside the figure, so nobody has to trust it worked.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import grain
import numpy as np
import tqdm

from bench import measure
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.host.parallelism import available_cores

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
  ctypes.c_void_p,
  ctypes.c_size_t,
  ctypes.c_int,
  ctypes.c_int,
  ctypes.c_int,
  ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_share(paths: Sequence[str]) -> float:
  """Share of the files' pages now in the page cache (mincore(2); does not read them)."""
  cached = total = 0
  for path in paths:
    size = os.path.getsize(path)
    if not size:
      continue
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
      addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
      if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap failed on {path}")
      try:
        vec = ctypes.create_string_buffer(pages)
        if _libc.mincore(addr, size, vec):
          raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
        cached += sum(b & 1 for b in vec.raw)
      finally:
        _libc.munmap(addr, size)
    total += pages
  return cached / total if total else 1.0


def evict(paths: Sequence[str]) -> None:
  """Drops the files' pages from the page cache (no root needed); dirty pages (a file just
  written) cannot be dropped, so they are written back first."""
  for path in paths:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fdatasync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def filesystem(path: str) -> str:
  """The type of the filesystem holding `path` (from /proc/mounts), e.g. 'ext4'."""
  real, best, kind = os.path.realpath(path), "", "unknown"
  try:
    with open("/proc/mounts") as f:
      for line in f:
        _, mount, fstype, *_ = line.split()
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
          best, kind = mount, fstype
  except OSError:
    pass
  return kind


def export_files(source, keys: records.Keys, out_dir: str) -> list[str]:
  """Writes each record's image bytes to OUT_DIR/NNNNNNN.jpg, as an image folder holds them."""
  paths = []
  for start in tqdm.trange(0, len(source), 256, desc="write one file per image", unit_scale=256):
    for i, rec in enumerate(source.__getitems__(list(range(start, min(start + 256, len(source)))))):
      path = os.path.join(out_dir, f"{start + i:07d}.jpg")
      with open(path, "wb") as f:
        f.write(records.parse(rec, keys)[0])
      paths.append(path)
  return paths


def _read_file(path: str) -> int:
  with open(path, "rb") as f:
    return len(f.read())


def readers(
  files: list[str], shards: list[str], batch: int, threads: int
) -> dict[str, Callable[[Sequence[int]], int]]:
  """name -> fn(order) reading every record in `order`; returns the bytes delivered."""

  def files_one(order):
    return sum(_read_file(files[i]) for i in order)

  def files_pool(order):
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      return sum(pool.map(_read_file, [files[i] for i in order]))

  def shards_one(order):
    source = grain.sources.ArrayRecordDataSource(shards)  # fresh readers: nothing kept
    return sum(len(source[i]) for i in order)

  def shards_batch(order):
    source = grain.sources.ArrayRecordDataSource(shards)
    return sum(
      sum(map(len, source.__getitems__(list(order[k : k + batch]))))
      for k in range(0, len(order), batch)
    )

  return {
    "files, one per read": files_one,
    f"files, {threads} threads": files_pool,
    "ArrayRecord, one record per call": shards_one,
    f"ArrayRecord, {batch} records per call": shards_batch,
  }


def measure_layout(
  files: list[str], shards: list[str], batch: int, threads: int, repeats: int = 1
) -> list[dict]:
  """records/s and MB/s of every reader x order x cache state (best of `repeats`)."""
  n = len(files)
  orders = {
    "sequential": list(range(n)),
    "random": np.random.default_rng(0).permutation(n).tolist(),
  }
  fns = readers(files, shards, batch, threads)
  rows = []
  todo = [(c, o, r) for c in ("warm", "cold") for o in orders for r in fns]
  for cache, order_name, name in tqdm.tqdm(todo, desc="layout", unit="run"):
    layout = files if name.startswith("files") else shards
    best = None
    for _ in range(repeats):
      if cache == "cold":
        evict(layout)
      else:
        fns[name](orders[order_name])  # fill the cache
      share = cached_share(layout)
      start = time.perf_counter()
      size = fns[name](orders[order_name])
      seconds = time.perf_counter() - start
      if best is None or seconds < best[0]:
        best = (seconds, size, share)
    seconds, size, share = best
    rows.append(
      {
        "reader": name,
        "order": order_name,
        "cache": cache,
        "cached_share_before": round(share, 3),
        "records_per_sec": round(n / seconds, 1),
        "mb_per_sec": round(size / seconds / 1e6, 1),
        "records": n,
      }
    )
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| reader | order | page cache before | records/s | MB/s |", "|---|---|---|---:|---:|"]
  lines += [
    f"| {r['reader']} | {r['order']} | {r['cache']} ({r['cached_share_before']:.0%} "
    f"cached) | {r['records_per_sec']:.0f} | {r['mb_per_sec']:.0f} |"
    for r in rows
  ]
  return "\n".join(lines)


def main(argv: list[str]) -> dict:
  p = measure.parser("layout", __doc__, "split", "batch_size", "threads", "repeats", "json")
  p.add_argument(
    "--tmp-dir",
    default=None,
    help="where the one-file-per-image copy goes (default: the system temp dir); "
    "deleted afterwards",
  )
  args = p.parse_args(argv)
  meta = manifest_lib.load(args.data_dir)
  shards = [os.fspath(p) for p in meta.shard_paths(args.data_dir, args.split)]
  tmp = tempfile.mkdtemp(prefix="layout-bench-", dir=args.tmp_dir)
  try:
    files = export_files(grain.sources.ArrayRecordDataSource(shards), meta.keys, tmp)
    rows = measure_layout(
      files, shards, args.batch_size, args.threads or available_cores(), args.repeats
    )
    same_device = os.stat(tmp).st_dev == os.stat(shards[0]).st_dev
    result = {
      "records": len(files),
      "shards": len(shards),
      "files_mb": round(sum(map(os.path.getsize, files)) / 1e6, 1),
      "shards_mb": round(sum(map(os.path.getsize, shards)) / 1e6, 1),
      "filesystem": {
        "shards": filesystem(shards[0]),
        "files": filesystem(tmp),
        "same_device": same_device,
      },
      "rows": rows,
    }
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  measure.finish(p, args, argv, result)
  print(table(rows))
  print(
    f"{result['records']} records: {result['files_mb']} MB as files on "
    f"{result['filesystem']['files']}, {result['shards_mb']} MB in {result['shards']} shards "
    f"on {result['filesystem']['shards']}   [{result['machine']}]"
  )
  return result


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
