"""The outermost iterator of `make_dataset`: a state you can trust, and the skip count.

A state is a batch position, tagged with the stream it indexes (seed, dataset and its shard
list, order, layout) and with its global position: a state of another stream is refused,
and a train stream's state continues on another process count or batch size at the same
global position (`pipeline.order.elastic`), or is refused in one line where it cannot. A state
that went through a pytree checkpoint comes back with 0-d numpy arrays for its integers
(which Grain accepts and then mis-counts), so states are normalized to plain Python values
and checked against the shape of this iterator's own state before Grain sees them. The number
of records skipped under `on_error="skip"` travels with each batch (also out of worker
processes) and is summed here: `iterator.skipped`, and `get_state()["skipped"]`. So do the
counters of the process that made it (`pipeline.stages.stats`): `iterator.stats()` holds every
process's latest. `stop_after(n)` ends the stream n batches after where it stands (a run's
remaining steps after a resume, in this stream's batches): its plan stage plans none past them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import grain
import numpy as np
from grain._src.python.dataset.transformations.source import RangeMapDataset

from pipeline.host import lifecycle
from pipeline.order import elastic
from pipeline.order.elastic import StateError
from pipeline.stages import stats
from pipeline.stages.finish import SKIPPED_KEY

__all__ = ["BatchIndices", "StateError", "StreamIterDataset", "plain", "stats_of", "stop_after"]


class BatchIndices(RangeMapDataset):
  """The batch indices a stream plans, 0 to `most` - 1, whose end `end_at` brings nearer for
  iterators made after it (each takes its length when made)."""

  def __init__(self, most: int):
    super().__init__(0, most)
    self.most = most

  def end_at(self, stop: int | None) -> None:
    """Indices up to `stop` (None or past `most`: `most`) for the iterators made from now."""
    super().__init__(0, self.most if stop is None else min(stop, self.most))


class StreamIterDataset(grain.IterDataset):
  """Passes batches through; tags, validates and restores iterator states; keeps each
  process's stage counters (`recorder`: this process's; `read`: its read stage, for storage's),
  printed every `stats_every_s`. `plan`: the plan stage's step (a `stats.Timed` `PlanBatches`),
  whose order a block-order state saved on another process count resumes (`Sampler.resumed`)."""

  def __init__(
    self,
    parent: grain.IterDataset,
    stream: dict,
    recorder: stats.Recorder | None = None,
    stats_every_s: float | None = None,
    read=None,
    plan: stats.Timed | None = None,
    batches: BatchIndices | None = None,
  ):
    super().__init__(parent)
    self._stream, self._recorder, self._every, self._read = stream, recorder, stats_every_s, read
    self._plan, self._batches = plan, batches

  def __iter__(self) -> grain.DatasetIterator:
    recorder = self._recorder or stats.Recorder()
    parent = self._parent.__iter__()
    it = StreamIterator(parent, self._stream, recorder, self._every, self._read)
    it.source, it.batches = self._parent, self._batches
    sampler = self._plan and self._plan.fn.sampler
    if sampler and sampler.blocks is not None and sampler.global_order:
      it.plan = self._plan
    return it

  def __str__(self) -> str:
    return "StreamIterDataset"


class StreamIterator(grain.DatasetIterator):
  def __init__(self, parent, stream: dict, recorder: stats.Recorder, every_s, read=None):
    super().__init__(parent)
    self._stream, self._recorder, self._every, self._read = stream, recorder, every_s, read
    self._snapshots: dict[int, np.ndarray] = {}  # pid -> the latest counters of that process
    self._since: dict[int, np.ndarray] | None = None  # the snapshots of the last `stats()`
    self._printed = time.monotonic()
    self.skipped = 0
    self.plan = None  # where a block-order state of another count resumes
    self.source = self.batches = None  # what a fresh parent is made of; the indices it plans
    self._handed = 0  # batches since this iterator was made or set

  def __next__(self) -> dict[str, np.ndarray]:
    t = time.perf_counter()
    with stats.annotation("handoff"):
      batch = next(self._parent)
    self._recorder.handed("handoff", time.perf_counter() - t)
    self._handed += 1
    self.skipped += int(batch.pop(SKIPPED_KEY))
    snapshot = batch.pop(stats.STATS_KEY, None)
    if snapshot is not None:
      self._snapshots[int(snapshot[0, 0])] = snapshot
    if self._every and time.monotonic() - self._printed >= self._every:
      self._printed = time.monotonic()
      print(f"pipeline stats:\n{self.stats().table()}", file=sys.stderr, flush=True)
    return batch

  def stats(self) -> stats.Stats:
    """Each stage's figures in this process and in every worker process, and storage's, over
    the interval since the previous call (the first: since the start)."""
    main = os.getpid()
    now = {**self._snapshots, main: self._recorder.snapshot(self._read)}
    out = stats.collect(now, main, self._stream["batch_size"], since=self._since)
    self._since = now
    return out

  def get_state(self) -> dict:
    inner = self._parent.get_state()
    position = elastic.batches_done(inner) * elastic.global_batch(self._stream)
    state = {**inner, "stream": self._stream, "skipped": self.skipped, "position": position}
    resumed = self.plan and self.plan.fn.sampler.resumed
    return {**state, "resumed": [list(s) for s in resumed]} if resumed else state

  def set_state(self, state: dict) -> None:
    state = plain(state)
    if not isinstance(state, dict):
      raise StateError(f"an iterator state is a dict, not {type(state).__name__}")
    position = state.get("position", 0)
    if not isinstance(position, int) or position < 0:
      raise StateError(f"iterator state: 'position' must be a count, got {position!r}")
    template = self._parent.get_state()
    sampler = self.plan and self.plan.fn.sampler
    inner = elastic.resize(state, self._stream, template, sampler)
    skipped = state.get("skipped", 0)
    if not isinstance(skipped, int) or skipped < 0:
      raise StateError(f"iterator state: 'skipped' must be a count, got {skipped!r}")
    _check_like(inner, template, "state")
    if self.plan:
      self._replan(elastic.resumed(state, self._stream))
    self._parent.set_state(inner)
    self.skipped, self._handed = skipped, 0

  def stop_after(self, num_batches: int) -> None:
    """Ends the stream `num_batches` batches after its position (its start, or the state just
    set), where it ends already if sooner: the plan stage plans none past them, so no stage
    reads past them. Call it before the stream's first batch; closing it undoes the cut."""
    if not isinstance(num_batches, int) or num_batches < 0:
      raise ValueError(f"stop_after takes a count of batches, got {num_batches!r}")
    if self._handed:
      raise ValueError("stop_after ends a stream before its first batch; this one has begun")
    if self.batches is None:
      raise ValueError(f"{self} plans no batch indices of its own: it cannot stop after a count")
    state = self._parent.get_state()
    self.batches.end_at(elastic.batches_done(state) + num_batches)
    self._fresh_parent()
    self._parent.set_state(state)

  def close(self) -> None:
    if self.batches is not None:
      self.batches.end_at(None)
    super().close()

  def _fresh_parent(self) -> None:
    """Reads from a fresh iterator of the chain: worker processes took the plan and the batch
    indices when they started, threads may have planned ahead."""
    old, self._parents = self._parent, (self.source.__iter__(),)
    old.close()

  def _replan(self, history: tuple) -> None:
    """Sets the plan's order to its block order resumed after `history` (`Sampler.resumed`),
    then reads from a fresh iterator of the chain."""
    sampler = dataclasses.replace(self.plan.fn.sampler, resumed=history)
    if sampler == self.plan.fn.sampler:
      return
    self.plan.fn = dataclasses.replace(self.plan.fn, sampler=sampler)
    self._fresh_parent()


