"""What each stage of the loader costs per image, one stage at a time on one thread: the one
measurement behind the doctor, `bench scaling` and `bench throughput`'s breakdown.

Their figures feed one model, `pipeline.host.parallelism.Costs`, which the planner uses too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.explain import STAGES, Cost
from pipeline.image import augment, decode
from pipeline.storage.source import ShardedSource

CACHE_SAMPLE = 32  # images that price the decoded-image cache (a full decode each)


def open_split(data_dir: str, split: str) -> tuple[manifest_lib.Manifest, ShardedSource]:
  """The manifest and the split's records, opened as `make_dataset` opens them."""
  meta = manifest_lib.load(data_dir)
  shards = meta.splits[split].shards
  return meta, ShardedSource(meta.shard_paths(data_dir, split), [s.num_records for s in shards])


def _queued_s() -> float:
  """Seconds this thread has waited on a run queue (Linux schedstat; 0 where missing)."""
  try:
    with open("/proc/thread-self/schedstat") as f:
      return int(f.read().split()[1]) / 1e9
  except (OSError, IndexError, ValueError):
    return 0.0


class _Clock:
  """Accumulates wall, CPU and run-queue time of timed blocks (run alone, so the process's
  CPU time is this work's, helper threads included)."""

  def __init__(self):
    self.wall = self.cpu = self.queued = 0.0

  def time(self, fn: Callable, *args):
    w, c, q = time.perf_counter(), time.process_time(), _queued_s()
    out = fn(*args)
    self.wall += time.perf_counter() - w
    self.cpu += time.process_time() - c
    self.queued += _queued_s() - q
    return out

  def cost(self, images: int) -> Cost:
    return Cost(*(round(x / images * 1e3, 4) for x in (self.wall, self.cpu, self.queued)))


def _decode(head: augment.Head, data: bytes, key: int) -> tuple[np.ndarray, int]:
  """Header, crop window, crop-aware decode; returns the window and its DCT scale."""
  box = head.box(*decode.image_size(data), key)
  scale = head.dct_scale(box)
  return decode.decode_crop(data, box, scale, head.fast_dct), scale


def _augment(head: augment.Head, window: np.ndarray, key: int, out: np.ndarray) -> None:
  """Flip (a view) and resize into the batch slot."""
  augment.resize(
    window[:, ::-1] if head.flips(key) else window, head.image_size, out, bicubic=head.bicubic
  )


def stage_costs(
  data_dir: str,
  split: str,
  head: augment.Head,
  batch_size: int,
  sample: int,
  seed: int = 0,
  keys: tuple[str, ...] | None = None,
) -> tuple[dict[str, Cost], dict]:
  """Each stage alone on one thread over `sample` shuffled records of the split, read in
  batches of `batch_size`: read, parse, decode (header, crop window, crop-aware decode),
  augment (flip and resize into the batch). With `head.dct_scaling` off, "decode_dct"
  prices turning it on; "cache_fill" and "augment_cached" price the decoded-image cache.

  Returns the costs and facts: records, shards, decoded-cache bytes per image and the share
  of crops that DCT scaling shrinks.
  """
  meta, source = open_split(data_dir, split)
  n = min(sample, len(source))
  indices = np.random.default_rng(seed).permutation(len(source))[:n].tolist()
  keys = keys or meta.keys
  extra = () if head.dct_scaling else ("decode_dct",)
  clocks = {name: _Clock() for name in (*STAGES, *extra, "cache_fill", "augment_cached")}
  source.read(indices[:1])  # open the shards before the clock
  recs = []
  for k in range(0, n, batch_size):
    recs += clocks["read"].time(source.read, indices[k : k + batch_size])
  head_dct = dataclasses.replace(head, dct_scaling=True)
  out = np.empty((head.image_size, head.image_size, 3), np.uint8)
  side = round(head.image_size / head.crop_fraction)  # the cache's shorter side
  cache_bytes, scaled = [], 0
  for k, (index, rec) in enumerate(zip(indices, recs)):
    key = augment.example_key(seed, 0, index)
    data = clocks["parse"].time(lambda r: records.parse(r, keys)[0], rec)
    window, scale = clocks["decode"].time(_decode, head, data, key)
    clocks["augment"].time(_augment, head, window, key, out)
    if extra:
      scale = clocks["decode_dct"].time(_decode, head_dct, data, key)[1]
    scaled += scale > 1
    if k < CACHE_SAMPLE:  # enough to price the cache without a full decode of every image
      cached = clocks["cache_fill"].time(
        lambda d: augment.resize_shorter(decode.decode(d), side), data
      )
      clocks["augment_cached"].time(head.from_decoded, cached, key, out)
      cache_bytes.append(cached.nbytes)
  source.close()
  costs = {
    name: c.cost(min(n, CACHE_SAMPLE) if name in ("cache_fill", "augment_cached") else n)
    for name, c in clocks.items()
  }
  return costs, {
    "num_records": len(source),
    "num_shards": len(meta.splits[split].shards),
    "cache_bytes_per_image": float(np.mean(cache_bytes)),
    "dct_share": scaled / n,
  }
