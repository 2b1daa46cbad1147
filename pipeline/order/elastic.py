"""Elastic states: a train stream's position as a global record count, which any process
count continues from.

Under global sharding (`pipeline.order.sampling`) batch k of every process together holds global
positions [k*G, (k+1)*G), G = shard_count * batch_size. A state's "position" is k*G; set into
m processes with batch b' it is batch k' = k*G / (m*b') of each of them: the same global
batches from there on, whatever m is (the state of any process of the saving run will do).
Owned shards (`sharding="shards"`) and padded eval streams order records per process count:
their states resume on the same count only. The block order (each process its own blocks)
resumes on another count by its layouts (`resumed`): the records of the interrupted epoch that
no process read, dealt out in blocks to the new processes (`rest_of_epoch`), which then read
the next epochs as a fresh run on their count (other global batches than the uninterrupted
run's). A mixture's sources do so each on its own (`pipeline.mixing.stream`), their layouts
naming also the windows they were read in (a source added or removed changes the others').
A position means the same records only over the same shard list (names, record counts, order)
and contents: a state names it (`shard_list`, with the manifest's digests), and one of another
list, or of shards converted again under the same names, is refused; a state saved before
states named it resumes with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re

import numpy as np
from absl import logging

from pipeline.order.shuffle import epoch_key

LAYOUT = ("shard_index", "shard_count", "batch_size")  # what may change between runs
PER_COUNT = (  # stream tags whose order depends on the process count: (key, what, what does not)
  ("sharding", "owned shards (sharding='shards')", "sharding='records', the default,"),
  ("remainder", "a padded eval stream", "sharding='records', the default,"),
  ("order", "the block order (each process reads its own blocks)", "order='global'"),
)
OWN_CHECKS = ("shards", "order")  # checked apart from the rest, each refused with its own fix
OUTER = ("stream", "skipped", "position", "resumed")  # a state's keys around the chain's own


class StateError(ValueError):
  """An iterator state that does not belong to this dataset, in one line: `what`, then the
  `fix` where it is a setting: the make_dataset keywords to pass (`passes`) or the global
  batch to keep (`global_batch`), so a caller can name them in its own terms."""

  def __init__(
    self, what: str, fix: str = "", passes: dict | None = None, global_batch: int | None = None
  ):
    super().__init__(f"{what}: {fix}" if fix else what)
    self.what, self.fix = what, fix
    self.passes = passes or {}
    self.global_batch = global_batch


def shard_list(shards: list[tuple[str, int, str | None]]) -> dict:
  """The stream tag of a split's (shard file name, records, contents digest or None) list:
  its length and digests of it in order and as a set (a reordered list keeps the set's), and
  of the shards' contents where every shard has a digest (the manifest's sha256)."""

  def digest(items) -> str:
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]

  listed = [[name, count] for name, count, _ in shards]
  tag = {"count": len(listed), "order": digest(listed), "set": digest(sorted(listed))}
  contents = [sha for _, _, sha in shards]
  if all(contents):
    tag["contents"] = digest(contents)
  return tag


def order_tag(sampler) -> str:
  """The stream tag of `sampler`'s block order (a state continues only in the same)."""
  b, hosts = sampler.blocks, sampler.dealt_to
  shares = " share every epoch" * (hosts > 1)
  shares += ", cut at records" * b.cut_shares(hosts, sampler.shuffle)
  return (
    f"blocks of {b.block_records}, each process its own{shares}, in rounds over windows of "
    f"{b.window_blocks}"
  )


def global_batch(stream: dict) -> int:
  """Records in one step's batches of all processes together."""
  return stream["shard_count"] * stream["batch_size"]


def batches_done(inner: dict) -> int:
  """The batches a Grain chain's state has yielded: a thread-prefetch state
  ({"next_index"}) or a worker-process one (the workers' round-robin interleave)."""
  if set(inner) == {"next_index"}:
    return inner["next_index"]
  return sum(s["next_index"] for s in inner["iterators_in_use_states"])


