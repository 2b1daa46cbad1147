"""Stage 6, stream (pipeline.stages.stream): the outermost iterator: a state tagged with its stream
and its global position, checked before Grain sees it, and the skip count."""

import pytest

from pipeline.catalog import records
from pipeline.stages.ahead import AheadIterDataset
from pipeline.stages.stream import StateError, StreamIterDataset
from tests import stage_chain
from tests.conftest import assert_same_batches, jpeg, take


def streamed(s):
  decoded = AheadIterDataset(AheadIterDataset(stage_chain.planned(s), s.read), s.decode)
  return StreamIterDataset(decoded.map(s.finish), s.stream)


def test_the_stream_stage_over_grain_resumes_exactly_from_its_own_state(photos_dir):
  s = stage_chain.stages(photos_dir, seed=4)
  it = iter(streamed(s))
  take(it, 2)
  state = it.get_state()
  assert state["stream"] == s.stream and state["position"] == 2 * 8 and state["skipped"] == 0
  expected = take(it, 3)
  resumed = iter(streamed(stage_chain.stages(photos_dir, seed=4)))
  resumed.set_state(state)
  assert_same_batches(expected, take(resumed, 3))


@pytest.mark.parametrize(
  "other,error",
  [
    ({"seed": 5}, "another stream .*seed 0 in the state, 5 here"),
    ({"train": False}, "another stream .*remainder None in the state, pad here"),
  ],
)
def test_a_state_of_another_stream_is_refused_before_grain_sees_it(photos_dir, other, error):
  it = iter(streamed(stage_chain.stages(photos_dir)))
  take(it, 1)
  state = it.get_state()
  split = "validation" if other.get("train") is False else "train"
  other_it = iter(streamed(stage_chain.stages(photos_dir, split, **other)))
  with pytest.raises(StateError, match=error):
    other_it.set_state(state)


def test_the_stream_stage_sums_the_skip_count_the_batches_carry(tmp_path, write_dataset):
  good = [records.encode(jpeg, i % 2) for i, jpeg in enumerate(jpeg(i) for i in range(6))]
  data = write_dataset(tmp_path / "bad", good[:2] + [b"\x00\x01not a proto"] * 2 + good[2:])
  s = stage_chain.stages(data, train=False, on_error="skip")
  it = iter(streamed(s))
  batches = list(it)
  assert all(set(b) == {"image", "label", "mask"} for b in batches)
  assert sum(int(b["mask"].sum()) for b in batches) == 6
  assert it.skipped == 2 and it.get_state()["skipped"] == 2
