"""A request budget: at most `per_s` storage requests a second from this process, and a
controller that keeps no more reads in flight than pay.

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
storage halves the depth (below the floor too, until steps pay again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

GAIN = 0.05  # a step up in depth stays if the throughput grows by this much
HOLD = 2  # windows at a depth before the next step up; doubled after each that did not pay
MAX_HOLD = 32


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
