"""A request budget: at most `per_s` storage requests a second from this process, and the
read-ahead policy: a controller that keeps no more reads in flight than pay.

A bucket starts near 5,000 reads/s and answers more with 429/503 errors; a process that
stays under its share never meets them. `RequestBudget.take(n)` returns when n more requests
fit: each request's turn comes 1/per_s after the one before it (a token bucket holding one
token), so requests wait in the read stage's I/O threads, not at the bucket.

Behind storage that caps requests without saying so, reads queue there, their measured
latency grows, and Little's law on it asks for more reads in flight, which queue longer: a
spiral (576 reads in flight through the rig at 20 ms and 250 requests/s). `Controller` keeps
the depth that the latency measured at open needs (its floor) and climbs above it, in steps
that double while they pay, only while the throughput measured over a window grows with
it (by `GAIN`); a step that brings less goes back down and the next try waits twice as long
(hysteresis). After a step up that did not pay it tries one batch less, and keeps going
down while one less serves as well (a climb on noise is undone). A "slow down" from
storage halves the depth (below the floor too, until steps pay again). `ReadAhead` is the
read stage's policy: the floor by Little's law, the controller above it, within the bytes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

GAIN = 0.05  # a step up in depth stays if the throughput grows by this much
HOLD = 2  # windows at a depth before the next step up; doubled after each that did not pay
MAX_HOLD = 32
HEADROOM = 2.0  # reads in flight per Little's law, times this: latency and rate vary
WINDOW = 4  # batches (at least the depth) per throughput measurement of the controller
GROWTH = 8  # the controller's depth: at most this times the floor


MIN_PER_S = 1 / 60  # the lowest request cap: one request a minute


def check_rate(per_s: float | None) -> None:
  """Raises ValueError, in one line, unless `per_s` is a usable request cap (None or inf:
  no cap)."""
  if per_s is not None and not per_s > 0:
    raise ValueError(f"performance.max_requests_per_s must be None or > 0, got {per_s}")
  if per_s is not None and per_s < MIN_PER_S:
    raise ValueError(
      f"performance.max_requests_per_s={per_s} would wait {1 / per_s:.3g} s per request: "
      "pass at least 1/60 (one request a minute), or None or inf for no cap"
    )


def reads_in_flight(rate_per_s: float, latency_s: float) -> int:
  """Reads to keep in flight for `rate_per_s` records/s at `latency_s` per read."""
  return max(1, math.ceil(HEADROOM * rate_per_s * latency_s))


class RequestBudget:
  """At most `per_s` requests a second; `take` waits for the turn of the next `n`."""

  def __init__(
    self,
    per_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
  ):
    check_rate(per_s)
    self.per_s, self.clock, self.sleep = per_s, clock, sleep
    self._init_runtime()

  def _init_runtime(self):
    self._lock = threading.Lock()
    self._next = 0.0  # when the next request's turn comes
    self.waited = 0  # takes that had to wait for their turn

  def __getstate__(self):
    return {"per_s": self.per_s}

  def __setstate__(self, state):
    self.__init__(state["per_s"])

  def take(self, n: int = 1) -> None:
    with self._lock:
      now = self.clock()
      turn = max(now, self._next)
      self._next = turn + n / self.per_s
      if turn > now:
        self.waited += 1
    if turn > now:
      self.sleep(turn - now)


class Controller:
  """The read-ahead depth (batches), by hill climbing on the throughput. Pure: `update` is
  fed one measurement per window, so a made-up sequence of them tests it."""

  def __init__(self, depth: int):
    self.depth = depth
    self.state = "holding"  # "growing"/"shrinking": the last step up/down is being judged
    self.hold = 0  # windows left before the next step
    self._wait = HOLD  # windows to hold after a step that did not pay
    self._step = 1  # the last step up; doubled after each that paid (a quick climb)
    self._base = 0.0  # throughput at the depth before the step being judged
    self._down = False  # the next step is one down (after a step up that did not pay)
    self._cut = False  # a slow-down took the depth below the floor

  def update(self, rate: float, floor: int, ceiling: int) -> int:
    """The depth for the next window, given the throughput `rate` of the window just ended
    and the bounds now (`floor`: what the latency measured at open needs; `ceiling`: the
    most it may grow to)."""
    if self.state == "growing" and rate < self._base * (1 + GAIN):
      self.depth -= self._step  # the step did not pay: back down; next, try one less
      self._fail(down=True)
    elif self.state == "growing":  # the step paid: a longer one
      self._grow(rate, ceiling, self._step * 2)
    elif self.state == "shrinking" and rate < self._base * (1 - GAIN):
      self.depth += 1  # one less served less: back up
      self._fail(down=False)
    elif self.state == "shrinking":  # one less served as well: keep it, try one less again
      self.state, self.hold = "holding", HOLD
    elif self.state == "holding" and self.hold > 0:
      self.hold -= 1
    elif self._down and self.depth > floor:
      self.state, self._base = "shrinking", rate
      self.depth -= 1
    else:
      self._grow(rate, ceiling, 1)
    self._cut = self._cut and self.depth < floor
    low = 1 if self._cut else floor
    self.depth = max(low, min(self.depth, max(low, ceiling)))
    return self.depth

  def _grow(self, rate: float, ceiling: int, step: int) -> None:
    self._step, self._down = min(step, ceiling - self.depth), False
    if self._step < 1:  # no room to grow: look again later
      self.state, self.hold = "holding", self._wait
    else:
      self.state, self._base = "growing", rate
      self.depth += self._step
      self._wait = HOLD if step > 1 else self._wait

  def _fail(self, down: bool) -> None:
    self._step, self._wait, self._down = 1, min(MAX_HOLD, self._wait * 2), down
    self.state, self.hold = "holding", self._wait

  def slowed(self) -> int:
    """Storage asked for fewer requests: halve the depth (multiplicative decrease)."""
    self.depth = max(1, self.depth // 2)
    self._cut = True
    self._fail(down=False)
    return self.depth


def depth_bounds(
  rate: float,
  capped: float | None,
  latency_s: float,
  record_bytes: float,
  batch_size: int,
  ahead_bytes: int,
  max_depth: int | None,
) -> tuple[int, int]:
  """(floor, ceiling) of the batches to read ahead (`ReadAhead.bounds`) for `rate` records/s,
  or at most `capped` under a request budget, at `latency_s` a read."""
  if capped is not None:
    rate = min(rate, capped)
  floor = 1 + math.ceil(reads_in_flight(rate, latency_s) / batch_size)
  ceiling = max(1, int(ahead_bytes // max(1.0, record_bytes * batch_size)))
  if capped is not None:
    ceiling = min(ceiling, floor)
  ceiling = min(ceiling, GROWTH * floor, max_depth or ceiling)
  return min(floor, ceiling), ceiling


class ReadAhead:
  """The batches the read stage keeps reading: `Controller`'s depth within `bounds()`.

  reads: the storage side (`pipeline.storage.fetch.Fetcher`: its stats, the latency measured
  at open, the request budget); rate_per_s: the decode rate this process is planned for
  (records/s); ahead_bytes: the most record bytes held by batches read ahead; max_depth:
  `performance.read_ahead`. Picklable: the controller starts anew in each process.
  """

  def __init__(
    self,
    reads,
    *,
    batch_size: int,
    rate_per_s: float,
    ahead_bytes: int,
    max_depth: int | None = None,
  ):
    self.reads, self.batch_size, self.rate_per_s = reads, batch_size, rate_per_s
    self.ahead_bytes, self.max_depth = ahead_bytes, max_depth
    self._init_runtime()

  _RUNTIME = ("control", "_window", "_slowed")

  def _init_runtime(self):
    self._window = (None, 0)  # (when the controller's window began, batches in it)
    self.control = Controller(self.bounds()[0])
    self._slowed = 0  # retries the controller has been told of

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def bounds(self) -> tuple[int, int]:
    """(floor, ceiling) of the batches to keep reading: Little's law for the planned (or
    measured, when higher) rate at the latency measured at open; `GROWTH` times that, within
    the bytes allowed. Both within `performance.read_ahead`, and under a request budget
    within what the budget's rate needs at the latency measured at open."""
    s, latency_s = self.reads.stats, self.reads.opened[0]
    rate, capped = max(self.rate_per_s, s.rate_per_s), self.reads.records_per_s()
    bytes_, most = s.record_bytes, self.max_depth
    return depth_bounds(rate, capped, latency_s, bytes_, self.batch_size, self.ahead_bytes, most)

  def depth(self) -> int:
    """Batches to keep reading: the controller's depth, within `bounds()`'s ceiling."""
    return min(self.control.depth, self.bounds()[1])

  def finished(self, now: float, records: int) -> None:
    """A batch of `records` finished at `now`: feeds the controller a "slow down" at once,
    the throughput (records/s finished) once a window of batches is done."""
    s = self.reads.stats
    begin, done = self._window
    if s.retries > self._slowed:
      self._slowed = s.retries
      self.control.slowed()
      self._window = (now, 0)
    elif begin is None:
      self._window = (now, 0)  # from the first batch on: its reads started all at once
    elif done + 1 >= max(WINDOW, self.control.depth) and now > begin:
      s.rate_per_s = (done + 1) * records / (now - begin)
      self.control.update(s.rate_per_s, *self.bounds())
      self._window = (now, 0)
    else:
      self._window = (begin, done + 1)
