"""`AheadIterDataset`: a Grain step that starts its work on the next elements before they
are asked for, and hands them out in order.

A stage is two calls: `start(element)` submits the element's work to the stage's own
threads and returns at once; `finish(started)` waits for it and returns the result. The
iterator keeps up to `stage.depth()` elements started (asked again as it runs, so the depth
may follow measured latency; until the first element is handed out, that one alone, so that
the first batch does not share the cores with work for later ones; while it finishes, a
parent that is itself a stage ahead starts its next ones, so the first batch's decode overlaps
the next batches' reads), and its state is its
parent's state after the element it yielded last: work started ahead is discarded on
`set_state`, so a resumed stream is the stream. Reads (`pipeline.stages.read`) and decoding
(`pipeline.stages.decode`) are such stages; their work runs on `Threads`, a pool each process
makes on first use.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import threading
import time
from typing import Any, Protocol

import grain

from pipeline.stages.stats import Recorder, annotation


class Threads:
  """A thread pool started on first use in each process: a stage holding one pickles to
  Grain's worker processes as its size and name (and the `Recorder` its tasks are timed in,
  as `stage`, once `timed` is called)."""

  def __init__(self, size: int, name: str, timed: tuple[Recorder, str] | None = None):
    self.size, self.name, self._timed = size, name, timed
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()

  def __getstate__(self):
    return {"size": self.size, "name": self.name, "timed": self._timed}

  def __setstate__(self, state):
    self.__init__(state["size"], state["name"], state["timed"])

  def timed(self, recorder: Recorder, stage: str) -> None:
    """Each task's running time is added to `recorder` as `stage`'s."""
    self._timed = (recorder, stage)

  def submit(self, fn, *args) -> concurrent.futures.Future:
    if self._pool is None:
      with self._lock:
        if self._pool is None:
          self._pool = concurrent.futures.ThreadPoolExecutor(
            self.size, thread_name_prefix=self.name
          )
    if self._timed is not None:
      return self._pool.submit(_timed, self._timed, fn, *args)
    return self._pool.submit(fn, *args)


def _timed(timed: tuple[Recorder, str], fn, *args):
  t, cpu = time.perf_counter(), time.thread_time()
  try:
    with annotation(timed[1]):
      return fn(*args)
  finally:
    timed[0].task(timed[1], time.perf_counter() - t, cpu_s=time.thread_time() - cpu)


class Stage(Protocol):
  def depth(self) -> int:
    """How many elements to keep started."""

  def start(self, element: Any) -> Any:
    """Submits the work of `element`; returns without waiting for it."""

  def finish(self, started: Any) -> Any:
    """Waits for the work `start` returned and gives the stage's output."""


class AheadIterDataset(grain.IterDataset):
  """`stage` applied to each element of `parent`, up to `stage.depth()` elements ahead;
  `timed`: the `Recorder` and stage name its hand-outs are counted in."""

  def __init__(
    self, parent: grain.IterDataset, stage: Stage, timed: tuple[Recorder, str] | None = None
  ):
    super().__init__(parent)
    self.stage, self.timed = stage, timed

  def __iter__(self) -> grain.DatasetIterator:
    return AheadIterator(self._parent.__iter__(), self.stage, self.timed)

  def __str__(self) -> str:
    return f"AheadIterDataset({type(self.stage).__name__})"


class AheadIterator(grain.DatasetIterator):
  def __init__(self, parent: grain.DatasetIterator, stage: Stage, timed=None):
    super().__init__(parent)
    self.stage, self._timed = stage, timed
    self._started: collections.deque = collections.deque()  # (started, parent state after)
    self._state = copy.deepcopy(parent.get_state())
    self._exhausted = False
    self._handed = False  # an element handed out since the start or the last set_state

  def _fill(self) -> None:
    most = max(1, self.stage.depth()) if self._handed else 1
    while not self._exhausted and len(self._started) < most:
      try:
        element = next(self._parent)
      except StopIteration:
        self._exhausted = True
        return
      state = copy.deepcopy(self._parent.get_state())
      self._started.append((self.stage.start(element), state))

  def __next__(self) -> Any:
    self._fill()
    if not self._started:
      raise StopIteration
    started, state = self._started.popleft()
    if self._handed:
      self._fill()  # keep the pipe full while this element finishes
    elif isinstance(self._parent, AheadIterator):
      self._parent._fill()  # the first alone here; the stage before starts its next ones
    queued = len(self._started)
    t = time.perf_counter()
    out = self.stage.finish(started)
    if self._timed is not None:
      self._timed[0].handed(self._timed[1], time.perf_counter() - t, queued)
    self._state, self._handed = state, True
    return out

  def get_state(self) -> dict:
    return copy.deepcopy(self._state)

  def set_state(self, state: dict) -> None:
    self._started.clear()  # work started for the old position is dropped
    self._exhausted, self._handed = False, False
    self._parent.set_state(state)
    self._state = copy.deepcopy(self._parent.get_state())