def at_batch(template: dict, k: int) -> dict:
  """`template`, a fresh state of this chain, moved to batch `k` (the inverse of
  `batches_done`: worker w of W yields batches w, w + W, ...)."""
  if set(template) == {"next_index"}:
    return {"next_index": k}
  workers = len(template["iterators_in_use_states"])
  return {
    **template,
    "next_index_in_cycle": k % workers,
    "iterators_in_use_states": [
      {"next_index": max(0, (k - w + workers - 1) // workers)} for w in range(workers)
    ],
  }


def resize(state: dict, stream: dict, template: dict, sampler=None) -> dict:
  """The inner state that continues `state` (saved with stream tag `state["stream"]`, maybe on
  another process count or batch size) in the stream tagged `stream`; `template` is this
  chain's own state; `sampler`, its order where a block-order state saved on another count
  continues in it (with `resumed`). Raises StateError, in one line, where it cannot."""
  saved = state.get("stream") or {}
  inner = {k: v for k, v in state.items() if k not in OUTER}
  order = {k: v for k, v in stream.items() if k not in LAYOUT + OWN_CHECKS}
  if {k: v for k, v in saved.items() if k not in LAYOUT + OWN_CHECKS} != order or not saved:
    diff = ", ".join(
      f"{k} {saved.get(k)} in the state, {v} here" for k, v in order.items() if saved.get(k) != v
    )
    raise StateError(
      f"iterator state of another stream ({diff or saved}): resume with the same seed, "
      "sharding, train/eval and dataset"
    )
  _check_shards(saved, stream)
  same = all(saved[k] == stream[k] for k in ("shard_count", "batch_size"))
  was = f"{saved['shard_count']} process(es) x batch {saved['batch_size']}"
  now = f"{stream['shard_count']} x {stream['batch_size']}"
  for key, what, keep in PER_COUNT:
    if key == "order" and sampler is not None:
      continue  # the block order continues in `sampler`: Sampler.resumed
    if not same and key in stream and key in saved:
      raise StateError(
        f"iterator state of {what} saved on {was} cannot continue on {now}: its order "
        f"depends on the process count; resume on {saved['shard_count']} process(es) with "
        f"batch {saved['batch_size']} ({keep} continues on any count)"
      )
  if not same and sampler is not None and "order" in saved and "order" in stream:
    on_saved = dataclasses.replace(
      sampler, shard_index=0, shard_count=saved["shard_count"], block=saved["batch_size"]
    )
    _check_order(saved, {**stream, "order": order_tag(on_saved)})
  else:
    _check_order(saved, stream)
  if same:
    return inner  # every process is at the same batch: any process's state will do
  if sampler is not None and "order" in stream:
    return at_batch(template, 0)  # at the start of the rest of the epoch (`Sampler.resumed`)
  if "position" not in state:
    raise StateError(
      f"iterator state saved on {was} has no global position (an older pipeline's): resume "
      f"it on {saved['shard_count']} process(es) with batch {saved['batch_size']}"
    )
  position, size = state["position"], global_batch(stream)
  if position % size:
    raise StateError(
      f"iterator state at global position {position} (saved on {was}) cannot continue on {now}",
      f"{position} is not a multiple of the global batch {size}; keep the global batch "
      f"{global_batch(saved)}",
      global_batch=global_batch(saved),
    )
  return at_batch(template, position // size)


def _check_shards(saved: dict, stream: dict) -> None:
  """Raises StateError unless the state was saved over this stream's shard list."""
  was, now = saved.get("shards"), stream["shards"]
  if was is None:
    logging.warning(
      "iterator state saved before states named their shard list: resumed as is, which "
      "repeats and skips records unless the split's shards are the ones it was saved with"
    )
    return
  listed = {"count", "order", "set"}
  if not isinstance(was, dict) or not listed <= set(was) <= listed | {"contents"}:
    raise StateError(f"iterator state: 'shards' is no shard list, got {was!r:.80}")
  if all(was[k] == now[k] for k in listed):
    if "contents" not in was or "contents" not in now or was["contents"] == now["contents"]:
      return  # the same list, and the same contents where both name them
    raise StateError(
      f"iterator state of other shard contents (the same {now['count']} names and record "
      "counts, other bytes: converted again?): its positions are records of the shards it "
      "was saved with; resume over those or start without the state"
    )
  if was["count"] != now["count"]:
    what = f"{was['count']} shard(s) in the state, {now['count']} here"
  elif was["set"] == now["set"]:
    what = f"the same {now['count']} shards in another order"
  else:
    what = f"{now['count']} shards, other names or record counts"
  raise StateError(
    f"iterator state of another shard list ({what}): its positions are records of the "
    "shards it was saved with; keep their list (the manifest's, in its order) or start "
    "without the state"
  )


def _check_order(saved: dict, stream: dict) -> None:
  """Raises StateError, naming the keywords that continue it, unless the state was saved
  in this stream's order (global, or blocks of the same size and windows)."""
  was, now = saved.get("order"), stream.get("order")
  if was == now:
    return
  if was is None or now is None:
    name, other = ("blocks", "global") if was else ("global", "blocks")
    raise StateError(
      f"iterator state of order={name!r} cannot continue in order={other!r}",
      f"pass order={name!r}",
      {"order": name},
    )
  (records, window), (records_now, window_now) = _blocks_of(was), _blocks_of(now)
  passes = {"block_records": records} if records != records_now else {}
  passes.update({"window_blocks": window} if window != window_now else {})
  if not passes:  # the same blocks and windows, dealt out as an earlier version did
    raise StateError(
      f"iterator state of an earlier block order (order {was} in the state, {now} here): its "
      "positions are that order's records; start without the state"
    )
  fix = "pass " + " and ".join(f"{k}={v!r}" for k, v in passes.items())
  batch, batch_now = global_batch(saved), global_batch(stream)
  raise StateError(
    f"iterator state of order='blocks' in blocks of {records} records and windows of "
    f"{window} blocks (global batch {batch}) cannot continue in blocks of {records_now} and "
    f"windows of {window_now} (global batch {batch_now})",
    fix,
    passes,
  )


def _blocks_of(order: str) -> tuple[int, int]:
  """(block_records, window_blocks) of a stream's "order" tag."""
  records, window = re.findall(r"\d+", order)
  return int(records), int(window)


def resumed(state: dict, stream: dict) -> tuple[tuple[int, int, int], ...]:
  """The layouts (processes, batch, batches read) a block-order stream resumed on another
  process count was read in before (`Sampler.resumed`): `state`'s, and its own layout where
  it was saved on another count or batch."""
  history = layouts(state.get("resumed", []))
  saved = state["stream"]
  if all(saved[k] == stream[k] for k in ("shard_count", "batch_size")):
    return history
  inner = {k: v for k, v in state.items() if k not in OUTER}
  layout = (saved["shard_count"], saved["batch_size"], batches_done(inner))
  logging.warning(
    f"iterator state of the block order saved on {saved['shard_count']} process(es) x batch "
    f"{saved['batch_size']} continues on {stream['shard_count']} x {stream['batch_size']}: "
    "the interrupted epoch's other records once each, in blocks, in other global batches "
    "than the uninterrupted run's; the next epochs as a fresh run on this count"
  )
  return (*history, layout)


def layouts(earlier) -> tuple[tuple[int, ...], ...]:
  """A state's list of earlier layouts (`resumed`), checked: each (processes, batch, batches
  read), and in a mixture's the blocks of its windows then (`Sampler.resumed`)."""
  if not isinstance(earlier, list) or not all(
    isinstance(s, list)
    and len(s) in (3, 4)
    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in s)
    and s[0] > 0
    and s[1] > 0
    and (len(s) == 3 or s[3] > 0)
    for s in earlier
  ):
    raise StateError(f"iterator state: 'resumed' is no list of layouts, got {earlier!r:.80}")
  return tuple(tuple(s) for s in earlier)


@functools.lru_cache(maxsize=16)
def rest_of_epoch(sampler) -> tuple[int, np.ndarray]:
  """(epoch, records): the epoch a block-order `sampler` resumed on this process count
  (`sampler.resumed`) was interrupted in, and this process's part of its records that no
  earlier layout read, in blocks (`Blocks.rest`), which its stream takes first."""
  epoch, read = _interrupted(sampler)
  unread = np.ones(sampler.num_records, bool)
  unread[read] = False
  left = np.flatnonzero(unread)
  key = epoch_key(sampler.seed, epoch) if sampler.shuffle else None
  return epoch, sampler.blocks.rest(left, key, sampler.shard_index, sampler.shard_count)


@functools.lru_cache(maxsize=16)
def _interrupted(sampler) -> tuple[int, np.ndarray]:
  """(epoch, records read of it) after the layouts of `sampler.resumed`: the epoch the last
  layout's slowest process was in, the records of it that its processes read, and the earlier
  layouts' back to the last one that began before that epoch (one that resumed into an earlier
  epoch reads this one whole, as a fresh run does)."""
  history = sampler.resumed
  n, b, k = history[-1][:3]
  epoch = min(int(s.records(np.array([k * b]))[0][0]) for s in _layout(sampler, len(history) - 1))
  bases = [
    _interrupted(dataclasses.replace(sampler, resumed=history[:j]))[0]
    for j in range(1, len(history))
  ]
  since = max([j for j, base in enumerate(bases, 1) if base < epoch], default=0)
  read = [np.zeros(0, np.int64)]
  for j in range(since, len(history)):
    _, b, k = history[j][:3]
    for s in _layout(sampler, j):
      lo, hi = s.epoch_start(epoch), min(k * b, s.epoch_start(epoch + 1))
      epochs, records = s.records(np.arange(lo, max(lo, hi)))
      read.append(records[epochs == epoch])
  return epoch, np.concatenate(read)


def _layout(sampler, j: int) -> list:
  """The processes' samplers of layout `j` of `sampler.resumed` (in its windows, if it names
  them: a mixture's source)."""
  n, b, _, *windows = sampler.resumed[j]
  history = sampler.resumed[:j]
  blocks = sampler.blocks
  if windows:
    blocks = dataclasses.replace(blocks, window_blocks=windows[0])
  return [
    dataclasses.replace(
      sampler, shard_index=p, shard_count=n, block=b, blocks=blocks, resumed=history
    )
    for p in range(n)
  ]
