"""Timeline of pipeline work: which worker ran which stage on which element, and when.

Stages wrap their work in `Recorder.span(stage, element)`; `draw` turns the events into
one row of bars per worker over time, like the tf.data guide's `draw_timeline`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import threading
import time
from collections.abc import Hashable, Iterator, Sequence

import matplotlib
from matplotlib import figure, patches


@dataclasses.dataclass(frozen=True)
class Event:
  """One piece of work: `stage` ran on `worker` from `start` to `end` (perf_counter s)."""

  stage: str
  worker: str
  start: float
  end: float
  element: Hashable | None = None


class Recorder:
  """Thread-safe event sink; Grain's deep copies of a pipeline share one recorder.

  Workers are named after their thread (Grain's long thread names shortened) plus a
  number, so two threads with the same name get two rows.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._events: list[Event] = []
    self._workers: dict[tuple[int, str], str] = {}
    self._per_name: collections.Counter[str] = collections.Counter()

  def __deepcopy__(self, memo) -> Recorder:
    return self  # `multithread_prefetch` deep-copies datasets; keep reporting here.

  def _worker(self) -> str:
    thread = threading.current_thread()
    key = (thread.ident or 0, thread.name)
    if key not in self._workers:
      name = _short_name(thread.name)
      self._per_name[name] += 1
      self._workers[key] = name if name == "main" else f"{name} {self._per_name[name]}"
    return self._workers[key]

  def add(self, stage: str, start: float, end: float, element: Hashable | None = None):
    """Records work done by the calling thread between `start` and `end`."""
    with self._lock:
      self._events.append(Event(stage, self._worker(), start, end, element))

  @contextlib.contextmanager
  def span(self, stage: str, element: Hashable | None = None) -> Iterator[None]:
    """Times the enclosed block as one event of `stage` on `element`."""
    start = time.perf_counter()
    try:
      yield
    finally:
      self.add(stage, start, time.perf_counter(), element)

  def events(self) -> list[Event]:
    """A copy of the events so far, in the order they ended."""
    with self._lock:
      return list(self._events)


def _short_name(thread_name: str) -> str:
  """'grain-thread-prefetch-ThreadPrefetchDatasetIterator(...)' -> 'grain-thread-prefetch'."""
  if thread_name == "MainThread":
    return "main"
  name = thread_name.split("(")[0].strip(" -_")
  return re.sub(r"-[A-Z]\w*$", "", name) or thread_name


def draw(events: Sequence[Event], path: str | os.PathLike[str], title: str) -> None:
  """Draws one row per worker, one colored bar per event, time from the first event, to a
  picture at `path` (PNG; the suffix picks the format).

  Workers are ordered by when they first started work; colors follow stage order of
  first appearance.
  """
  if not events:
    raise ValueError(f"no events to draw for {title!r}")
  origin = min(e.start for e in events)
  workers = list(dict.fromkeys(e.worker for e in sorted(events, key=lambda e: e.start)))
  stages = list(dict.fromkeys(e.stage for e in sorted(events, key=lambda e: e.start)))
  colors = matplotlib.colormaps["tab10"]
  end = max(e.end for e in events) - origin

  fig = figure.Figure(figsize=(12, 1.2 + 0.45 * len(workers)))  # no pyplot: no global state
  ax = fig.subplots()
  bars = collections.defaultdict(list)
  for e in events:
    bars[(e.worker, e.stage)].append((e.start - origin, max(e.end - e.start, end * 1e-4)))
  for (worker, stage), spans in bars.items():
    row = len(workers) - 1 - workers.index(worker)
    # Bar edges would hide dense rows.
    ax.broken_barh(
      spans,
      (row + 0.1, 0.8),
      color=colors(stages.index(stage) % 10),
      edgecolor="black",
      linewidth=0.3 if len(spans) < 300 else 0,
    )
  ax.set_yticks([row + 0.5 for row in range(len(workers))], workers[::-1])
  ax.set_ylim(0, len(workers))
  ax.set_xlim(0, end * 1.01)
  ax.set_xlabel("time (s)")
  ax.grid(axis="x", linestyle=":", color="gray")
  ax.set_title(title)
  handles = [patches.Patch(color=colors(i % 10), label=s) for i, s in enumerate(stages)]
  ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
