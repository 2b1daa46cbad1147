"""The mixture's order: shares within one slot of the weights, a pure function of position,
each source's records once per its own epoch, segments that continue each source."""

import numpy as np
import pytest

from pipeline.order.mixture import MixSampler, Schedule
from pipeline.order.sampling import Sampler

WEIGHTS = [(0.3, 0.7), (0.5, 0.5), (1, 2, 3), (0.01, 0.99), (1 / 3,) * 3, tuple(range(1, 36))]


def counts_of(sources: np.ndarray, k: int) -> np.ndarray:
  """[n + 1, k]: each source's count over every prefix of `sources`."""
  onehot = np.zeros((len(sources), k), np.int64)
  onehot[np.arange(len(sources)), sources] = 1
  return np.concatenate([np.zeros((1, k), np.int64), np.cumsum(onehot, 0)])


@pytest.mark.parametrize("weights", WEIGHTS)
def test_every_prefix_holds_each_source_within_one_slot_of_its_weight(weights):
  schedule = Schedule(weights)
  n = 20_000
  sources, uses = schedule.at(np.arange(n))
  counts = counts_of(sources, len(weights))
  ideal = np.arange(n + 1)[:, None] * np.asarray(schedule.weights)
  assert np.abs(counts - ideal).max() < 1
  # each position's use count is its source's count before it, and counts() agrees
  np.testing.assert_array_equal(uses, counts[np.arange(n), sources])
  for position in (0, 1, 63, 777, n - 1):
    np.testing.assert_array_equal(schedule.counts(position), counts[position])


def test_the_schedule_is_a_pure_function_of_position_far_into_the_stream():
  schedule = Schedule((0.3, 0.7))
  far = 10**12
  whole = schedule.at(np.arange(far, far + 640))
  for k in range(0, 640, 64):  # any batch alone gives the same as a longer span
    alone = schedule.at(np.arange(far + k, far + k + 64))
    np.testing.assert_array_equal(alone[0], whole[0][k : k + 64])
    np.testing.assert_array_equal(alone[1], whole[1][k : k + 64])
  assert np.abs(schedule.counts(far) - far * np.array([0.3, 0.7])).max() < 1


def test_bad_weights_are_refused():
  for bad in [(), (0.5, 0.0), (1.0, -1.0), (float("nan"), 1.0)]:
    with pytest.raises(ValueError, match="mixture weights must be positive"):
      Schedule(bad)


def mix(weights, sizes, seed=0):
  samplers = [Sampler(num_records=n, seed=seed + k) for k, n in enumerate(sizes)]
  return MixSampler(Schedule(weights), samplers, np.cumsum([0, *sizes])[:-1].tolist())


def test_each_source_uses_its_records_once_per_its_own_epoch():
  sizes = (50, 7)
  sampler = mix((0.4, 0.6), sizes)
  positions = np.arange(5000)
  epochs, indices = sampler.records(positions)
  sources = sampler.sources(positions)
  for s, (n, offset) in enumerate(zip(sizes, (0, 50))):
    mine, theirs = indices[sources == s], epochs[sources == s]
    assert ((mine >= offset) & (mine < offset + n)).all()  # in the source's own index range
    for e in range(len(mine) // n):  # every whole epoch of the source: each record once
      assert sorted(mine[e * n : (e + 1) * n] - offset) == list(range(n))
      assert (theirs[e * n : (e + 1) * n] == e).all()


def test_a_segment_with_the_same_uses_continues_the_same_records():
  sampler = mix((0.3, 0.7), (40, 90))
  before = sampler.records(np.arange(640, 704))
  sampler.resume(640, sampler.used(640))
  after = sampler.records(np.arange(640, 704))
  np.testing.assert_array_equal(before[1], after[1])


def test_a_segment_with_other_weights_continues_each_source_from_its_uses():
  old = mix((0.3, 0.7), (40, 90))
  used = old.used(640)
  new = mix((0.5, 0.5), (40, 90))
  new.resume(640, used)
  np.testing.assert_array_equal(new.used(640), used)
  positions = np.arange(640, 640 + 2000)
  sources = new.sources(positions)
  assert abs((sources == 1).mean() - 0.5) < 0.001
  _, indices = new.records(positions)
  # source 0 continues its own order where the old mixture left it
  expected = old.samplers[0].records(np.arange(used[0], used[0] + 5))[1]
  np.testing.assert_array_equal(indices[sources == 0][:5], expected)


def test_each_process_reads_its_own_share_of_the_global_stream_on_any_count():
  sizes, schedule = (64, 96), Schedule((0.25, 0.75))
  samplers = [Sampler(num_records=n, seed=k) for k, n in enumerate(sizes)]

  def stream(processes: int, block: int, batches: int):
    """The global batches of `processes` processes of batch `block`, in process order."""
    per = [MixSampler(schedule, samplers, [0, 64], p, processes, block) for p in range(processes)]
    out = []
    for k in range(batches):
      positions = np.arange(k * block, (k + 1) * block)
      out += [np.stack([p.sources(positions), p.records(positions)[1]]) for p in per]
    return np.concatenate(out, axis=1)

  one = stream(1, 64, 8)
  np.testing.assert_array_equal(stream(2, 32, 8), one)  # the same global batches
  np.testing.assert_array_equal(stream(4, 8, 16), one[:, :512])
  first = one[1][one[0] == 0][: sizes[0]]  # one epoch of each source between the processes
  assert sorted(first.tolist()) == list(range(sizes[0]))


def test_a_batchs_plan_says_each_slots_source_and_a_record_of_that_source():
  sampler = mix((0.3, 0.7), (50, 7))
  for first in (0, 64, 640, 10**9):
    positions = np.arange(first, first + 64)
    _, indices, sources = sampler.planned(positions)
    np.testing.assert_array_equal(sources, sampler.sources(positions))
    assert np.all(np.where(sources == 0, indices < 50, (indices >= 50) & (indices < 57)))
