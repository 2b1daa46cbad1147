"""Elastic states: a train stream's position as a global record count, which any process
count continues from.

Under global sharding (`pipeline.sampling`) batch k of every process together holds global
positions [k*G, (k+1)*G), G = shard_count * batch_size. A state's "position" is k*G; set into
m processes with batch b' it is batch k' = k*G / (m*b') of each of them: the same global
batches from there on, whatever m is (the state of any process of the saving run will do).
Owned shards (`sharding="shards"`), padded eval streams and the block order (each process
its own blocks) order records per process count: their states resume on the same count only.
"""

from __future__ import annotations

LAYOUT = ("shard_index", "shard_count", "batch_size")  # what may change between runs
PER_COUNT = (  # stream tags whose order depends on the process count: (key, what, what does not)
  ("sharding", "owned shards (sharding='shards')", "sharding='records', the default,"),
  ("remainder", "a padded eval stream", "sharding='records', the default,"),
  ("order", "the block order (each process reads its own blocks)", "order='global'"),
)


class StateError(ValueError):
  """An iterator state that does not belong to this dataset."""


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


def resize(state: dict, stream: dict, template: dict) -> dict:
  """The inner state that continues `state` (saved with stream tag `state["stream"]`, maybe on
  another process count or batch size) in the stream tagged `stream`; `template` is this
  chain's own state. Raises StateError, in one line, where it cannot."""
  saved = state.get("stream") or {}
  inner = {k: v for k, v in state.items() if k not in ("stream", "skipped", "position")}
  order = {k: v for k, v in stream.items() if k not in LAYOUT}
  if {k: v for k, v in saved.items() if k not in LAYOUT} != order or not saved:
    diff = ", ".join(
      f"{k} {saved.get(k)} in the state, {v} here" for k, v in order.items() if saved.get(k) != v
    )
    raise StateError(
      f"iterator state of another stream ({diff or saved}): resume with the same seed, "
      "sharding, train/eval and dataset"
    )
  if all(saved[k] == stream[k] for k in ("shard_count", "batch_size")):
    return inner  # every process is at the same batch: any process's state will do
  was = f"{saved['shard_count']} process(es) x batch {saved['batch_size']}"
  now = f"{stream['shard_count']} x {stream['batch_size']}"
  for key, what, keep in PER_COUNT:
    if key in stream:
      raise StateError(
        f"iterator state of {what} saved on {was} cannot continue on {now}: its order "
        f"depends on the process count; resume on {saved['shard_count']} process(es) with "
        f"batch {saved['batch_size']} ({keep} continues on any count)"
      )
  if "position" not in state:
    raise StateError(
      f"iterator state saved on {was} has no global position (an older pipeline's): resume "
      f"it on {saved['shard_count']} process(es) with batch {saved['batch_size']}"
    )
  position, size = state["position"], global_batch(stream)
  if position % size:
    raise StateError(
      f"iterator state at global position {position} (saved on {was}) cannot continue on "
      f"{now}: {position} is not a multiple of the global batch {size}; keep the global "
      f"batch {global_batch(saved)}"
    )
  return at_batch(template, position // size)
