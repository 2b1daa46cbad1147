"""The batch pool (pipeline/host/pool.py): a batch's memory goes to a later batch only once
nothing holds the first, its views included; a stream that drops its batches reuses a few."""

from __future__ import annotations

import gc

import numpy as np

import pipeline
from pipeline.host import memory, pool
from pipeline.host.pool import BatchPool


def test_a_buffer_comes_back_only_when_the_batch_and_every_view_of_it_are_gone():
  batches = BatchPool(keep=2)
  batch = batches.empty((4, 8, 8, 3), np.uint8)
  batch[:] = 7
  address = batch.ctypes.data
  row, tail, exported = batch[1], np.asarray(batch)[2:], memoryview(batch)
  del batch
  gc.collect()
  later = batches.empty((4, 8, 8, 3), np.uint8)  # not the held one's memory
  later[:] = 9
  assert later.ctypes.data != address
  assert row.min() == row.max() == 7 and tail.min() == 7 and exported[0, 0, 0, 0] == 7
  del row, tail
  gc.collect()
  other = batches.empty((4, 8, 8, 3), np.uint8)
  assert other.ctypes.data != address  # the memoryview still holds it
  del exported
  gc.collect()
  assert batches.empty((4, 8, 8, 3), np.uint8).ctypes.data == address  # now it is reused


def test_a_held_batch_is_never_overwritten_and_dropped_ones_are_reused(photos_dir):
  ds = pipeline.make_dataset(
    photos_dir, batch_size=32, image_size=64, shard_index=0, shard_count=1,
    performance={"num_workers": 0, "num_threads": 2, "prefetch": 2},
  )  # fmt: skip
  it = iter(ds)
  held = next(it)["image"][3:5]  # a view of the first batch, kept
  want = held.copy()
  addresses = set()
  for _ in range(30):
    addresses.add(next(it)["image"].ctypes.data)  # each dropped at once
  np.testing.assert_array_equal(held, want)
  assert held.ctypes.data - 3 * 64 * 64 * 3 not in addresses
  # batches in flight (prefetch + 2) and the spare ones (pool.SPARE), not one buffer per batch
  assert len(addresses) <= 2 + 2 + pool.SPARE, len(addresses)


def test_only_batches_under_32_mib_wait_spare_and_the_plan_counts_them():
  mib = 2**20
  assert [pool.spare(n * mib) for n in (19, 40, 600)] == [2, 1, 0]  # 600: glibc's way, unmapped
  # the batches one process holds without workers: prefetch + 2, and the spare ones
  assert memory.held_bytes(0, 19 * mib, prefetch=2) == (2 + 2 + 2) * 19 * mib
  assert memory.held_bytes(0, 600 * mib, prefetch=2) == (2 + 2) * 600 * mib
