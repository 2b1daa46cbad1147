"""The block order (`pipeline.order.blocks`): few storage requests per epoch, every record once,
a pure function of (seed, epoch, position), and batches that mix nearly as well as a global
shuffle's on shards in class order (as an ImageNet folder converts)."""

import concurrent.futures
import pathlib
import threading
import time

import numpy as np
import pytest

import pipeline
from pipeline import dataset, planner
from pipeline.catalog import manifest, split
from pipeline.order import blocks
from pipeline.order.blocks import Blocks, label_distance
from pipeline.order.sampling import Sampler, permute
from pipeline.stages import read
from pipeline.storage import backend, blockstore, fetch, remote
from pipeline.storage.budget import RequestBudget
from pipeline.storage.ranges import BlockReads
from pipeline.storage.source import ShardedSource
from tests.conftest import assert_same_batches, take

# a class-ordered split: 20 classes of 400 records, in shards of 700 (the last shorter)
LABELS = np.repeat(np.arange(20), 400)
SHARDS = (700,) * 11 + (len(LABELS) - 7700,)


def sampler(**keywords) -> Sampler:
  keywords.setdefault("blocks", Blocks(SHARDS))
  return Sampler(len(LABELS), seed=5, **keywords)


def test_every_record_once_per_epoch_and_each_epoch_a_new_order():
  s = sampler(num_epochs=3)
  epochs, records = s.records(np.arange(len(s)))
  per_epoch = records.reshape(3, -1)
  for epoch in per_epoch:
    assert sorted(epoch) == list(range(len(LABELS)))
  assert not np.array_equal(per_epoch[0], per_epoch[1])
  assert (epochs == np.repeat(np.arange(3), len(LABELS))).all()