def stats_of(it: grain.DatasetIterator) -> stats.Stats:
  """`stats()` of the `make_dataset` stream `it` holds (a `device_prefetch` iterator, say)."""
  streams = [x for x in lifecycle.iterators(it) if isinstance(x, StreamIterator)]
  if not streams:
    raise ValueError(f"{it} holds no make_dataset stream: it has no stage stats")
  return streams[0].stats()


def stop_after(it: grain.DatasetIterator, num_batches: int) -> None:
  """`StreamIterator.stop_after` of the `make_dataset` stream `it` holds."""
  streams = [x for x in lifecycle.iterators(it) if isinstance(x, StreamIterator)]
  if not streams:
    raise ValueError(f"{it} holds no make_dataset stream: it cannot stop after a count")
  streams[0].stop_after(num_batches)


def plain(value: Any) -> Any:
  """`value` with numpy scalars and 0-d arrays as Python values, arrays as lists."""
  if isinstance(value, dict):
    return {plain(k): plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain(v) for v in value]
  if isinstance(value, (np.ndarray, np.generic)):
    return plain(value.tolist())
  return value


def _check_like(value: Any, template: Any, where: str) -> None:
  """Raises StateError unless `value` has the keys and value kinds of `template`."""
  if isinstance(template, dict):
    if not isinstance(value, dict):
      raise StateError(f"iterator {where} must be a dict, got {value!r:.80}")
    if template and set(value) != set(template):
      raise StateError(
        f"iterator {where} has keys {sorted(map(str, value))}, this dataset's "
        f"states have {sorted(map(str, template))}"
      )
    for k in value:
      _check_like(value[k], template.get(k, value[k]), f"{where}[{k!r}]")
  elif isinstance(template, list):
    if not isinstance(value, list):
      raise StateError(f"iterator {where} must be a list, got {value!r:.80}")
    for k, v in enumerate(value):
      _check_like(v, template[k] if k < len(template) else v, f"{where}[{k}]")
  elif isinstance(template, bool) or isinstance(value, bool):
    if type(value) is not type(template):
      raise StateError(f"iterator {where} must be {type(template).__name__}, got {value!r}")
  elif isinstance(template, int):
    if not isinstance(value, int) or value < 0:
      raise StateError(f"iterator {where} must be a non-negative integer, got {value!r:.80}")
