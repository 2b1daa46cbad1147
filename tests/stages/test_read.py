"""The read stage: reads ahead of need without changing a batch, resumes exactly, keeps what
it read (record cache), and lets a process own whole shards.

Latency itself (a bucket's 5-100 ms) is emulated by the FUSE rig in tests/bench/test_rig.py
and the slow tests there; here the stage runs on local shards, where its bookkeeping is exact.
"""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from pipeline import dataset
from pipeline.convert import images, shards
from pipeline.order.sampling import PAD, Sampler
from pipeline.stages import read
from pipeline.stages.ahead import AheadIterDataset
from pipeline.storage.budget import ReadAhead
from pipeline.storage.cache import RecordCache
from pipeline.storage.fetch import Fetcher
from tests import stage_chain
from tests.conftest import assert_same_batches, take
from tests.stage_chain import stages


@pytest.fixture(scope="module")
def sharded_dir(photos_raw, tmp_path_factory):
  """The 64 photos in ~8 shards (a bucket's dataset has many)."""
  out = tmp_path_factory.mktemp("sharded") / "data"
  images.convert(images.Request(photos_raw, out, shard_size_mb=0.4), workers=1, progress=False)
  return out


def test_the_read_stage_over_grain_fills_each_slot_with_its_records_bytes(sharded_dir):
  s = stages(sharded_dir, num_epochs=1, drop_remainder=False)
  read = AheadIterDataset(stage_chain.planned(s), s.read)
  seen = 0
  for batch in read:
    assert batch.records == s.read.source.read(batch.indices.tolist())
    seen += len(batch.indices)
  assert seen == s.manifest.splits["train"].num_records


def test_batches_are_the_same_for_any_read_ahead_and_thread_count(sharded_dir):
  def run(read_ahead, threads):
    perf = dict(read_ahead=read_ahead, num_threads=threads, num_workers=0)
    return take(iter(dataset.chain(stages(sharded_dir, seed=5, performance=perf))), 12)

  reference = run(1, 1)
  assert_same_batches(reference, run(6, 3))
  assert_same_batches(reference, run(None, 2))


def test_resume_drops_the_reads_started_ahead(sharded_dir):
  ds = dataset.chain(stages(sharded_dir, performance=dict(read_ahead=5)))
  it = iter(ds)
  take(it, 4)
  state = it.get_state()
  assert state["next_index"] == 4  # the next batch, whatever was read ahead of it
  expected = take(it, 6)
  resumed = iter(ds)
  resumed.set_state(state)
  assert_same_batches(expected, take(resumed, 6))


def bare_stage(max_requests_per_s=None) -> read.ReadRecords:
  """A read stage of 128-image batches planned for 2,000 img/s at 20 ms a read, without a
  source: depth() and bounds() read only the stage's own fields."""
  fetcher = Fetcher(type("S", (), {})(), (0.020, 60_000), max_requests_per_s=max_requests_per_s)
  ahead = ReadAhead(fetcher, batch_size=128, rate_per_s=2000, ahead_bytes=256 * 2**20)
  return read.ReadRecords(fetcher, ahead)


def test_reads_in_flight_follow_littles_law_within_the_bytes():
  assert read.reads_in_flight(2000, 0.020) == 80  # 2 x rate x latency
  stage = bare_stage()
  assert stage.depth() == 2  # 80 reads: one batch ahead of the one being read
  assert stage.bounds() == (2, 8 * 2)  # more only while throughput grows with them
  stage.stats.latency_s = 0.100
  assert stage.depth() == 2  # a longer latency alone adds none (test_read_controller)
  stage.control.depth = 5
  stage.ahead.ahead_bytes = 3 * 128 * 60_000
  assert stage.depth() == 3  # ... and never holding more bytes than allowed


def test_a_read_stage_moves_to_a_worker_with_fresh_counters_and_one_storage_side(sharded_dir):
  st = stages(sharded_dir, performance=dict(num_workers=0))
  take(iter(dataset.chain(st)), 2)
  moved = pickle.loads(pickle.dumps(st.read))  # as Grain hands it to a worker process
  assert st.read.stats.reads > 0 and moved.stats.reads == 0
  assert moved.ahead.reads is moved.fetcher  # the policy sizes for the stage's own reads
  assert moved.depth() == moved.bounds()[0]  # the controller starts again at the floor