def test_blocks_are_consecutive_records_of_one_shard_read_together_within_a_window():
  shards = (704,) * 5  # whole blocks only: each window is 16 x 32 positions
  order = Blocks(shards, block_records=16, window_blocks=32).permute(np.arange(3520), key=9)
  ends = np.cumsum(shards)
  for start in range(0, len(order), 16 * 32):
    window = order[start : start + 16 * 32]
    shard = np.searchsorted(ends, window, side="right")
    local = window - np.concatenate([[0], ends])[shard]
    runs = set(zip(shard.tolist(), (local // 16).tolist()))
    assert len(runs) == len(window) // 16  # one request per block, 16 images each
  assert sorted(order) == list(range(3520))


def test_the_same_seed_gives_the_same_order_and_a_resume_from_any_position_is_exact():
  s = sampler(num_epochs=2)
  whole = s.records(np.arange(len(s)))[1]
  again = sampler(num_epochs=2).records(np.arange(len(s)))[1]
  assert np.array_equal(whole, again)
  pieces = [s.records(np.arange(a, min(a + 128, len(s))))[1] for a in range(0, len(s), 128)]
  assert np.array_equal(np.concatenate(pieces), whole)
  assert s.record_index(len(s) - 1) == whole[-1]
  other = Sampler(len(LABELS), seed=6, num_epochs=2, blocks=Blocks(SHARDS))
  assert not np.array_equal(other.records(np.arange(len(s)))[1], whole)


def block_of(records: np.ndarray, shards=SHARDS, size=16) -> np.ndarray:
  """The (shard, block) of each record, as one number."""
  ends = np.cumsum(shards)
  shard = np.searchsorted(ends, records, side="right")
  return shard * 10**6 + (records - (ends - shards)[shard]) // size


@pytest.mark.parametrize("hosts", [1, 4])
def test_a_batch_takes_distinct_blocks_and_each_host_reads_only_its_own(hosts):
  shards = (4100,) * 16  # 256 blocks of 16 and one of 4 each
  per_host = [
    Sampler(
      sum(shards),
      seed=3,
      shard_index=p,
      shard_count=hosts,
      block=32,
      blocks=Blocks(shards, 16, 4 * 32 * hosts),
    )
    for p in range(hosts)
  ]
  touched = []
  for s in per_host:
    records = s.records(np.arange(s.per_epoch // 32 * 32))[1]
    in_full_blocks = (records % 4100 < 4096).reshape(-1, 32).all(axis=1)
    for batch in block_of(records, shards).reshape(-1, 32)[in_full_blocks]:
      assert len(set(batch.tolist())) == 32  # one record of each of 32 blocks
    assert in_full_blocks.sum() >= len(in_full_blocks) - 2  # the short blocks: 64 records
    touched.append(set(block_of(records, shards).tolist()))
  # every block read by one host (only a few short ones, at the epoch's end, by two)
  assert sum(map(len, touched)) <= 257 * 16 + (hosts - 1) * 16


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_a_worker_process_takes_one_aligned_run_of_each_of_its_blocks(workers):
  shards = (4100,) * 16
  s = Sampler(sum(shards), seed=3, block=32, blocks=Blocks(shards, 16, 4 * 32))
  piece = blocks.pieces(s.blocks, 32, workers)
  assert piece == (16 if workers <= 4 else 8)
  records = s.records(np.arange(sum(shards) // 32 * 32))[1].reshape(-1, 32)
  for w in range(workers):  # Grain gives worker w batches w, w + workers, ...
    mine = records[w::workers].ravel()
    reads = set(block_of(mine, shards, size=piece).tolist())
    assert len(mine) / len(reads) >= 0.95 * piece  # `piece` records per read, but at the end


def test_processes_share_the_block_order_out_and_owned_shards_keep_their_records():
  parts = [sampler(shard_index=p, shard_count=3, remainder="pad") for p in range(3)]
  seen = np.concatenate([p.records(np.arange(p.per_epoch))[1] for p in parts])
  assert sorted(seen[seen >= 0]) == list(range(len(LABELS)))
  owner = sampler(shard_index=1, shard_count=3, shard_records=SHARDS, remainder="pad")
  got = owner.records(np.arange(owner.per_epoch))[1]
  starts = np.concatenate([[0], np.cumsum(SHARDS)])
  mine = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in (1, 4, 7, 10)])
  assert sorted(got[got >= 0]) == mine.tolist()


def test_a_batch_of_128_mixes_within_1_25x_a_global_shuffles_label_distance():
  positions = np.arange(len(LABELS))  # the first epoch
  shuffled = label_distance(LABELS[permute(positions, len(LABELS), 5 << 32)], 128)
  blocked = label_distance(LABELS[sampler().records(positions)[1]], 128)
  in_order = label_distance(LABELS, 128)
  assert blocked <= 1.25 * shuffled < in_order


def test_sizes_are_checked_and_the_order_defaults_by_where_the_shards_are(tmp_path):
  with pytest.raises(ValueError, match="block_records must be a positive integer, got 0"):
    pipeline.Spec.of("data", batch_size=8, block_records=0)
  with pytest.raises(ValueError, match="order must be 'global', 'blocks' or None, not 'tf'"):
    pipeline.Spec.of("data", batch_size=8, order="tf")
  assert backend.of("gs://bucket/ds").remote and not backend.of(tmp_path).remote
  assert Blocks(SHARDS).window_blocks == blocks.WINDOW_BATCHES * 128


def test_make_dataset_in_block_order_reads_every_record_once_per_epoch(digits_dir):
  spec = pipeline.Spec.of(digits_dir, batch_size=16, order="blocks", num_epochs=1, seed=2)
  meta, source, _ = split.open(spec.data_dir, spec.split)
  s = planner.sampler_of(spec, meta, source)
  shards = meta.splits["train"].shards
  record_bytes = sum(sh.bytes for sh in shards) / meta.splits["train"].num_records
  size = blocks.block_records(record_bytes)  # 2 MiB, or 256 of these 1.6 KB digits
  assert size == blocks.MAX_BLOCK_RECORDS and blocks.block_records(90e3) == 32
  counts = tuple(sh.num_records for sh in shards)
  assert s.blocks == Blocks(counts, size, window_blocks=blocks.WINDOW_BATCHES * 16)
  records = s.records(np.arange(s.per_epoch))[1]
  assert sorted(records) == list(range(meta.splits["train"].num_records))
  default = planner.sampler_of(pipeline.Spec.of(digits_dir, batch_size=16), meta, source)
  assert default.blocks is None  # local disk: the global shuffle


def test_a_state_of_the_global_order_is_refused_by_a_block_ordered_stream(digits_dir):
  it = iter(pipeline.make_dataset(digits_dir, batch_size=8, seed=1))
  next(it)
  state = it.get_state()
  blocked = iter(pipeline.make_dataset(digits_dir, batch_size=8, seed=1, order="blocks"))
  with pytest.raises(ValueError, match="order"):
    blocked.set_state(state)


def shard_reads(data_dir) -> tuple[ShardedSource, list[int]]:
  meta = manifest.load(data_dir)
  shards = meta.splits["train"].shards
  counts = [s.num_records for s in shards]
  return ShardedSource([data_dir / s.file for s in shards], counts), counts


def test_block_reads_give_the_records_and_read_each_block_once_an_epoch(digits_dir):
  source, counts = shard_reads(digits_dir)
  calls = []
  block_reads = BlockReads(lambda *a: calls.append(a) or source.read_range(*a), counts, 16, 2**30)
  s = Sampler(sum(counts), seed=1, num_epochs=2, blocks=Blocks(tuple(counts)))
  starts = np.asarray(source.starts)
  for first in range(0, len(s), 50):  # batches of 50, in turn
    indices = s.records(np.arange(first, min(first + 50, len(s))))[1]
    shards = source.shards_of(indices)
    for shard in np.unique(shards).tolist():
      local = (indices[shards == shard] - starts[shard]).tolist()
      assert block_reads.read(shard, local) == source.read_shard(shard, local)
  assert len(calls) == 2 * sum(-(-c // 16) for c in counts)  # every block, once an epoch
  assert block_reads.kept_bytes == 0 and block_reads.requests == len(calls)
  # a batch across two epochs may want one record twice, from a block read once
  assert block_reads.read(0, [5, 5, 7]) == source.read_shard(0, [5, 5, 7])
  assert len(calls) == 1 + 2 * sum(-(-c // 16) for c in counts)


@pytest.mark.parametrize("hosts", [2, 3])
@pytest.mark.parametrize("store", [False, True], ids=["own_blocks", "shared_blocks"])
def test_where_shares_are_cut_at_records_each_process_reads_only_its_part_of_a_block(
  digits_dir, hosts, store
):
  """The digits' 240 training records are one block of 256: the shares are cut at records,
  and each process's reads stop at the cuts (with its own blocks or a host's shared ones):
  together the processes read each record once, in one range read per part."""
  source, counts = shard_reads(digits_dir)
  b = Blocks(tuple(counts), block_records=256)
  assert b.cut_shares(hosts) and len(b.cuts(hosts, 1)) == hosts - 1
  read = []
  for p in range(hosts):
    s = Sampler(sum(counts), seed=1, shard_index=p, shard_count=hosts, blocks=b)
    shared = blockstore.BlockStore.new(2**30) if store else None
    reads = BlockReads(
      lambda *a: read.append(a) or source.read_range(*a),
      counts,
      256,
      2**30,
      shared,
      fetch._by_shard(source, s.cuts),
    )
    mine = s.records(np.arange(s.per_epoch))[1].tolist()
    assert reads.read(0, mine) == source.read_shard(0, mine)
  assert sorted(np.concatenate([np.arange(a, z) for _, a, z in read]).tolist()) == list(range(240))
  assert len(read) == hosts


def test_block_reads_in_many_threads_and_within_a_small_budget_give_the_same_records(digits_dir):
  source, counts = shard_reads(digits_dir)
  wanted = [(shard, i) for shard, c in enumerate(counts) for i in range(c)] * 2
  np.random.default_rng(0).shuffle(wanted)
  for budget in (2**30, 3000):
    block_reads = BlockReads(source.read_range, counts, 8, budget)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
      got = list(pool.map(lambda w, r=block_reads: r.read(w[0], [w[1]])[0], wanted))
    assert got == [source.read_shard(shard, [i])[0] for shard, i in wanted]
    assert block_reads.kept_bytes <= max(budget, 8 * max(map(len, got)))


def test_batches_waiting_on_one_block_share_its_failed_read_and_a_later_batch_reads_again(
  digits_dir,
):
  """A block storage did not answer fails every batch that waited on its read at once (the
  first to start asked; exit came 18 s after the error line when each asked in turn)."""
  source, counts = shard_reads(digits_dir)
  answering, calls = threading.Event(), []

  def read_range(*args):
    calls.append(args)
    if len(calls) == 1:
      assert answering.wait(30)
      raise remote.RemoteStorageError("cannot read shard 0: no answer within 6 s")
    return source.read_range(*args)

  block_reads = BlockReads(read_range, counts, 16, 2**30)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    waiting = [pool.submit(block_reads.read, 0, [i]) for i in range(4)]
    while len(block_reads._reading) != 1 or len(calls) != 1:
      time.sleep(0.01)
    time.sleep(0.2)  # the other three wait on the first's read
    answering.set()
    for future in waiting:
      with pytest.raises(remote.RemoteStorageError, match="no answer within 6 s"):
        future.result()
  assert len(calls) == 1
  assert block_reads.read(0, [3]) == source.read_shard(0, [3]) and len(calls) == 2


def test_through_the_rig_a_block_is_one_request_and_8_images_or_more_come_per_request(
  storage_rig, photos_dir
):
  source, counts = shard_reads(photos_dir)
  with storage_rig.mount(photos_dir, latency_ms=1) as m:
    mounted = ShardedSource([m.path / pathlib.Path(p).name for p in source.paths], counts)
    assert len(mounted.read_range(0, 0, 12)) == 12  # opens the shard (its footer: 2 reads)
    m.reset()
    assert mounted.read_range(0, 2, 12) == source.read_shard(0, list(range(2, 12)))
    assert m.stats()["reads"] == 1  # < 1 MiB: one request (FUSE cuts larger ones in 1 MiB)
    st = dataset.build(
      pipeline.Spec.of(str(m.path), batch_size=8, image_size=32, shard_index=0, shard_count=1)
    )
    assert st.read.ranges is not None  # a mount: the block order and its block reads
    take(iter(dataset.chain(st)), 10 * sum(counts) // 8)  # 10 epochs, and those read ahead
    assert st.read.stats.request_records / st.read.stats.requests >= 8


def test_a_request_budget_gives_each_request_its_turn_and_no_more():
  now, slept = [0.0], []
  budget = RequestBudget(100, clock=lambda: now[0], sleep=slept.append)
  for _ in range(5):  # at once: 10 ms apart
    budget.take()
  assert slept == pytest.approx([0.01, 0.02, 0.03, 0.04]) and budget.waited == 4
  now[0] = 1.0  # long after the last turn: no wait
  budget.take(10)  # a batched read of 10 records: 10 requests, the next turn 100 ms on
  budget.take()
  assert slept[4:] == pytest.approx([0.1]) and budget.waited == 5
  with pytest.raises(ValueError, match="max_requests_per_s must be None or > 0, got 0"):
    pipeline.Performance(max_requests_per_s=0)


def test_the_read_stage_waits_its_turn_under_max_requests_per_s(digits_dir):
  for order in ("global", "blocks"):
    perf = dict(max_requests_per_s=50, num_workers=0)
    spec = pipeline.Spec.of(
      digits_dir, batch_size=16, image_size=16, order=order, block_records=16, performance=perf
    )
    st = dataset.build(spec)
    take(iter(dataset.chain(st)), 2)
    assert st.read.budget.waited >= 1 and st.read.stats.requests >= 2
    assert "at most 50/s (performance.max_requests_per_s)" in read.requests(st.read)


@pytest.mark.parametrize("cap", [float("inf"), 1e308])
def test_a_request_cap_of_inf_or_past_any_rate_means_no_cap(digits_dir, cap):
  perf = dict(max_requests_per_s=cap, num_workers=0)
  spec = pipeline.Spec.of(
    digits_dir, batch_size=16, image_size=16, order="blocks", performance=perf
  )
  st = dataset.build(spec)
  assert len(take(iter(dataset.chain(st)), 2)) == 2
  assert st.read.budget is None or st.read.budget.waited == 0


@pytest.mark.parametrize("cap", [1e-300, 1e-3, float("nan"), -1.0])
def test_a_request_cap_that_cannot_work_is_one_line(cap):
  with pytest.raises(ValueError, match="performance.max_requests_per_s") as e:
    pipeline.Performance(max_requests_per_s=cap)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("size", ["block_records", "window_blocks"])
def test_a_block_or_window_past_the_shards_is_bounded_by_them_and_keeps_the_order(digits_dir, size):
  def make(value):
    return pipeline.make_dataset(
      digits_dir, batch_size=16, image_size=16, order="blocks", seed=4, **{size: value}
    )

  past = take(iter(make(2**40)), 16)  # 240 records in one shard: more than an epoch
  assert_same_batches(take(iter(make(1024)), 16), past)  # any size past the shard's


def test_a_block_larger_than_every_shard_is_that_shard_whatever_its_size():
  shards = (700,) * 11 + (300,)
  huge = Blocks(shards, block_records=2**40, window_blocks=2**40).permute(np.arange(8000), key=2)
  assert np.array_equal(huge, Blocks(shards, 1024, 12).permute(np.arange(8000), key=2))


def test_block_ordered_batches_are_the_same_in_a_worker_process_and_after_a_resume(digits_dir):
  def make(workers):
    perf = dict(num_workers=workers, record_cache_mb=0)
    return pipeline.make_dataset(
      digits_dir, batch_size=16, image_size=16, order="blocks", seed=4, performance=perf
    )

  expected = take(iter(make(0)), 20)  # 20 batches: more than an epoch of 240 records
  assert_same_batches(expected, take(iter(make(1)), 20))
  it = iter(make(0))
  take(it, 7)
  resumed = iter(make(0))
  resumed.set_state(it.get_state())
  assert_same_batches(expected[7:], take(resumed, 13))


def test_owned_shards_fill_the_record_cache_in_block_reads_and_then_read_nothing(
  storage_rig, photos_dir
):
  _, counts = shard_reads(photos_dir)
  with storage_rig.mount(photos_dir, latency_ms=1) as m:
    perf = dict(record_cache_mb=256, num_workers=0)
    spec = pipeline.Spec.of(
      str(m.path),
      batch_size=8,
      image_size=32,
      sharding="shards",
      shard_index=0,
      shard_count=1,
      performance=perf,
    )
    st = dataset.build(spec)
    assert st.read.ranges is not None and st.read.cache is not None
    it = iter(dataset.chain(st))
    take(it, sum(counts) // 8 + 4)  # the first epoch, and what it read ahead
    s = st.read.stats
    assert s.requests <= sum(-(-c // 16) for c in counts)  # each block once
    assert s.request_records / s.requests >= 8
    m.reset()
    take(it, 2 * sum(counts) // 8)  # two more epochs: all from the host's cache
    assert m.stats()["reads"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("kept_windows", [0, 2])
def test_block_reads_keep_two_windows_so_each_block_is_read_once(kept_windows):
  shards, size, batch = (1024,) * 64, 1000, 128  # records of 1,000 bytes
  s = Sampler(sum(shards), seed=4, block=batch, blocks=Blocks(shards, 32, 4 * batch))
  window_bytes = 4 * batch * 32 * size
  calls = []

  def read_range(shard, begin, end):
    calls.append((shard, begin))
    return [bytes(size)] * (end - begin)

  ahead = 4 * batch * size  # performance.read_ahead_mb's bytes: here 4 batches
  reads = BlockReads(read_range, list(shards), 32, ahead + kept_windows * window_bytes)
  for b in range(sum(shards) // batch):  # the batches in turn, as the read stage starts them
    shard, local = np.divmod(s.records(np.arange(b * batch, (b + 1) * batch))[1], 1024)
    for k in np.unique(shard).tolist():
      assert reads.read(k, local[shard == k].tolist()) == [bytes(size)] * (shard == k).sum()
  blocks = sum(shards) // 32
  if kept_windows:
    assert len(calls) == len(set(calls)) == blocks  # each block once in the epoch
  else:
    assert len(calls) > 1.5 * blocks  # blocks dropped before their last round, read again
