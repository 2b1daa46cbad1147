"""The read-ahead under a request budget: reads in flight grow past what the latency measured
at open needs only while throughput grows with them, and storage's "slow down" (429, 503,
...) is read again after a backoff and halves them.

The controller (`pipeline.storage.budget.Controller`) is fed made-up throughput, one figure per
window, as the read stage measures it; the retries (`pipeline.storage.remote.retry`) run with a fake
sleep, then in the read stage on real shards whose reads storage refuses now and then.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

import pipeline
from pipeline import dataset
from pipeline.stages import read
from pipeline.storage import remote
from pipeline.storage.budget import Controller
from tests.conftest import take


def run(control: Controller, throughput, windows: int, floor=2, ceiling=40) -> list[int]:
  """The depths `control` chooses over `windows` windows, each window's throughput being
  `throughput(depth)` at the depth it ran at."""
  depths = []
  for _ in range(windows):
    depths.append(control.depth)
    control.update(throughput(control.depth), floor, ceiling)
  return depths


def test_reads_in_flight_grow_while_throughput_grows_with_them_and_settle_where_it_stops():
  control = Controller(2)
  depths = run(control, lambda d: 100.0 * min(d, 6), 60)  # latency-bound up to depth 6
  assert depths[:6] == [2, 3, 5, 9, 17, 9]  # steps double while they pay; 17 did not
  assert depths[6:24] == [9] * 4 + [8] * 4 + [7] * 4 + [6] * 4 + [5, 6]  # one less, while
  assert depths[-30:].count(6) >= 28  # it serves as well: 5 did not; a try now and then


def test_under_a_cap_reads_in_flight_stay_at_the_floor_with_fewer_and_fewer_tries():
  control = Controller(2)
  depths = run(control, lambda d: 250.0, 200)  # storage serves 250/s however many wait
  assert set(depths) == {2, 3}  # never a spiral: one step above the floor at most
  tries = [i for i, d in enumerate(depths) if d == 3]
  gaps = np.diff(tries).tolist()  # each try that did not pay waits twice as long for the next
  assert gaps[:4] == [6, 10, 18, 34] and set(gaps[4:]) == {34}  # up to 32 windows
  assert control.state == "holding"


def test_a_climb_on_a_throughput_that_grew_by_itself_is_undone():
  windows = iter(range(1000))
  depths = run(Controller(2), lambda d: 250.0 * (1 + 0.1 * min(next(windows), 3)), 60)
  assert max(depths) == 17 and depths[-20:].count(2) >= 18  # back at the floor


def test_noise_below_the_gain_does_not_move_the_depth():
  rng = np.random.default_rng(0)
  control = Controller(3)
  depths = run(control, lambda d: 1000.0 * (1 + rng.uniform(-0.02, 0.02)), 100, floor=3)
  assert max(depths) <= 4 and depths[-20:].count(3) >= 18


def test_the_floor_and_the_ceiling_bound_the_depth():
  control = Controller(2)
  assert run(control, lambda d: 100.0 * d, 30, ceiling=5)[-1] == 5  # more would still pay
  assert control.update(500.0, floor=8, ceiling=12) == 8  # a faster rate raised the floor


def test_a_slow_down_halves_the_depth_below_the_floor_until_steps_pay_again():
  control = Controller(8)
  assert control.slowed() == 4 and control.slowed() == 2
  assert set(run(control, lambda d: 250.0, 60, floor=8)) <= {2, 3}  # still capped: stays
  climbed = run(control, lambda d: 100.0 * d, 60, floor=8)  # the cap lifted
  assert climbed[:6] == [2, 3, 5, 9, 17, 33] and climbed[-1] == 40  # up to the ceiling


@pytest.mark.parametrize(
  "error",
  [
    type("HttpError", (Exception,), {"code": 429})("Too Many Requests"),
    RuntimeError("UNAVAILABLE: Retry policy exhausted in ReadObjectRangeRequest"),
    RuntimeError("RESOURCE_EXHAUSTED: rate limit exceeded"),
    OSError(errno.EAGAIN, "Resource temporarily unavailable"),
    OSError("An error occurred (SlowDown) when calling the GetObject operation"),
    RuntimeError("HTTP status code 503: backend error"),
  ],
)
def test_slow_downs_are_read_again_after_a_growing_backoff(error):
  answers = [error, error, error, [b"record"]]
  slept, told = [], []

  def read():
    answer = answers.pop(0)
    if isinstance(answer, Exception):
      raise answer
    return answer

  assert remote.retry(read, "gs://b/ds/shard-0", lambda: told.append(1), slept.append) == [
    b"record"
  ]
  assert len(told) == 3 and len(slept) == 3  # each retry told the controller
  for attempt, wait in enumerate(slept):  # 1, 2, 4 s, each times 0.5-1.5 (jitter)
    base = remote.BACKOFF_S * 2**attempt
    assert 0.5 * base <= wait <= 1.5 * base


def test_storage_that_keeps_saying_slow_down_is_one_line_naming_the_shard():
  def read():
    raise RuntimeError("UNAVAILABLE: 503 Service Unavailable\nmore lines of detail")

  slept = []
  with pytest.raises(remote.RemoteStorageError) as e:
    remote.retry(read, "gs://b/ds/shard-0", sleep=slept.append)
  assert len(slept) == remote.SLOW_DOWN_ATTEMPTS - 1
  assert str(e.value).startswith(
    "cannot read gs://b/ds/shard-0: storage kept asking to slow down (RuntimeError: UNAVAILABLE"
  )
  assert "\n" not in str(e.value) and "performance.max_requests_per_s" in str(e.value)


def test_other_errors_are_not_read_again():
  for error in (
    RuntimeError("cannot read shard-0 records [429, 503]...: DATA_LOSS: checksum mismatch"),
    FileNotFoundError("gs://b/ds/shard-0"),
  ):
    calls = []

    def read(error=error, calls=calls):
      calls.append(1)
      raise error

    assert not remote.slow_down(error)
    with pytest.raises(type(error)):
      remote.retry(read, "shard-0", sleep=pytest.fail)
    assert len(calls) == 1


class Refusing:
  """A shard read (`ShardedSource.read_shard` or `read_range`) that storage refuses with a
  503 every `every`-th time; counts the refusals."""

  def __init__(self, read, every: int):
    self.read, self.every, self.calls, self.refused = read, every, 0, 0

  def __call__(self, *args):
    self.calls += 1
    if self.calls % self.every == 0:
      self.refused += 1
      raise OSError("HTTP status code 503: Service Unavailable (please slow down)")
    return self.read(*args)


@pytest.mark.parametrize("order", ["global", "blocks"])
def test_batches_are_served_exactly_through_slow_downs_and_each_retry_is_counted(
  digits_dir, order, monkeypatch
):
  monkeypatch.setattr(remote, "BACKOFF_S", 0.001)
  perf = dict(num_workers=0, record_cache_mb=0)
  spec = pipeline.Spec.of(
    digits_dir, batch_size=16, image_size=16, order=order, block_records=16, performance=perf
  )
  expected = take(iter(dataset.chain(dataset.build(spec))), 20)
  st = dataset.build(spec)
  source = st.read.source
  name = "read_shard" if order == "global" else "read_range"
  refusing = Refusing(getattr(source, name), every=3)
  setattr(source, name, refusing)
  if st.read.ranges is not None:
    st.read.ranges.read_range = refusing
  got = take(iter(dataset.chain(st)), 20)
  for a, b in zip(expected, got):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  assert refusing.refused >= 5 and st.read.stats.retries == refusing.refused
  assert f"{refusing.refused:,} read again after a slow-down" in read.requests(st.read)


def test_behind_a_request_cap_the_reads_ahead_do_not_spiral(storage_rig, photos_dir):
  perf = dict(num_workers=0, record_cache_mb=0)
  with storage_rig.mount(photos_dir, latency_ms=20, requests_per_s=100) as m:
    spec = pipeline.Spec.of(
      str(m.path), batch_size=8, image_size=32, order="global", seed=1, performance=perf
    )
    st = dataset.build(spec)
    floor, it = st.read.bounds()[0], iter(dataset.chain(st))
    depths = [st.read.depth() for _ in take_each(it, 40)]
    in_flight = m.stats()["max_in_flight"]
  assert st.read.bounds()[1] == 8 * floor  # room to grow, but the reads queue: no spiral
  assert max(depths) <= 2 * floor and in_flight <= 2 * floor * 8 + 2  # (+ a footer's reads)


def take_each(it, n: int):
  for _ in range(n):
    yield next(it)
