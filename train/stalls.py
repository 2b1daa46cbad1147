"""When this process itself did not run: a thread that wakes every `TICK_S` and records how
late it woke. A SIGSTOP, a paused VM, a swap storm or a long collection pause freezes every
thread, so the lateness is the stall; the other hosts, waiting in a collective for this one,
wake on time. Each log window takes the longest (`Watchdog.take`) into process 0's log
(`train.podview`). The thread calls nothing of JAX's: it may outlive the run harmlessly.
"""

from __future__ import annotations

import threading
import time

TICK_S = 0.5
# Named from here: far above a loaded host's scheduling delays (at most 0.074 s late over 120 s
# on 2 cores at load 12-18, 2026-11-29), far below the heartbeat timeout (60 s by default),
# past which the run loses the process and `train.supervise` names it instead.
STALL_S = 5.0


class Watchdog:
  """The longest time this process did not run since the last `take`, and the step it was
  at (`step`: set by the training loop). A context manager: the thread runs within it."""

  def __init__(self, tick_s: float = TICK_S):
    self.tick_s, self.step = tick_s, 0
    self._longest = (0.0, 0)  # seconds, step
    self._lock, self._stop = threading.Lock(), threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True, name="train-stalls")

  def __enter__(self) -> Watchdog:
    self._thread.start()
    return self

  def __exit__(self, *_) -> None:
    self._stop.set()
    self._thread.join()

  def _watch(self) -> None:
    due = time.monotonic() + self.tick_s
    while not self._stop.wait(max(0.0, due - time.monotonic())):
      now = time.monotonic()
      with self._lock:
        if now - due > self._longest[0]:
          self._longest = (now - due, self.step)
      due = now + self.tick_s

  def take(self) -> tuple[float, int]:
    """(seconds, step) of the longest stall since the last call, and starts anew."""
    with self._lock:
      longest, self._longest = self._longest, (0.0, self.step)
    return longest


def line(process: int | None, seconds: float, step: int) -> str:
  """What process 0's log says of a stall (`process` None: the only process)."""
  who = "this process" if process is None else f"process {process}"
  tail = "" if process is None else ": the others waited for it"
  return (
    f"{who} did not run for {seconds:.1f} s around step {step} (stopped or starved of CPU){tail}"
  )