def test_with_the_record_cache_the_second_epoch_reads_nothing_from_storage(sharded_dir):
  st = stages(sharded_dir, num_epochs=2, performance=dict(record_cache_mb=64, num_workers=0))
  batches = list(dataset.chain(st))
  n = st.plan.sampler.num_records
  assert sum(len(b["label"]) for b in batches) == 2 * n // 8 * 8
  assert st.read.stats.reads == n  # every record once, in epoch 1
  assert st.read.stats.cached == len(batches) * 8 - n  # epoch 2 from RAM
  again = stages(sharded_dir, num_epochs=2, performance=dict(record_cache_mb=0, num_workers=0))
  assert_same_batches(batches, list(dataset.chain(again)))  # the cache changes no batch


def test_the_disk_cache_serves_a_restart_and_rereads_a_damaged_entry(sharded_dir, tmp_path):
  perf = dict(record_cache_mb=0, record_cache_dir=str(tmp_path / "cache"), num_workers=0)
  first = stages(sharded_dir, train=False, performance=perf)
  truth = list(dataset.chain(first))
  n = first.plan.sampler.num_records
  assert first.read.stats.reads == n
  entries = sorted((tmp_path / "cache").rglob("*.rec"))
  assert len(entries) == n
  restart = stages(sharded_dir, train=False, performance=perf)  # a new process would, too
  assert_same_batches(truth, list(dataset.chain(restart)))
  assert restart.read.stats.reads == 0
  with open(entries[3], "r+b") as f:  # one flipped byte in one entry
    f.seek(20)
    byte = f.read(1)
    f.seek(20)
    f.write(bytes([byte[0] ^ 0xFF]))
  damaged = stages(sharded_dir, train=False, performance=perf)
  assert_same_batches(truth, list(dataset.chain(damaged)))
  assert damaged.read.stats.reads == 1  # that record alone, from storage again


def test_a_cache_folder_never_serves_another_datasets_records(sharded_dir, photos_dir, tmp_path):
  perf = dict(record_cache_mb=0, record_cache_dir=str(tmp_path), num_workers=0)
  list(dataset.chain(stages(sharded_dir, train=False, performance=perf)))
  other = stages(photos_dir, train=False, performance=perf)
  list(dataset.chain(other))
  assert other.read.stats.reads == other.plan.sampler.num_records
  assert len(os.listdir(tmp_path)) == 2  # one folder per dataset


def test_the_record_cache_is_on_by_default_only_for_slow_storage(sharded_dir):
  st = stages(sharded_dir)  # local disk: well under 2 ms a read
  assert st.read.cache is None


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_processes_that_own_shards_read_only_their_shards_each_epoch(remainder):
  counts = (5, 7, 6, 4, 9)
  starts = np.concatenate([[0], np.cumsum(counts)])
  seen = []
  for p in range(2):
    s = Sampler(
      sum(counts), seed=3, shard_index=p, shard_count=2, remainder=remainder, shard_records=counts
    )
    owned = [range(starts[k], starts[k + 1]) for k in range(p, len(counts), 2)]
    mine = {i for r in owned for i in r}
    epochs = [s.records(np.arange(e * s.per_epoch, (e + 1) * s.per_epoch))[1] for e in range(3)]
    for got in epochs:
      real = got[got != PAD]
      assert set(real.tolist()) <= mine and len(set(real.tolist())) == len(real)
      if remainder == "pad":
        assert set(real.tolist()) == mine  # every owned record once per epoch
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh order each epoch
    seen.append(mine)
  assert not seen[0] & seen[1]
  per_epoch = {
    Sampler(31, shard_index=p, shard_count=2, shard_records=counts).per_epoch for p in range(2)
  }
  assert len(per_epoch) == 1  # every process takes the same number of positions


def test_owning_shards_needs_a_shard_per_process(sharded_dir):
  with pytest.raises(ValueError, match="cannot be owned by 99 processes"):
    stages(sharded_dir, sharding="shards", shard_index=0, shard_count=99)
  st = stages(sharded_dir, sharding="shards", shard_index=1, shard_count=2)
  batch = next(iter(dataset.chain(st)))
  assert batch["image"].shape == (8, 32, 32, 3)


def test_a_train_batch_larger_than_the_split_is_refused_an_eval_one_is_padded(photos_dir):
  with pytest.raises(ValueError, match="batch_size=1000 is larger than"):
    stages(photos_dir, batch_size=1000)
  (batch,) = list(dataset.chain(stages(photos_dir, batch_size=1000, train=False)))
  n = stages(photos_dir, train=False).plan.sampler.num_records
  assert batch["mask"].all() and len(batch["mask"]) == n  # one short batch: every record once


