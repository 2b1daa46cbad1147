"""The read stage on slow storage, through the rig (bench/rig.py: a fixed latency per read
request, no page cache), counted by the rig itself: batches and resume are those of local
disk, and with the record cache a second epoch asks storage for nothing."""

from __future__ import annotations

from pipeline import dataset
from tests.conftest import assert_same_batches, take


def make(data_dir, **kwargs):
  kwargs = {"batch_size": 8, "image_size": 32, "shard_index": 0, "shard_count": 1, **kwargs}
  return dataset.build(dataset.Spec.of(str(data_dir), **kwargs))


def test_slow_storage_gives_local_batches_and_resumes_exactly(storage_rig, photos_dir):
  # a mount is read in block order by default (pipeline.blocks), local disk when asked
  local = take(iter(dataset.chain(make(photos_dir, seed=2, order="blocks"))), 9)
  with storage_rig.mount(photos_dir, latency_ms=5) as m:
    ds = dataset.chain(make(m.path, seed=2, performance=dict(record_cache_mb=0)))
    it = iter(ds)
    first = take(it, 4)
    state = it.get_state()
    rest = take(it, 5)
    resumed = iter(ds)
    resumed.set_state(state)
    again = take(resumed, 5)
    other_threads = take(
      iter(dataset.chain(make(m.path, seed=2, performance=dict(record_cache_mb=0, num_threads=3)))),
      9,
    )
    assert m.stats()["max_in_flight"] > 1  # reads overlapped
  assert_same_batches(local, first + rest)
  assert_same_batches(rest, again)
  assert_same_batches(local, other_threads)


def test_with_the_record_cache_a_second_epoch_reads_nothing_from_storage(storage_rig, photos_dir):
  with storage_rig.mount(photos_dir, latency_ms=2) as m:
    st = make(m.path, train=False, num_epochs=2, performance=dict(record_cache_mb=64))
    it = iter(dataset.chain(st))
    n = st.plan.sampler.num_records
    per_epoch = -(-n // 8)
    take(it, per_epoch - 3)  # most of epoch 1; the rest is being read ahead
    while st.read.stats.reads < n:  # epoch 1 read in full
      next(it)
    m.reset()
    rest = list(it)
    assert m.stats()["reads"] == 0  # epoch 2 came from the cache alone
  assert sum(int(b["mask"].sum()) for b in rest) > 0
