"""A mixture's outermost iterator (`pipeline.mixture`): states that name each source's uses,
restored by name (also with other weights or sources), and per-source counts in `stats()`.

In the block order a source's uses index its own order in one layout (process count, and its
windows: 1/K of the mixture's, K the sources). A state restored in another layout (another
process count, or a source added or removed) resumes each source as one dataset's block order
resumes on another count (`pipeline.order.elastic.rest_of_epoch`): the records of its
interrupted epoch that no process read, once each, in blocks, dealt out to the new processes
in its new windows, then its next epochs as a fresh run reads them; the state then names each
source's earlier layouts (processes, 1, uses, windows) under "resumed".
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np

from pipeline.order import elastic
from pipeline.order.elastic import StateError
from pipeline.order.mixture import MixSampler, Schedule
from pipeline.stages import stats
from pipeline.stages import stream as stream_lib


@dataclasses.dataclass
class Mixture:
  """What the stream of a mixture needs at run time: its names, schedule and sampler."""

  names: list[str]
  schedule: Schedule
  sampler: MixSampler
  workers: int
  digests: dict  # name -> the source's shard list tag (`elastic.shard_list`)
  windows: int | None = None  # the block order: the blocks of all sources' windows together


class MixStreamIterDataset(stream_lib.StreamIterDataset):
  """The outermost iterator of a mixture: states by source name, per-source counts."""

  def __init__(self, parent, *args, mixture: Mixture):
    super().__init__(parent, *args)
    self.mixture = mixture

  def __iter__(self):
    recorder = self._recorder or stats.Recorder()
    it = MixStreamIterator(
      self._parent, self._stream, recorder, self._every, self._read, self.mixture
    )
    it.source, it.batches = self._parent, self._batches
    return it


@dataclasses.dataclass(frozen=True)
class MixStats(stats.Stats):
  """`stats.Stats` with each source's images, their rate and realized share (`sources`:
  (name, images, images/s, weight) rows, since the iterator began or was restored)."""

  sources: tuple = ()

  def table(self) -> str:
    total = max(1, sum(row[1] for row in self.sources))
    lines = [
      f"source {name}: {n} images, {rate:.1f}/s ({n / total:.1%} of the images, weight {w:.1%})"
      for name, n, rate, w in self.sources
    ]
    return "\n".join([super().table(), *lines])


class MixStreamIterator(stream_lib.StreamIterator):
  def __init__(self, dataset, stream, recorder, every_s, read, mixture: Mixture):
    super().__init__(dataset.__iter__(), stream, recorder, every_s, read)
    self._dataset, self.mixture = dataset, mixture
    self.images = np.zeros(len(mixture.names), np.int64)  # per source, since this iterator began
    self._began = None

  def __next__(self) -> dict:
    self._began = self._began or time.perf_counter()
    batch = super().__next__()
    self.images += np.bincount(batch["source"], minlength=len(self.images))
    return batch

  def stats(self) -> MixStats:
    base = super().stats()
    m, seconds = self.mixture, time.perf_counter() - (self._began or time.perf_counter())
    rates = (self.images / max(seconds, 1e-9)).tolist()
    rows = tuple(zip(m.names, self.images.tolist(), rates, m.schedule.weights))
    return MixStats(
      **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, sources=rows
    )

  def get_state(self) -> dict:
    state = super().get_state()
    m = self.mixture
    used = m.sampler.used(state["position"])
    weights = dict(zip(m.names, m.schedule.weights))
    state["mixture"] = {
      "used": dict(zip(m.names, used.tolist())),
      "weights": weights,
      "sources": m.digests,
    }
    resumed = {
      n: [list(x) for x in s.resumed] for n, s in zip(m.names, m.sampler.samplers) if s.resumed
    }
    if resumed:
      state["mixture"]["resumed"] = resumed
    return state

  def set_state(self, state: dict) -> None:
    state = stream_lib.plain(state)
    m = self.mixture
    saved = state.get("mixture") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or not isinstance(saved.get("used"), dict):
      raise StateError(
        "iterator state of a single dataset, not of a mixture: this mixture "
        f"({', '.join(m.names)}) resumes only a mixture's state"
      )
    digests = saved.get("sources", {})
    common = [n for n in m.names if n in digests]
    if not common:
      raise StateError(
        f"iterator state of another mixture (sources {', '.join(digests)}; this one: "
        f"{', '.join(m.names)}): no source in common to continue"
      )
    for n in common:
      if digests[n] != m.digests[n]:
        raise StateError(f"iterator state: source {n!r} holds other shards than when it was saved")
    was = state.get("stream") or {}
    if was.get("seed") != self._stream["seed"]:
      raise StateError(
        f"iterator state of a mixture with seed {was.get('seed')}, this one "
        f"{self._stream['seed']}: resume with the same seed"
      )
    layout = [
      f"{d.get('shard_count')} process(es) x batch {d.get('batch_size')}"
      for d in (was, self._stream)
    ]
    if was.get("order") != self._stream.get("order"):
      said = [tag.get("order") or "the global order" for tag in (was, self._stream)]
      raise StateError(
        f"iterator state of a mixture read in {said[0]}, this one reads in {said[1]}: "
        "resume with the same order= (block_records=, window_blocks=)"
      )
    position = state.get("position")
    if not isinstance(position, int) or position < 0:
      raise StateError(f"iterator state: 'position' must be a count, got {position!r}")
    used = [int(saved["used"].get(n, 0)) for n in m.names]
    moved = m.sampler.local and layout[0] != layout[1]
    samplers, dealt = m.sampler.samplers, []
    if m.sampler.local:
      samplers, used, dealt = _block_orders(m, saved, was, used, moved)
    weights = dict(zip(m.names, m.schedule.weights))
    if saved.get("weights") != weights or dealt:
      added = [n for n in m.names if n not in digests]
      removed = [n for n in digests if n not in m.names]
      weighed = f"(the state's: {_shares(saved.get('weights', {}))})"
      print(
        f"pipeline: mixture resumed at global position {position:,} with weights "
        f"{_shares(weights)} {weighed if saved.get('weights') != weights else '(the same)'}"
        + (f", sources added: {', '.join(added)}" if added else "")
        + (f", removed: {', '.join(removed)}" if removed else "")
        + "; each source continues from its own position"
        + (_dealt(m, dealt, layout, len(digests)) if dealt else ""),
        file=sys.stderr,
        flush=True,
      )
    replanned = samplers != m.sampler.samplers
    m.sampler.resume(0 if moved else position, used, samplers)
    self.images[:], self._began = 0, None
    if m.workers or replanned:  # worker processes (threads) hold (may have planned) the old plan
      old, self._parents = self._parent, (self._dataset.__iter__(),)
      old.close()
    if moved:  # each source from the rest of its interrupted epoch: the stream from batch 0
      outer = {k: v for k, v in state.items() if k in elastic.OUTER}
      template = elastic.at_batch(self._parent.get_state(), 0)
      super().set_state({**template, **outer, "position": 0, "stream": self._stream})
      return
    # the sources checked: the rest as any stream's, from the saved layout (`elastic.resize`)
    layout = {k: was[k] for k in elastic.LAYOUT if k in was}
    super().set_state(
      {**{k: v for k, v in state.items() if k != "mixture"}, "stream": {**self._stream, **layout}}
    )


def _block_orders(m: Mixture, saved: dict, was: dict, used: list, moved: bool) -> tuple:
  """(each source's block order from the state on, its uses there, the sources resumed in
  another layout): where the state was read on another process count (`moved`) or in other
  windows (another number of sources), a source's order resumed after its layouts then
  (`Sampler.resumed`), from use 0; else its own, with the layouts the state names."""
  earlier = saved.get("resumed", {})
  if not isinstance(earlier, dict):
    raise StateError(f"iterator state: mixture 'resumed' is no dict, got {earlier!r:.80}")
  sources = saved.get("sources", {})
  windows = max(1, m.windows // max(1, len(sources)))  # the state's, a source
  samplers, uses, dealt = [], [], []
  for name, own, u in zip(m.names, m.sampler.samplers, used):
    history = earlier.get(name, [])
    if name in sources and (moved or windows != own.blocks.window_blocks):
      history, u = [*history, [was.get("shard_count"), 1, u, windows]], 0
      dealt.append(name)
    samplers.append(dataclasses.replace(own, resumed=elastic.layouts(history)))
    uses.append(u)
  return samplers, uses, dealt


def _dealt(m: Mixture, dealt: list, layout: list, sources: int) -> str:
  """The resume line's part on the sources resumed in another layout."""
  windows = (max(1, m.windows // sources), m.sampler.samplers[0].blocks.window_blocks)
  return (
    f"; {', '.join(dealt)}: read on {layout[0]} in windows of {windows[0]} blocks a source, now "
    f"on {layout[1]} in windows of {windows[1]}: each reads the rest of its interrupted epoch "
    "once, in blocks, in other global batches than the uninterrupted run's, then its next "
    "epochs as a fresh run"
  )


def _shares(weights: dict) -> str:
  return "{" + ", ".join(f"{n}: {w:.3g}" for n, w in weights.items()) + "}"
