"""The read stage on slow storage, through the rig (bench/rig.py: a fixed latency per read
request, no page cache), counted by the rig itself: batches and resume are those of local
disk, with the record cache a second epoch asks storage for nothing, and a mount that stops
answering is one line naming the shard within the read deadline, no file left open on it."""

from __future__ import annotations

import gc
import math
import threading

import pytest
from array_record.python.array_record_module import ArrayRecordReader

from pipeline import dataset, options
from pipeline.storage import remote
from pipeline.storage.source import READER_OPTIONS
from tests.conftest import assert_same_batches, take
from tests.leftovers import clean_mount


def make(data_dir, **kwargs):
  kwargs = {"batch_size": 8, "image_size": 32, "shard_index": 0, "shard_count": 1, **kwargs}
  return dataset.build(dataset.Spec.of(str(data_dir), **kwargs))


def test_slow_storage_gives_local_batches_and_resumes_exactly(storage_rig, photos_dir):
  # a mount is read in block order by default (pipeline.order.blocks), local disk when asked
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


# with a worker process: 38 s on a loaded machine, in `make test-slow`
@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_mount_that_stops_answering_is_one_line_naming_the_shard(
  storage_rig, photos_dir, workers
):
  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1)) as m:
    perf = dict(record_cache_mb=0, read_deadline_s=2, num_workers=workers)
    it = iter(dataset.chain(make(m.path, performance=perf)))
    next(it)
    raised = []

    def read_on():
      try:
        for _ in range(1000):  # past every batch read ahead before the stall
          next(it)
      except Exception as e:  # noqa: BLE001 - the test looks at what it is
        raised.append((type(e), str(e)))  # not its traceback: it holds the dataset

    with m.stall():  # every read now blocks in its syscall, as on a dead gcsfuse connection
      reader = threading.Thread(target=read_on, daemon=True)
      reader.start()
      reader.join(60)
      assert not reader.is_alive(), "next() still waiting on a stalled mount after 60 s"
    it.close()
    it = None  # the dataset dropped (with its reference cycles): its shard files close
    gc.collect()
  shard = f"{m.path}/train.array_record-00000-of-00001"
  assert [kind for kind, _ in raised] == [remote.RemoteStorageError]
  assert raised[0][1] == (
    f"cannot read {shard}: no answer within 2 s: check the mount (gcsfuse: its log and its "
    "connection) (performance.read_deadline_s sets the wait)"
  )


def test_a_mount_that_answers_slowly_but_steadily_is_waited_for_past_the_deadline(
  storage_rig, photos_dir
):
  """The mount answers 4 requests a second, a block of 4 records each: the first batch of 16
  waits for 12 blocks' requests, 3 s, past the 2 s deadline, with more read ahead queued
  behind them. Storage is never silent for 2 s, so no batch is refused; the batches are the
  local ones. (The deadline measured each batch's wait, and refused it.)"""
  kwargs = dict(batch_size=16, order="blocks", block_records=4, seed=1)
  local = take(iter(dataset.chain(make(photos_dir, **kwargs))), 3)
  with storage_rig.mount(photos_dir, latency_ms=1, requests_per_s=4) as m:
    perf = dict(record_cache_mb=0, read_deadline_s=2, read_ahead=4)
    it = iter(dataset.chain(make(m.path, performance=perf, **kwargs)))
    got = take(it, 3)
    it.close()
  assert_same_batches(local, got)


def test_opening_a_dataset_on_a_stalled_mount_is_one_line_naming_the_manifest(
  storage_rig, photos_dir, monkeypatch
):
  monkeypatch.setattr(remote, "ATTEMPT_S", 1.0)  # reads at open: 3 attempts' worth, 3 s
  raised = []

  def open_dataset():
    try:
      make(m.path)
    except Exception as e:  # noqa: BLE001 - the test looks at what it is
      raised.append(e)

  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1)) as m, m.stall():
    opener = threading.Thread(target=open_dataset, daemon=True)
    opener.start()
    opener.join(60)
    assert not opener.is_alive(), "make_dataset still waiting on a stalled mount after 60 s"
  assert [str(e) for e in raised] == [
    f"cannot read {m.path}/manifest.json: no answer within 3 s: check the mount (gcsfuse: its "
    "log and its connection) (performance.read_deadline_s sets the wait)"
  ]


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, "10", True])
@pytest.mark.parametrize("name, none", [("read_deadline_s", "60 s"), ("memory_mb", "half")])
def test_a_deadline_or_memory_budget_is_a_finite_number_above_0_or_one_line(name, none, value):
  with pytest.raises(ValueError) as raised:
    options.Performance(**{name: value})
  if isinstance(value, (str, bool)):  # not a number at all: the type check's line
    assert str(raised.value) == (
      f"performance.{name} must be a number or None, got {value!r} ({type(value).__name__})"
    )
  else:
    assert str(raised.value).startswith(f"performance.{name} must be None ({none}")
    assert str(raised.value).endswith(f"or a finite number > 0, got {value!r}")


def test_opening_a_split_in_the_block_order_reads_each_shard_footer_once(storage_rig, digits_dir):
  """Opened as `make_dataset` opens it (manifest read and read again once the shards are
  pinned, the probe's few records, the first record for `features`), then its first batch:
  each shard's footer (what opening one array_record reader reads) is read once, as the
  block reads' reader opens it; before, the probe's own reader read it a second time."""
  with storage_rig.mount(digits_dir, latency_ms=1) as m:
    m.reset()
    (m.path / "manifest.json").read_bytes()
    manifest = m.reset()["bytes"]
    source = make(m.path, order="blocks").read.source
    footers = []
    for path in source.paths:
      m.reset()
      ArrayRecordReader(path, READER_OPTIONS).close()
      footers.append(m.reset()["bytes"])
    st = make(m.path, features={"file": "image/filename"}, performance=dict(record_cache_mb=0))
    opened = m.reset()
    it = iter(dataset.chain(st))
    next(it)
    it.close()
    first_batch = m.reset()
    for index in (0, 1, 2, 3, 0):  # the probe's records, then the first for `features`
      st.read.source.read([index])
    records = m.reset()["bytes"]
    assert opened["bytes"] - 2 * manifest - sum(footers) <= records < min(footers)
    assert opened["opens"] + first_batch["opens"] == len(source.paths) + 2  # the manifest twice
