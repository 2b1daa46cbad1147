"""The block order on any number of worker processes (`pipeline.storage.blockstore`): a
host's workers share each block's read through shared memory, so a block is read once per
host whatever the worker count, and the batches are those of one process."""

from __future__ import annotations

import concurrent.futures
import glob
import math

import numpy as np
import pytest

import pipeline
from pipeline import dataset
from pipeline.catalog import manifest
from pipeline.host import parallelism
from pipeline.order.blocks import Blocks
from pipeline.order.sampling import Sampler
from pipeline.storage import blockstore
from pipeline.storage.blockstore import BlockStore
from pipeline.storage.ranges import BlockReads
from pipeline.storage.source import ShardedSource
from tests.conftest import assert_same_batches


def files(store: BlockStore) -> list[str]:
  return glob.glob(f"{blockstore.SHM_DIR}/{blockstore.PREFIX}-{store.token}-*")


def test_threads_of_many_stores_read_each_block_once_and_get_its_records(digits_dir):
  meta = manifest.load(digits_dir)
  shards = meta.splits["train"].shards
  counts = [s.num_records for s in shards]
  source = ShardedSource([digits_dir / s.file for s in shards], counts)
  calls = []
  store = BlockStore.new(2**30)
  # three "processes": each its own BlockReads and its own unpickled copy of the store
  copies = [BlockReads(lambda *a: calls.append(a) or source.read_range(*a), counts, 16, 0, store)]
  copies += [
    BlockReads(lambda *a: calls.append(a) or source.read_range(*a), counts, 16, 0, s)
    for s in (BlockStore(store.token, 2**30), BlockStore(store.token, 2**30))
  ]
  wanted = [(shard, i) for shard, c in enumerate(counts) for i in range(c)]
  with concurrent.futures.ThreadPoolExecutor(12) as pool:
    got = list(
      pool.map(lambda k: copies[k % 3].read(*wanted[k][:1], [wanted[k][1]])[0], range(len(wanted)))
    )
  assert got == [source.read_shard(shard, [i])[0] for shard, i in wanted]
  assert sorted(calls) == sorted(set(calls))  # each block once
  assert len(calls) == sum(-(-c // 16) for c in counts)
  assert sum(r.store.published for r in copies) == len(calls)
  for r in copies:
    r.store.close()
  assert files(store) == []
  blockstore.remove(store.token)


def test_a_store_keeps_its_budget_and_a_block_gone_is_read_again():
  store = BlockStore.new(3000)
  read = lambda k: lambda: [bytes([k]) * 1000] * 2  # blocks of 2,000 bytes
  for k in range(3):
    assert store.take((0, k), [1], read(k)) == [bytes([k]) * 1000]
  assert len(files(store)) == 1  # the newest only: 2 blocks would pass 3,000 bytes
  again = []
  assert store.take((0, 0), [0], lambda: again.append(1) or read(0)()) == [bytes(1000)]
  assert again == [1]
  blockstore.remove(store.token)


def test_the_files_of_a_store_whose_main_process_is_gone_are_swept(run_python):
  made = run_python(
    "-c",
    "import os; from pipeline.storage.blockstore import BlockStore\n"
    "s = BlockStore.new(2**20); s.take((0, 0), [0], lambda: [b'x'])\n"
    "print(s.token, flush=True); os._exit(0)",  # no exit handlers: as if killed
  )
  token = made.stdout.split()[-1]
  assert glob.glob(f"{blockstore.SHM_DIR}/{blockstore.PREFIX}-{token}*")
  blockstore.sweep_orphaned()
  assert not glob.glob(f"{blockstore.SHM_DIR}/{blockstore.PREFIX}-{token}*")


def test_three_worker_processes_read_each_block_once_and_serve_the_batches_of_one(
  storage_rig, photos_dir
):
  counts = [s.num_records for s in manifest.load(photos_dir).splits["train"].shards]

  def run(path, workers: int) -> list[dict]:
    perf = dict(num_workers=workers, record_cache_mb=0)
    spec = pipeline.Spec.of(
      path,
      batch_size=8,
      image_size=32,
      order="blocks",
      block_records=4,
      num_epochs=1,
      seed=3,
      shard_index=0,
      shard_count=1,
      performance=perf,
    )
    st = dataset.build(spec)
    assert (st.read.ranges.store is not None) == (workers > 1)
    return list(dataset.chain(st))

  expected = run(photos_dir, 0)
  with storage_rig.mount(photos_dir, latency_ms=1) as m:
    m.reset()
    got = run(str(m.path), 3)
    st = m.stats()
  assert_same_batches(expected, got)
  blocks = sum(math.ceil(c / 4) for c in counts)
  # each block one request (< 1 MiB) once, beside each process's opening of each shard
  # (its footer: 2 reads) and the read stage's probe at open (4 reads)
  assert st["reads"] - 2 * st["opens"] - 4 == blocks


@pytest.mark.parametrize("cores", [96, 224])
def test_on_a_many_core_host_the_block_order_gets_the_workers_of_the_global_order(
  photos_dir, monkeypatch, cores
):
  monkeypatch.setattr(parallelism, "available_cores", lambda: cores)  # as if on that host
  monkeypatch.setattr(parallelism, "available_memory", lambda: 256 << 30)
  built = {}
  for order in ("global", "blocks"):
    spec = pipeline.Spec.of(photos_dir, batch_size=16, order=order, shard_index=0, shard_count=1)
    built[order] = dataset.build(spec)
  blocked = built["blocks"]
  assert blocked.workers == built["global"].workers == 3  # no longer 2 or 4
  ranges = blocked.read.ranges
  assert ranges.block_records == blocked.plan.sampler.blocks.block_records  # blocks whole
  assert ranges.store is not None  # read once for the 3 workers
  blockstore.remove(ranges.store.token)


def test_the_batches_of_a_window_fall_to_workers_that_do_not_divide_it():
  """Why the store: at 3 workers each block of a window goes to every worker."""
  shards = (4096,) * 4
  s = Sampler(sum(shards), seed=3, block=32, blocks=Blocks(shards, 16, 4 * 32))
  records = s.records(np.arange(4 * 16 * 32))[1].reshape(-1, 32)  # the first window
  blocks = records // 16
  owners = {b: {k % 3 for k in range(len(blocks)) if b in blocks[k]} for b in np.unique(blocks)}
  assert all(len(w) == 3 for w in owners.values())


@pytest.mark.parametrize("workers", [3, 8])
def test_workers_keeping_their_share_of_two_windows_read_each_block_once_an_epoch(workers):
  shards, size, batch = (1024,) * 64, 100, 128  # records of 100 bytes, blocks of 32
  s = Sampler(sum(shards), seed=4, block=batch, blocks=Blocks(shards, 32, 4 * batch))
  window_bytes = 4 * batch * 32 * size
  ahead = 4 * batch * size  # performance.read_ahead_mb's bytes: here 4 batches
  calls = []

  def read_range(shard, begin, end):
    calls.append((shard, begin))
    return [bytes(size)] * (end - begin)

  store = BlockStore.new(0)  # each worker's copy: its share of the host's two windows
  mine = [BlockStore(store.token, ahead + 2 * window_bytes // workers) for _ in range(workers)]
  reads = [BlockReads(read_range, list(shards), 32, 0, m) for m in mine]
  try:
    for b in range(sum(shards) // batch):  # Grain gives worker w batches w, w + workers, ...
      shard, local = np.divmod(s.records(np.arange(b * batch, (b + 1) * batch))[1], 1024)
      for k in np.unique(shard).tolist():
        got = reads[b % workers].read(k, local[shard == k].tolist())
        assert got == [bytes(size)] * (shard == k).sum()
    assert len(calls) == len(set(calls)) == sum(shards) // 32  # each block once in the epoch
    assert sum(m.published for m in mine) == len(calls)
  finally:
    blockstore.remove(store.token)


def test_a_dropped_store_takes_its_files_with_it():
  store = BlockStore.new(2**20)
  store.take((0, 0), [0], lambda: [b"x"])
  token = store.token
  assert glob.glob(f"{blockstore.SHM_DIR}/{blockstore.PREFIX}-{token}*")
  del store  # as a dataset dropped after an evaluation
  assert not glob.glob(f"{blockstore.SHM_DIR}/{blockstore.PREFIX}-{token}*")


@pytest.mark.parametrize("workers, shared", [(2, False), (4, False), (3, True), (8, True)])
def test_only_workers_that_split_a_blocks_records_share_it(photos_dir, workers, shared):
  perf = dict(num_workers=workers, num_threads=1)
  spec = pipeline.Spec.of(
    photos_dir, batch_size=8, order="blocks", shard_index=0, shard_count=1, performance=perf
  )
  st = dataset.build(spec)
  assert (st.read.ranges.store is not None) == shared  # 2 or 4: each block one worker's
  assert st.read.ranges.block_records == st.plan.sampler.blocks.block_records  # whole
