"""`AheadIterDataset`: the first element is started alone, then the stage's depth ahead; the
stage before it starts its next ones while that first one finishes."""

from __future__ import annotations

import grain

from pipeline.stages.ahead import AheadIterDataset


class Recording:
  """A stage that notes how many elements were started when each one finishes."""

  def __init__(self, depth: int):
    self._depth, self.started, self.started_at_finish = depth, [], []

  def depth(self) -> int:
    return self._depth

  def start(self, element: int) -> int:
    self.started.append(element)
    return element

  def finish(self, started: int) -> int:
    self.started_at_finish.append(len(self.started))
    return started * 10


def test_the_first_element_is_started_alone_then_depth_elements_ahead():
  stage = Recording(depth=3)
  it = iter(AheadIterDataset(grain.MapDataset.range(10).to_iter_dataset(), stage))
  assert next(it) == 0
  assert stage.started == [0]
  assert [next(it) for _ in range(3)] == [10, 20, 30]
  # the first finished with nothing else started; then 3 ahead plus the one finishing
  assert stage.started_at_finish == [1, 5, 6, 7]


def test_a_stage_over_a_stage_waits_for_its_second_element_until_asked():
  reads, decodes = Recording(depth=2), Recording(depth=2)
  ds = AheadIterDataset(
    AheadIterDataset(grain.MapDataset.range(10).to_iter_dataset(), reads), decodes
  )
  it = iter(ds)
  assert next(it) == 0
  assert decodes.started == [0]
  assert reads.started == [0, 1, 2]  # the stage before started its next ones meanwhile
  assert next(it) == 100


def test_after_a_restore_the_next_element_is_again_started_alone():
  stage = Recording(depth=3)
  it = iter(AheadIterDataset(grain.MapDataset.range(10).to_iter_dataset(), stage))
  next(it)
  state = it.get_state()
  next(it)
  it.set_state(state)
  stage.started.clear()
  assert next(it) == 10
  assert stage.started == [1]  # the work started ahead was dropped; only this one started
