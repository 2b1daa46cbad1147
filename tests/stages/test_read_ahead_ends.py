"""A stream of known length (`num_batches`: a run's steps) ends there, and its read-ahead never
plans or reads a batch past it: the plan stage is asked for those batches only, and storage
for their records only."""

from __future__ import annotations

import pytest

import pipeline
from pipeline import dataset
from pipeline.stages.stream import stats_of, stop_after


def test_the_read_ahead_stops_at_the_last_batch_the_run_takes(digits_dir):
  perf = dict(num_workers=0, read_ahead=8, record_cache_mb=0)
  spec = pipeline.Spec.of(digits_dir, batch_size=8, image_size=16, num_batches=5, performance=perf)
  st = dataset.build(spec)
  it = iter(dataset.chain(st))
  assert len(list(it)) == 5  # then the stream ends
  planned = [r.items for r in stats_of(it).rows if r.stage == "plan"]
  assert planned == [5]
  assert st.read.stats.request_records == 5 * 8  # one request per record on local disk
  it.close()


def test_num_batches_is_checked():
  with pytest.raises(ValueError, match="^num_batches must be None or positive, got 0$"):
    pipeline.Spec.of("x", batch_size=8, num_batches=0)


def batches_of(data_dir, batch_size: int, workers: int = 0) -> pipeline.Spec:
  perf = dict(num_workers=workers, read_ahead=8, record_cache_mb=0)
  return pipeline.Spec.of(data_dir, batch_size=batch_size, image_size=16, performance=perf)


@pytest.fixture(scope="module")
def resumed(digits_dir) -> tuple[dict, list]:
  """(a state after 3 batches of 16, the labels of batches 6 to 9 of the stream at 8: those
  that follow it there)."""
  saved = iter(dataset.chain(dataset.build(batches_of(digits_dir, 16))))
  for _ in range(3):
    next(saved)
  state = saved.get_state()
  saved.close()
  whole = iter(dataset.chain(dataset.build(batches_of(digits_dir, 8))))
  expected = [next(whole)["label"].tolist() for _ in range(10)][6:]
  whole.close()
  return state, expected


def test_a_stream_resumed_at_another_batch_stops_after_the_steps_left_in_its_own_batches(
  digits_dir, resumed
):
  """A state at 3 batches of 16 is 6 batches of 8: 4 steps left are batches 6 to 9 of the
  stream at 8, planned and read alone."""
  state, expected = resumed
  st = dataset.build(batches_of(digits_dir, 8))
  it = iter(dataset.chain(st))
  it.set_state(state)
  stop_after(it, 4)
  assert [b["label"].tolist() for b in it] == expected  # then the stream ends
  assert [r.items for r in stats_of(it).rows if r.stage == "plan"] == [4]
  assert st.read.stats.request_records == 4 * 8
  it.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_device_stream_cut_by_stop_after_ends_cleanly_then_a_new_pass_is_whole(
  digits_dir, resumed, workers
):
  state, expected = resumed
  perf = dict(num_workers=workers, record_cache_mb=0)
  data = pipeline.input(digits_dir, global_batch_size=8, image_size=16, performance=perf)
  data.set_state(state)
  data.stop_after(2)
  assert [next(data)["label"].tolist() for _ in range(2)] == expected[:2]
  with pytest.raises(StopIteration, match=r"^end of the stream: the 2 batches stop_after\(2\)"):
    next(data)
  assert data.get_state()["position"] == 0  # the next pass: from its start, uncut
  assert len([next(data) for _ in range(8)]) == 8
  data.close()


def test_stop_after_is_refused_once_the_stream_has_begun(digits_dir):
  it = iter(dataset.chain(dataset.build(batches_of(digits_dir, 8))))
  next(it)
  with pytest.raises(ValueError, match="^stop_after ends a stream before its first batch"):
    stop_after(it, 2)
  it.close()
