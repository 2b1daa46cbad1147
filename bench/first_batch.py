"""Where the time from `make_dataset` to the first batch in hand goes, by phase.

`Timeline` wraps, for one run, the functions the loader's start goes through and notes when
each returns: the split opened (manifest, shards checked and opened), the read probe, the
rest of the plan (order, memory, stages), the Grain chain made and its iterator; then batch
0's reads (its read stage's start to the end of its reads), its decode (start to the last
decode task's end) and the hand-off (from there to the batch in the caller's hand). Imports
are not counted (they happen before). The phases follow one another, so they sum to the
first batch's time; batch 0's reads and decode overlap other batches' work, which is counted
in the phase it delays.
"""

from __future__ import annotations

import contextlib
import time

from pipeline.catalog import split as split_lib
from pipeline.stages import decode as decode_lib
from pipeline.stages import read as read_lib
from pipeline.storage import fetch

PHASES = ("open", "probe", "plan", "chain", "first reads", "decode", "hand-off")


class Timeline:
  """The first batch's phases (`PHASES`), in seconds, of the run inside `patched()`."""

  def __init__(self):
    self.marks: dict[str, float] = {}

  def mark(self, name: str) -> None:
    self.marks.setdefault(name, time.perf_counter())

  def _wrap(self, obj, name: str, after=None, before=None):
    """obj.name, noting `before` (on its first call) and `after` (on its first return)."""
    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
      if before:
        self.mark(before)
      out = fn(*args, **kwargs)
      if after:
        self.mark(after(args, out) if callable(after) else after)
      return out

    return fn, wrapped

  @contextlib.contextmanager
  def patched(self):
    """Notes the phases of the loader made and started inside."""
    timeline = self

    def load(stage, batch, *args):
      out = load.fn(stage, batch, *args)
      if batch.index == 0:
        timeline.marks["decode"] = time.perf_counter()  # the last of batch 0's tasks to end
      return out

    def read_finish(stage, started):
      out = read_finish.fn(stage, started)
      if started[0].index == 0:
        timeline.mark("first reads")
      return out

    load.fn = decode_lib.DecodeImages.load
    read_finish.fn = read_lib.ReadRecords.finish
    saved = [
      (split_lib, "open", *self._wrap(split_lib, "open", after="open")),
      (fetch, "probe", *self._wrap(fetch, "probe", after="probe")),
      (decode_lib.DecodeImages, "load", load.fn, load),
      (read_lib.ReadRecords, "finish", read_finish.fn, read_finish),
    ]
    for obj, name, _, new in saved:
      setattr(obj, name, new)
    try:
      yield self
    finally:
      for obj, name, old, _ in saved:
        setattr(obj, name, old)

  def phases(self, start: float, planned: float, chained: float, end: float) -> dict:
    """Seconds per phase: `start` (make_dataset called), `planned` (its stages made),
    `chained` (the Grain chain and its iterator made), `end` (the first batch in hand)."""
    m = self.marks
    points = [start, m["open"], m["probe"], planned, chained, m["first reads"], m["decode"], end]
    points = [max(points[: k + 1]) for k in range(len(points))]  # monotone, for safety
    return {name: round(b - a, 4) for name, a, b in zip(PHASES, points, points[1:])}


def line(phases: dict, total: float, cpu_s: float | None = None) -> str:
  """The phases in one line, as `bench throughput` prints them (`cpu_s`: the process's CPU
  to the first batch, all its threads)."""
  parts = ", ".join(f"{name} {s * 1e3:.0f}" for name, s in phases.items())
  cpu = f", {cpu_s:.3f} s of CPU" if cpu_s is not None else ""
  return f"first batch {total:.3f} s{cpu} (ms: {parts})"