def test_record_cache_entries_are_checked(tmp_path):
  cache = RecordCache(0, str(tmp_path), "d", ["shard"], ["size:mtime"])
  cache.put(7, 0, 7, b"\x07\x00record")
  assert cache.get(7, 0, 7) == b"\x07\x00record"
  changed = RecordCache(0, str(tmp_path), "d", ["shard"], ["size:another mtime"])
  assert changed.get(7, 0, 7) is None  # the shard changed since: not its record any more
  cache.put(7, 0, 7, b"\x07\x00record")
  path = tmp_path / "d" / "shard" / "7.rec"
  path.write_bytes(path.read_bytes()[:-1])  # truncated
  assert cache.get(7, 0, 7) is None and not path.exists()
  os.mkfifo(path)  # opened without waiting for a writer, and refused
  assert cache.get(7, 0, 7) is None and not path.exists()


def _shard_entries(cache_dir) -> list:
  """The disk cache's entries of the shard with the most of them, by record index."""
  folders = [f for f in cache_dir.rglob("*") if f.is_dir() and any(f.glob("*.rec"))]
  folder = max(folders, key=lambda f: len(list(f.glob("*.rec"))))
  return sorted(folder.glob("*.rec"), key=lambda p: int(p.stem))


def test_a_swapped_copied_or_linked_cache_entry_is_not_served_as_another_record(
  sharded_dir, tmp_path
):
  """Issue 31: an entry moved to another record's name served that record's bytes."""
  perf = dict(record_cache_mb=0, record_cache_dir=str(tmp_path / "cache"), num_workers=0)
  first = stages(sharded_dir, train=False, performance=perf)
  truth = list(dataset.chain(first))
  e = _shard_entries(tmp_path / "cache")
  assert len(e) >= 5
  e[0].rename(tmp_path / "swap")  # records 0 and 1 swapped
  e[1].rename(e[0])
  (tmp_path / "swap").rename(e[1])
  shutil.copyfile(e[2], e[3])  # record 2's entry copied over record 3's
  e[4].unlink()
  e[4].symlink_to(e[2])  # record 4's entry a link to record 2's
  restart = stages(sharded_dir, train=False, performance=perf)
  assert_same_batches(truth, list(dataset.chain(restart)))
  assert restart.read.stats.reads == 4  # records 0, 1, 3 and 4, from storage again
  assert not e[4].is_symlink()


def test_the_disk_cache_is_not_served_after_its_shard_changes(sharded_dir, tmp_path):
  """Issue 31: entries read from a shard stayed valid after the shard was written again."""
  data = tmp_path / "data"
  shutil.copytree(sharded_dir, data)
  perf = dict(record_cache_mb=0, record_cache_dir=str(tmp_path / "cache"), num_workers=0)
  list(dataset.chain(stages(data, train=False, performance=perf)))  # fills the cache
  shard = sorted(data.glob("train.array_record-*"))[0]
  reader = ArrayRecordReader(str(shard))
  recs = reader.read(list(range(reader.num_records())))
  reader.close()
  rewritten = tmp_path / "rewritten"
  writer = ArrayRecordWriter(str(rewritten), shards.OPTIONS)
  for rec in reversed(recs):
    writer.write(rec)
  writer.close()
  assert rewritten.stat().st_size == shard.stat().st_size  # the manifest's size check passes
  os.replace(rewritten, shard)
  stored = list(dataset.chain(stages(data, train=False, performance=dict(record_cache_mb=0))))
  cached = stages(data, train=False, performance=perf)
  assert_same_batches(stored, list(dataset.chain(cached)))  # what the shard holds now
  assert cached.read.stats.reads == len(recs)  # that shard's records, from storage again


def test_a_cache_folder_that_cannot_be_written_is_refused_in_one_line(sharded_dir, tmp_path):
  mine = tmp_path / "notes.txt"
  mine.write_bytes(b"mine")
  with pytest.raises(ValueError, match="record_cache_dir .* cannot keep records there") as e:
    stages(sharded_dir, performance=dict(record_cache_dir=str(mine)))
  assert "\n" not in str(e.value) and mine.read_bytes() == b"mine"  # nothing of theirs lost


def test_under_a_request_budget_the_reads_ahead_do_not_grow_with_the_queueing():
  stage = bare_stage(max_requests_per_s=250)
  stage.stats.latency_s = 1.0  # reads that waited their turn: 1 s each
  assert stage.bounds() == (2, 2)  # 2 x 250/s x 20 ms = 10 reads: one batch ahead
  stage.fetcher.budget = None
  assert stage.bounds() == (2, 8 * 2)  # without it: more only while throughput grows
