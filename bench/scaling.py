"""`python -m bench scaling DATA_DIR`: one process's ceiling, and a many-core host's rate.

    python -m bench scaling data/photos --cores 96,224 --json scaling.json

A 2-core machine cannot run a 224-core host's pipeline, so this measures the costs that
decide it here and projects with `pipeline.host.parallelism`'s model. Every run is
`make_dataset` (train augmentation, given batch and image size) in a fresh process, timed
in steady state after its first batch. Steps 1-4 and 7 run `--repeat` times (default 3),
interleaved; the model takes their medians, and the report gives each one's spread.

1. cpu: one decode thread: the process's CPU per image (`cpu_us_per_image`).
2. rest: one thread with decode emulation (`bench.emulate`, waits D,R), whose decoder
   replaces each image's parse, crop box and decode by a GIL-free wait of D microseconds and
   its resize by one of R (read, batching, Grain and the Python per image stay real), here
   with waits of ~0: the CPU of everything else (`rest_cpu_us_per_image`). decode + resize =
   cpu - rest is the GIL-free work (`decode_us_per_image`), split between D and R as the
   two take alone on one thread.
3. read: alone in a fresh process, `ShardedSource.read` of batches of the same size at
   shuffled indices of the dataset's real records: its CPU per record
   (`read_cpu_us_per_image`), and a memcpy of records of the same sizes
   (`read_copy_us_per_image`), the part of the read that holds the GIL.
4. gil, measured directly (`gil_direct_us_per_image`, the model's GIL time): the CPU each
   thread spends holding the GIL, summed by an LD_PRELOAD shim around
   PyEval_SaveThread/RestoreThread (`bench.gil`), with real decode on `--worker-threads`
   threads, as a worker runs; also over step 5's best run (`gil_direct_ceiling_...`). By subtraction
   (`gil_held_us_per_image` = rest - the read's GIL-free CPU) it runs low: it misses the
   hand-off waits and measures the read at another size; it is kept for comparison.
5. ceiling: step 2's emulation with the real D and R, at 1, 2, 4, ... 32 threads: a host
   with unlimited cores. The best img/s is one process's measured ceiling
   (`process_ceiling_img_s`), using `ceiling_cores_used` cores (its img/s x CPU per
   image); `ceiling_bound_by` is "cores" when that is at least 0.8 x this machine's usable
   cores (the curve levels off because the machine is full, not because of the GIL), else
   "gil". `ceiling_gil_busy` (its img/s x GIL-held time) is the share of the time a thread
   held the GIL. The hand-off per extra thread fitted to the curve is `handoff_per_thread`
   (with the GIL time it implies, `gil_fitted_us_per_image`).
   `process_ceiling_gil_img_s` = 1e6 / gil is what one process reaches where cores do not
   bind.
6. py-spy (the second method, when py-spy is installed or given by --py-spy): `py-spy
   record --gil` samples step 5's best run; the share of samples holding the GIL x wall
   time per image is `gil_pyspy_us_per_image`.
7. workers: Grain worker processes with the hand-off (`pipeline.stages.handoff`), decode emulated
   by ~0 waits so that batches cross as fast as the workers make them, at each
   `--host-batch`: the main process's CPU per image, every thread of it, touching every
   page as device_put would (user: receiving, holding the GIL; system: the kernel), and
   the workers' CPU per image beyond the same run without workers (the hand-off's cost in
   the worker, `send_us_per_image`), the first batch and each worker's RSS.
8. storage (`--latency-ms`, default 20; needs the rig, `bench/rig.py`): step 5's best run
   again with the shards behind a FUSE layer answering each read after the latency, never
   from the page cache, and behind it at 0 ms: the share of the rig-at-0-ms rate it keeps
   (latency alone: the rig's FUSE CPU runs on this machine's cores too), the share of the
   local ceiling, reads per image, KB per read, most reads in flight.
9. hosts: for each core count (vCPUs: `--threads-per-core` hardware threads per core, the
   second worth `--smt-yield` of a core) and per-process batch size (with the main
   process's CPU measured at that batch in step 7), `parallelism.plan` and
   `parallelism.project` with these costs and the training step's own host work per step
   (`--step-us`, stated), memory assumed 1 GiB per vCPU (TPU VM hosts have more). With
   step 8: the rate on that storage (times the share of the rig-at-0-ms rate kept, at most
   1: the latency's cost alone; the CPU of the host's storage client, gcsfuse or
   array_record's GCS client, is not in the model), the reads in flight it needs
   (`pipeline.stages.read.reads_in_flight`, Little's law with headroom), their memory, GET/s.
   The block order (`pipeline.order.blocks`) the same way, its worker processes sharing each
   block's read (`pipeline.storage.blockstore`): the CPU per image plus the store's (step 3, alone:
   a block of the dataset's records written to shared memory, shared by its records, and
   one record's pread; their Python and syscalls, measured with 1-byte records, counted as
   GIL-held too), the images per storage request (a block's records: 2 MiB or more), one
   read of each block per host, and the two windows of blocks the host holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import shutil
import sys
import time

import numpy as np

from bench import costs as costs_lib
from bench import emulate, gil, measure
from pipeline.catalog import manifest as manifest_lib
from pipeline.host import parallelism
from pipeline.image import augment
from pipeline.order import blocks as blocks_lib
from pipeline.stages import read as read_lib
from pipeline.storage import blockstore

PAGE = 4096
CORES_BOUND = 0.8  # share of the usable cores above which the ceiling is the machine's
WARM_BATCHES = 12  # per worker before the clock starts: its imports, its ring grown
STEP_US = 1000.0  # stated: a jitted step's dispatch + metrics on the host, per step


# ---------------------------------------------------------------- one process's runs


def method() -> str:
  """The method, as the module docstring numbers it (for the report)."""
  return __doc__[__doc__.index("1. cpu") :].strip()


def run_one(spec: dict, threads: int, workers: int) -> dict:
  """Times one `make_dataset` configuration in this process (see the module docstring)."""
  ds = emulate.make_dataset(
    spec["data_dir"],
    spec["split"],
    batch_size=spec["batch_size"],
    image_size=spec["image_size"],
    shard_index=0,
    shard_count=1,
    # No record cache: behind the rig (step 8) it would hide the storage after an epoch.
    performance=dict(num_threads=threads, num_workers=workers, record_cache_mb=0.0),
    emulate_us=spec.get("emulate_us"),
  )
  start = time.perf_counter()
  it = iter(ds)
  next(it)
  first_batch = time.perf_counter() - start
  warm = WARM_BATCHES * workers  # every worker started, its ring of blocks grown: off the clock
  for _ in range(warm):
    next(it)["image"].reshape(-1)[::PAGE].max()  # each block's pages mapped once, as below
  spy = gil.PySpy(spec["py_spy"], spec["seconds"]) if spec.get("py_spy") else None
  shim = gil.Counter() if spec.get("gil") else None
  first = time.perf_counter()
  kids = measure.workers()
  main0, kids0 = resource.getrusage(resource.RUSAGE_SELF), measure.cpu_s(kids)
  images = batches = 0
  touch = np.zeros(2)  # user, system seconds
  while (spy.running() if spy else time.perf_counter() - first < spec["seconds"]) or batches < spec[
    "min_batches"
  ]:
    image = next(it)["image"]
    t0 = resource.getrusage(resource.RUSAGE_THREAD)
    image.reshape(-1)[::PAGE].max()  # one byte per page: maps the batch, as a device_put would
    t1 = resource.getrusage(resource.RUSAGE_THREAD)
    touch += (t1.ru_utime - t0.ru_utime, t1.ru_stime - t0.ru_stime)
    images += len(image)
    batches += 1
  end = time.perf_counter()
  held = shim.read().held_s if shim else None
  main1, kids1 = resource.getrusage(resource.RUSAGE_SELF), measure.cpu_s(kids)
  rss = [k.memory_info().rss / 2**20 for k in kids]
  it.close()
  gil_share = _py_spy_share(spy) if spy else None
  user = max(main1.ru_utime - main0.ru_utime - touch[0], 0.0)
  system = max(main1.ru_stime - main0.ru_stime - touch[1], 0.0)
  return {
    "threads": threads,
    "workers": workers,
    "img_s": round(images / (end - first), 1),
    "first_batch_s": round(first_batch, 3),
    "cpu_us": round((user + system + touch.sum()) / images * 1e6, 2),
    "user_us": round(user / images * 1e6, 2),
    "system_us": round((system + touch.sum()) / images * 1e6, 2),
    "workers_cpu_us": round((kids1 - kids0) / images * 1e6, 2),
    "rss_mb_per_worker": round(float(np.mean(rss)), 1) if rss else 0.0,
    "gil_share_pyspy": gil_share,
    "gil_us": round(held / images * 1e6, 2) if held is not None else None,
    "images_served": images + len(image) * (1 + warm),
  }


def _py_spy_share(spy: gil.PySpy) -> float | None:
  """The share of py-spy's sampling ticks that found a thread holding the GIL; None (with
  a warning) when py-spy failed."""
  try:
    return round(spy.share(spy.stacks()), 4)
  except RuntimeError as e:
    print(f"warning: {e}", file=sys.stderr)
    return None


def read_costs(spec: dict, seed: int = 0, kept: int = 1024) -> dict:
  """Step 3, in this process: CPU per record of `ShardedSource.read` in batches of the
  run's batch size at shuffled indices, and of a memcpy of each record into fresh bytes
  (timed over up to `kept` of the records read)."""
  source = costs_lib.open_split(spec["data_dir"], spec["split"])[1]
  order = np.random.default_rng(seed).permutation(len(source))
  size = spec["batch_size"]
  batches = [order[i : i + size] for i in range(0, len(order), size)]
  source.read(batches[0])  # opens the shards: off the clock
  read = count = 0
  records: list[bytes] = []
  start, cpu0 = time.perf_counter(), time.process_time()
  while time.perf_counter() - start < spec["seconds"] or read < spec["min_batches"]:
    got = source.read(batches[read % len(batches)])
    records += got[: kept - len(records)]
    count += len(got)
    read += 1
  read_cpu = time.process_time() - cpu0
  copies, cpu0 = 0, time.process_time()
  while time.process_time() - cpu0 < min(spec["seconds"], 0.5) or not copies:
    for rec in records:
      bytes(memoryview(rec))
    copies += len(records)
  copy_cpu = time.process_time() - cpu0
  source.close()
  return {
    "read_cpu_us": read_cpu / count * 1e6,
    "copy_us": copy_cpu / copies * 1e6,
    "record_kb": float(np.mean([len(r) for r in records])) / 1024,
    **store_costs(records),
  }


def store_costs(records: list[bytes], blocks: int = 16) -> dict:
  """The block order's shared blocks (`pipeline.storage.blockstore`), per image: CPU of writing
  `blocks` blocks of these records (as many as a block holds by default) into shared memory,
  spread over their records, and of each record's pread from there (`store_us`); the same
  with 1-byte records: the Python and syscalls only (`store_gil_us`, an upper bound of the
  GIL-held part). `block_records`: the records a block holds."""
  k = blocks_lib.block_records(float(np.mean([len(r) for r in records])))
  out = {"block_records": k}
  for key, recs in (("store_us", records), ("store_gil_us", [b"x"] * len(records))):
    store = blockstore.BlockStore.new(2**62)
    made = [[recs[(b * k + i) % len(recs)] for i in range(k)] for b in range(blocks)]
    try:
      cpu0 = time.process_time()
      for b in range(blocks):
        store.take((0, b), [0], lambda block=made[b]: block)
      for i in range(1, k):
        for b in range(blocks):
          store.take((0, b), [i], None)
      out[key] = (time.process_time() - cpu0) / (blocks * k) * 1e6
    finally:
      blockstore.remove(store.token)
  return out


def measure_in_child(
  spec: dict, runs: list[tuple[int, int]], emulate_us: tuple[float, float] | None
) -> list[dict]:
  """`run_one` for each (threads, workers) in a fresh process; `emulate_us` (decode and
  resize waits; None: real work) goes to its decode stage (`bench.emulate`)."""
  if emulate_us is not None:
    emulate_us = [max(us, 0.001) for us in emulate_us]
  return _child({**spec, "runs": runs, "emulate_us": emulate_us})


def _child(child_spec: dict):
  """The JSON a fresh `python -m bench.scaling --child SPEC` prints (see `main`)."""
  env = gil.preload_env() if child_spec.get("gil") else None
  return measure.child("bench.scaling", child_spec, env)


# ---------------------------------------------------------------- the model's costs


def fit_gil(curve: list[dict], most: float = float("inf")) -> tuple[float, float]:
  """(GIL us per image, hand-off per extra thread) whose model best matches the emulated
  img/s at each thread count: rate(T) = min(T * r, 1e6 / (gil * (1 + handoff (T - 1)))),
  r the best rate per thread seen.

  A least-squares fit of log rates over a grid, the GIL time at most `most` (the CPU per
  image outside decode); among equally good fits the largest GIL time (a curve that never
  levels off only bounds it from above).
  """
  threads = np.array([r["threads"] for r in curve], float)
  rates = np.array([r["img_s"] for r in curve], float)
  per_thread = (rates / threads).max()
  top = min(1e6 / rates.max(), most)
  gil = np.geomspace(top, top / 8, 400)[:, None, None]
  handoff = np.linspace(0.0, 0.3, 301)[None, :, None]
  model = np.minimum(threads * per_thread, 1e6 / (gil * (1 + handoff * (threads - 1))))
  err = (np.log(model / rates) ** 2).sum(axis=2)
  good = np.argwhere(err <= err.min() * (1 + 1e-6) + 1e-12)
  i, j = min(good, key=lambda ij: (ij[0], ij[1]))  # largest GIL time, then least hand-off
  return float(gil[i, 0, 0]), float(handoff[0, j, 0])


def resize_share(spec: dict, sample: int = 64) -> float:
  """Resize's share of decode + resize per image, each timed alone on one thread
  (`bench.costs`; the loader's native path does the same work)."""
  head = augment.Head(image_size=spec["image_size"])
  c = costs_lib.stage_costs(spec["data_dir"], spec["split"], head, spec["batch_size"], sample)[0]
  return c["augment"].cpu_ms / max(c["decode"].cpu_ms + c["augment"].cpu_ms, 1e-9)


def gil_terms(rest_cpu: float, read_cpu: float, copy: float) -> dict:
  """Step 4: the measured GIL-held time per image from the rest's CPU and the read's."""
  read_free = max(read_cpu - copy, 0.0)
  return {
    "rest_cpu_us_per_image": round(rest_cpu, 1),
    "read_cpu_us_per_image": round(read_cpu, 1),
    "read_copy_us_per_image": round(copy, 2),
    "read_gil_free_us_per_image": round(read_free, 1),
    "gil_held_us_per_image": round(max(rest_cpu - read_free, 0.0), 1),
  }


def ceiling_bound(best: dict, cores: int) -> tuple[float, str]:
  """(cores the best emulated run used, what bound it: "cores" or "gil")."""
  used = best["img_s"] * best["cpu_us"] / 1e6
  return round(used, 2), "cores" if used >= CORES_BOUND * cores else "gil"


def _median(runs: list[dict], key: str) -> float:
  return float(np.median([r[key] for r in runs]))


def spread(values: list[float]) -> dict:
  """Median, min and max of repeated measurements, and the half-range as a share of the
  median (how far apart the repeats were)."""
  med = float(np.median(values))
  return {
    "median": round(med, 2),
    "min": round(min(values), 2),
    "max": round(max(values), 2),
    "spread": round((max(values) - min(values)) / 2 / med, 3) if med else 0.0,
  }


def measure_costs(
  spec: dict,
  threads: list[int],
  workers: int,
  worker_threads: int,
  py_spy: str | None = None,
  latency_ms: float = 0.0,
  repeat: int = 3,
  host_batches: list[int] | None = None,
) -> dict:
  """Steps 1-8 of the module docstring: the figures and the model's costs. Every cost the
  projection uses is the median of `repeat` runs, interleaved, with its spread."""
  host_batches = host_batches or [spec["batch_size"]]
  runs: dict[str, list] = {k: [] for k in ("real", "rest", "read", "alone", "gil", "gil_ceiling")}
  runs.update({f"with@{b}": [] for b in host_batches})
  for _ in range(repeat):
    runs["real"].append(measure_in_child(spec, [(1, 0)], None)[0])
    runs["rest"].append(measure_in_child(spec, [(1, 0)], (0.0, 0.0))[0])
    runs["read"].append(_child({**spec, "read": True}))
    # Step 7 at full speed: decode emulated by ~0 waits, so the hand-off carries the most.
    runs["alone"].append(measure_in_child(spec, [(worker_threads, 0)], (0.0, 0.0))[0])
    for b in host_batches:
      at = {**spec, "batch_size": b}
      runs[f"with@{b}"].append(measure_in_child(at, [(worker_threads, workers)], (0.0, 0.0))[0])
  cpu, rest_cpu = _median(runs["real"], "cpu_us"), _median(runs["rest"], "cpu_us")
  free = max(cpu - rest_cpu, 0.0)
  honoured = rest_cpu < 0.8 * cpu  # decode and resize are most of an image's CPU
  if not honoured:
    print(
      f"warning: the decode emulation was ignored (CPU per image {rest_cpu:.0f} us with it, "
      f"{cpu:.0f} us without): the curve below is the real decode's, bound by this "
      "machine's cores, not the GIL",
      file=sys.stderr,
    )
  terms = gil_terms(
    rest_cpu, _median(runs["read"], "read_cpu_us"), _median(runs["read"], "copy_us")
  )
  share = resize_share(spec)
  waits = (free * (1 - share), free * share)
  measured = measure_in_child(spec, [(t, 0) for t in threads], waits)
  fitted, handoff = fit_gil(measured, min(r["cpu_us"] for r in measured))
  best = max(measured, key=lambda r: r["img_s"])
  for _ in range(repeat):  # step 4, directly: real decode as in a worker, and the ceiling
    runs["gil"].append(measure_in_child({**spec, "gil": True}, [(worker_threads, 0)], None)[0])
    runs["gil_ceiling"].append(
      measure_in_child({**spec, "gil": True}, [(best["threads"], 0)], waits)[0]
    )
  direct = [r["gil_us"] for r in runs["gil"] if r.get("gil_us") is not None]
  at_ceiling = [r["gil_us"] for r in runs["gil_ceiling"] if r.get("gil_us") is not None]
  gil = float(np.median(direct)) if direct else terms["gil_held_us_per_image"]
  usable = parallelism.available_cores()
  used, bound_by = ceiling_bound(best, usable)
  spied = None
  if py_spy:
    spy_run = measure_in_child({**spec, "py_spy": py_spy}, [(best["threads"], 0)], waits)[0]
    if spy_run["gil_share_pyspy"] is not None:
      spied = round(spy_run["gil_share_pyspy"] * 1e6 / spy_run["img_s"], 1)
  storage = at_latency(spec, best, waits, latency_ms) if latency_ms else None
  base = f"with@{spec['batch_size']}" if spec["batch_size"] in host_batches else None
  with_workers = runs[base or f"with@{host_batches[0]}"]
  send = [max(w["workers_cpu_us"] - a["cpu_us"], 0.0) for w, a in zip(with_workers, runs["alone"])]
  costs = parallelism.Costs(
    cpu_us=cpu,
    gil_us=max(gil, 1.0),
    handoff=handoff,
    send_us=float(np.median(send)),
    receive_us=_median(with_workers, "user_us"),
    receive_free_us=_median(with_workers, "system_us"),
    worker_mb=_median(with_workers, "rss_mb_per_worker"),
  )
  main = {
    b: spread([r["user_us"] + r["system_us"] for r in runs[f"with@{b}"]]) for b in host_batches
  }
  return {
    "process_ceiling_img_s": best["img_s"],
    "process_ceiling_threads": best["threads"],
    "ceiling_cores_used": used,
    "usable_cores": usable,
    "ceiling_bound_by": bound_by,
    "ceiling_gil_busy": round(best["img_s"] * gil / 1e6, 2),
    "process_ceiling_gil_img_s": round(1e6 / gil) if gil > 0 else None,
    **terms,
    "gil_direct_us_per_image": round(gil, 1) if direct else None,
    "gil_direct_ceiling_us_per_image": round(float(np.median(at_ceiling)), 1)
    if at_ceiling
    else None,
    "gil_fitted_us_per_image": round(fitted, 1),
    "gil_pyspy_us_per_image": spied,
    "handoff_per_thread": round(handoff, 4),
    "cpu_us_per_image": round(cpu, 1),
    "decode_us_per_image": round(free, 1),
    "resize_share": round(share, 3),
    "record_kb": round(_median(runs["read"], "record_kb"), 1),
    "store": {
      "us_per_image": round(_median(runs["read"], "store_us"), 1),
      "gil_us_per_image": round(_median(runs["read"], "store_gil_us"), 1),
      "block_records": int(_median(runs["read"], "block_records")),
    },
    "emulation_honoured": honoured,
    "one_thread_img_s": _median(runs["real"], "img_s"),
    "first_batch_s": _median(runs["real"], "first_batch_s"),
    "threads": measured,
    "storage": storage,
    "repeat": repeat,
    "spreads": {
      "cpu_us": spread([r["cpu_us"] for r in runs["real"]]),
      "rest_cpu_us": spread([r["cpu_us"] for r in runs["rest"]]),
      "gil_direct_us": spread(direct) if direct else None,
      "gil_direct_ceiling_us": spread(at_ceiling) if at_ceiling else None,
      "send_us": spread(send),
      **{f"main_us@{b}": v for b, v in main.items()},
    },
    "workers": {
      "workers": workers,
      "threads": worker_threads,
      "first_batch_s": _median(with_workers, "first_batch_s"),
      "first_batch_s_without": _median(runs["alone"], "first_batch_s"),
      "send_us_per_image": round(costs.send_us, 1),
      "receive_us_per_image": round(costs.receive_us, 1),
      "receive_free_us_per_image": round(costs.receive_free_us, 1),
      "main_us_per_image": {str(b): v["median"] for b, v in main.items()},
      "receive_at": {
        str(b): [_median(runs[f"with@{b}"], "user_us"), _median(runs[f"with@{b}"], "system_us")]
        for b in host_batches
      },
      "rss_mb_per_worker": costs.worker_mb,
    },
    "costs": dataclasses.asdict(costs),
  }


def at_latency(spec: dict, best: dict, waits: tuple, latency_ms: float) -> dict:
  """Step 8: the ceiling's best run again, its shards behind the storage rig (`bench.rig`:
  `latency_ms` per read request, no page cache), and behind the rig at 0 ms: the rig's own
  CPU (FUSE) shares this machine's cores, so latency alone is the ratio of the two."""
  from bench import rig

  runs = {}
  for ms in (0.0, latency_ms):
    with rig.mount(spec["data_dir"], ms) as m:
      runs[ms] = measure_in_child({**spec, "data_dir": str(m.path)}, [(best["threads"], 0)], waits)
      st = m.stats()
  run = runs[latency_ms][0]
  return {
    "latency_ms": latency_ms,
    "img_s": run["img_s"],
    "of_local_ceiling": round(run["img_s"] / best["img_s"], 3),
    "rig_0ms_img_s": runs[0.0][0]["img_s"],
    "of_rig_0ms": round(run["img_s"] / runs[0.0][0]["img_s"], 3),
    "first_batch_s": run["first_batch_s"],
    "reads_per_image": round(st["reads"] / run["images_served"], 3),
    "kb_per_read": round(st["bytes"] / max(1, st["reads"]) / 1e3, 1),
    "max_reads_in_flight": st["max_in_flight"],
  }


def storage_needs(rate: float, storage: dict, record_kb: float) -> dict:
  """What a host reading `rate` img/s from storage of that latency keeps in flight, holds,
  and asks of the bucket (Little's law with the read stage's headroom)."""
  in_flight = read_lib.reads_in_flight(rate, storage["latency_ms"] / 1e3)
  return {
    "reads_in_flight": in_flight,
    "read_ahead_mb": round(in_flight * record_kb / 1e3, 1),
    "gets_per_s": round(rate * storage["reads_per_image"]),
  }


def hosts(
  costs: parallelism.Costs,
  cores: list[int],
  batch: int,
  host_batches: list[int],
  image_size: int,
  storage: dict | None = None,
  record_kb: float = 0.0,
  receive_at: dict | None = None,
  store: dict | None = None,
) -> list[dict]:
  """The auto plan and its projected img/s for each core count (vCPUs, counted as
  `costs.threads_per_core` hardware threads per core) and per-process batch size; beside
  it, one process at its best thread count (the most a single process can do). The main
  process's CPU per image is the one measured at that batch size (`receive_at`: {batch:
  (user, system)}), else `receive_us` measured at `batch` spread over the host's batch.
  With `storage` (step 8), the rate on that storage: the projection times the share of its
  ceiling a process kept there (at most 1), and what it needs of the storage. With `store`
  (the block order's costs, `store_costs`), the block order's plan and rate beside it."""
  out = []
  for host_batch in host_batches:
    measured = (receive_at or {}).get(str(host_batch))
    if measured:
      host = dataclasses.replace(costs, receive_us=measured[0], receive_free_us=measured[1])
    else:
      host = parallelism.at_batch(costs, host_batch, batch)
    for c in cores:
      chosen = parallelism.plan(
        c,
        batch_size=host_batch,
        image_bytes=image_size**2 * 3,
        costs=host,
        costs_batch=host_batch,
        memory_bytes=c * 2**30,
      )
      one = max(parallelism.project(c, host, parallelism.Plan(0, t)) for t in range(1, c + 1))
      out.append(
        {
          "cores": c,
          "batch": host_batch,
          "workers": chosen.workers,
          "threads": chosen.threads,
          "projected_img_s": round(parallelism.project(c, host, chosen, host_batch)),
          "bound_by": parallelism.bound(c, host, chosen, host_batch),
          "one_process_img_s": round(one),
        }
      )
      if store:
        out[-1]["blocks"] = block_order(c, host, host_batch, image_size, record_kb, store)
      if storage:
        # the needs of the rate as published, so the figures agree with each other exactly
        rate = round(out[-1]["projected_img_s"] * min(1.0, storage["of_rig_0ms"]))
        out[-1]["at_latency_img_s"] = rate
        out[-1].update(storage_needs(rate, storage, record_kb))
  return out


def block_order(
  cores: int, costs: parallelism.Costs, batch: int, image_size: int, record_kb: float, store: dict
) -> dict:
  """The block order on a host of `cores`: its plan and rate with the store's costs added
  (workers share each block's read, so any worker count reads each block once per host),
  images per storage request, and the bytes of the two windows of blocks the host holds."""
  costs = dataclasses.replace(
    costs,
    cpu_us=costs.cpu_us + store["us_per_image"],
    gil_us=costs.gil_us + store["gil_us_per_image"],
  )
  chosen = parallelism.plan(
    cores,
    batch_size=batch,
    image_bytes=image_size**2 * 3,
    costs=costs,
    costs_batch=batch,
    memory_bytes=cores * 2**30,
  )
  k = store["block_records"]
  window_mb = blocks_lib.WINDOW_BATCHES * batch * k * record_kb * 1024 / 2**20
  return {
    "workers": chosen.workers,
    "threads": chosen.threads,
    "projected_img_s": round(parallelism.project(cores, costs, chosen, batch)),
    "bound_by": parallelism.bound(cores, costs, chosen, batch),
    "images_per_request": k,
    "reads_per_block_per_host": 1,
    "blocks_held_mb": round(2 * window_mb),
  }


def table(result: dict) -> str:
  w = result["workers"]
  spied = result["gil_pyspy_us_per_image"]
  sp = result["spreads"]
  direct = result["gil_direct_us_per_image"]
  gil_line = (
    (
      f"GIL-held per image, measured directly (shim), real decode on "
      f"{result['workers']['threads']} threads: **{direct:.0f} us** "
      f"({_range(sp['gil_direct_us'])}), at the emulated ceiling below "
      f"{result['gil_direct_ceiling_us_per_image']:.0f} us"
      if direct is not None
      else "GIL-held per image: the shim could not run (bench.gil)"
    )
    + (f" (py-spy --gil there, the second method: {spied:.0f} us)" if spied is not None else "")
    + f"; by subtraction (runs low): {result['gil_held_us_per_image']:.0f} us = the rest "
    f"{result['rest_cpu_us_per_image']:.0f} us - the read's GIL-free CPU "
    f"{result['read_gil_free_us_per_image']:.0f} us. Fitted to the curve below: "
    f"{result['gil_fitted_us_per_image']:.0f} us, +{result['handoff_per_thread']:.1%} per "
    "extra thread."
  )
  lines = [
    f"Per image: {result['cpu_us_per_image']:.0f} us of CPU ({_range(sp['cpu_us'])}), of "
    "which decode and resize "
    f"{result['decode_us_per_image']:.0f} us (GIL released; resize "
    f"{result['resize_share']:.0%} of it) and the rest "
    f"{result['rest_cpu_us_per_image']:.0f} us.",
    "",
    gil_line,
    "",
    "| decode threads (emulated decode) | img/s | CPU us per image |",
    "|---:|---:|---:|",
  ]
  lines += [f"| {r['threads']} | {r['img_s']:.0f} | {r['cpu_us']:.0f} |" for r in result["threads"]]
  lines += [
    "",
    f"One process's measured ceiling: **{result['process_ceiling_img_s']:.0f} img/s** at "
    f"{result['process_ceiling_threads']} threads, using {result['ceiling_cores_used']:.2f} "
    f"of {result['usable_cores']} cores: bound by {result['ceiling_bound_by']} (GIL held "
    f"{result['ceiling_gil_busy']:.0%} of the time). "
    f"Projected where cores do not bind (1e6 / GIL-held): {_rate(result)}.",
    "",
    f"With {w['workers']} worker processes "
    f"x {w['threads']} threads: first batch {w['first_batch_s']:.2f} s (no workers: "
    f"{w['first_batch_s_without']:.2f} s), {w['rss_mb_per_worker']:.0f} MB RSS per worker; "
    f"per image, {w['send_us_per_image']:.0f} us more CPU in the worker ({_range(sp['send_us'])};"
    " handing batches over) and, in the main process, every thread: "
    + ", ".join(
      f"**{v:.1f} us** at batch {b} ({_range(sp[f'main_us@{b}'])})"
      for b, v in w["main_us_per_image"].items()
    )
    + f" ({w['receive_us_per_image']:.1f} us user + {w['receive_free_us_per_image']:.1f} us "
    "system at the first). Copies per image: the record none after array_record's read "
    "(parsed in place); the output image written once, resized straight into shared memory.",
    "",
    f"Hosts: vCPUs as {result['costs']['threads_per_core']} hardware threads per core, the "
    f"second worth {result['costs']['smt_yield']:.0%} of a core (stated); the training "
    f"step's host work {result['costs']['step_us']:.0f} us per step (stated, --step-us).",
    "",
    "| host cores | batch per process | workers x threads | projected img/s | bound by | "
    "one process at best |",
    "|---:|---:|---|---:|---|---:|",
  ]
  lines += [
    f"| {h['cores']} | {h['batch']} | {h['workers']} x {h['threads']} | "
    f"{h['projected_img_s']:,} | {h['bound_by']} | {h['one_process_img_s']:,} |"
    for h in result["hosts"]
  ]
  store = result.get("store")
  if store:
    lines += [
      "",
      f"The block order, its workers sharing each block's read in shared memory: "
      f"{store['us_per_image']:.0f} us more CPU per image ({store['gil_us_per_image']:.0f} us of "
      f"it counted as GIL-held), blocks of {store['block_records']} records:",
      "",
      "| host cores | batch per process | workers x threads | projected img/s | bound by | "
      "images per request | reads of a block per host | blocks held MB |",
      "|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    lines += [
      f"| {h['cores']} | {h['batch']} | {b['workers']} x {b['threads']} | "
      f"{b['projected_img_s']:,} | {b['bound_by']} | {b['images_per_request']} | "
      f"{b['reads_per_block_per_host']} | {b['blocks_held_mb']:,} |"
      for h in result["hosts"]
      for b in [h["blocks"]]
    ]
  st = result.get("storage")
  if st:
    lines += [
      "",
      f"Behind the storage rig at {st['latency_ms']:g} ms per read (no page cache), the "
      f"ceiling's run kept **{st['img_s']:.0f} img/s = {st['of_rig_0ms']:.0%}** of its rate "
      f"behind the rig at 0 ms ({st['rig_0ms_img_s']:.0f}; the rig's FUSE work shares these "
      f"cores) and {st['of_local_ceiling']:.0%} of its local rate (first batch "
      f"{st['first_batch_s']:.2f} s; {st['reads_per_image']:.2f} "
      f"reads per image of {st['kb_per_read']:.0f} KB, at most {st['max_reads_in_flight']} "
      "in flight). On such storage a host needs:",
      "",
      f"| host cores | batch per process | img/s at {st['latency_ms']:g} ms | reads in flight "
      "| read-ahead MB | GET/s |",
      "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
      f"| {h['cores']} | {h['batch']} | {h['at_latency_img_s']:,} | {h['reads_in_flight']:,} "
      f"| {h['read_ahead_mb']:,} | {h['gets_per_s']:,} |"
      for h in result["hosts"]
    ]
  return "\n".join(lines)


def _latency(latency_ms: float) -> float:
  """The rig's latency for step 8, or 0 (skipped, with the reason) where it cannot run."""
  if latency_ms <= 0:
    return 0.0
  from bench import rig

  try:
    rig.ensure_built()
  except rig.RigUnavailable as e:
    print(f"warning: step 8 (storage) skipped: {e}", file=sys.stderr)
    return 0.0
  return latency_ms


def _range(s: dict | None) -> str:
  if not s:
    return "not measured"
  return f"{s['min']:.0f}-{s['max']:.0f} over the repeats, +-{s['spread']:.0%}"


def _rate(result: dict) -> str:
  rate = result["process_ceiling_gil_img_s"]
  return f"{rate:,} img/s" if rate else "no GIL limit measured"


def _fail(message: str, code: int = 2):
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def parser() -> argparse.ArgumentParser:
  p = measure.parser(
    "scaling", __doc__, "split", "batch_size", "image_size", "seconds", "json", data_dir=None
  )
  p.add_argument("data_dir", nargs="?", help=measure.DATA_DIR)
  p.add_argument(
    "--threads",
    type=measure.numbers(),
    default="1,2,4,8,16,32",
    help="thread counts of the ceiling",
  )
  p.add_argument("--workers", type=int, default=2, help="worker processes of step 4")
  p.add_argument("--worker-threads", type=int, default=2, help="their decode threads")
  p.add_argument(
    "--cores",
    type=measure.numbers(),
    default="2,8,24,96,112,224",
    help="host core counts to project (TPU v5e VMs: 24, 112, 224)",
  )
  p.add_argument(
    "--host-batch",
    type=measure.numbers(),
    help="per-process batch sizes to project, e.g. 128,1024 (default: "
    "--batch-size); the main process's Python per batch spreads over it",
  )
  p.add_argument(
    "--py-spy",
    default=shutil.which("py-spy") or shutil.which("py-spy", path=gil.BIN),
    help="py-spy for step 6's cross-check (default: on PATH or beside python; '' skips it)",
  )
  p.add_argument(
    "--latency-ms",
    type=float,
    default=20.0,
    help="step 8: the ceiling again behind the storage rig at this latency per read "
    "(default 20, a bucket; 0 skips it)",
  )
  p.add_argument(
    "--repeat", type=int, default=3, help="runs of each cost measurement (medians are used)"
  )
  p.add_argument(
    "--threads-per-core",
    type=int,
    default=2,
    help="hardware threads per core of the projected hosts (cloud vCPUs are hyperthreads: 2)",
  )
  p.add_argument(
    "--smt-yield",
    type=float,
    default=parallelism.SMT_YIELD,
    help="what a core's second hardware thread adds, in cores (stated, default %(default)s)",
  )
  p.add_argument(
    "--step-us",
    type=float,
    default=STEP_US,
    help="the training step's host work per step in the main process (dispatch, metrics), "
    "microseconds: a run's summary.json `host_us_per_step` (`python -m train` measures it); "
    "0 projects the loader alone (default %(default)s)",
  )
  p.add_argument("--child", help=argparse.SUPPRESS)
  return p


def main(argv: list[str]) -> dict:
  p = parser()
  args = p.parse_args(argv)
  if args.child:
    spec = json.loads(args.child)
    if spec.get("read"):
      print(json.dumps(read_costs(spec)))
    else:
      print(json.dumps([run_one(spec, t, w) for t, w in spec["runs"]]))
    return {}
  if not args.data_dir:
    p.error("give DATA_DIR, a converted dataset")
  host_batches = args.host_batch or [args.batch_size]
  if (
    min(args.workers, args.worker_threads, args.batch_size, args.repeat, args.threads_per_core) < 1
    or args.seconds <= 0
  ):
    p.error(
      "--workers, --worker-threads, --batch-size, --repeat, --threads-per-core and --seconds "
      "must be positive"
    )
  try:
    meta = manifest_lib.load(args.data_dir)
  except (OSError, ValueError) as e:
    _fail(str(e))
  if args.split not in meta.splits:
    _fail(f"{args.data_dir} has no split {args.split!r} (has: {sorted(meta.splits)})")
  spec = {
    "data_dir": args.data_dir,
    "split": args.split,
    "batch_size": args.batch_size,
    "image_size": args.image_size,
    "seconds": args.seconds,
    "min_batches": 3,
  }
  try:
    result = measure_costs(
      spec,
      args.threads,
      args.workers,
      args.worker_threads,
      args.py_spy,
      _latency(args.latency_ms),
      repeat=args.repeat,
      host_batches=host_batches,
    )
  except RuntimeError as e:
    _fail(str(e), code=1)
  result["costs"].update(
    threads_per_core=args.threads_per_core, smt_yield=args.smt_yield, step_us=args.step_us
  )
  costs = parallelism.Costs(**result["costs"])
  result["hosts"] = hosts(
    costs,
    args.cores,
    args.batch_size,
    host_batches,
    args.image_size,
    result["storage"],
    result["record_kb"],
    result["workers"]["receive_at"],
    result["store"],
  )
  measure.finish(p, args, argv, result)
  print(table(result))
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
