"""A request budget: at most `per_s` storage requests a second from this process.

A bucket starts near 5,000 reads/s and answers more with 429/503 errors; a process that
stays under its share never meets them. `RequestBudget.take(n)` returns when n more requests
fit: each request's turn comes 1/per_s after the one before it (a token bucket holding one
token), so requests wait in the read stage's I/O threads, not at the bucket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RequestBudget:
  """At most `per_s` requests a second; `take` waits for the turn of the next `n`."""

  def __init__(
    self,
    per_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
  ):
    if per_s <= 0:
      raise ValueError(f"performance.max_requests_per_s must be > 0, got {per_s}")
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
