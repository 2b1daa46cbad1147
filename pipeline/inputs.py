"""`pipeline.input`: the common case in one call, a split fed to the devices, with its sizes.

    train = pipeline.input("data/imagenet", "train", global_batch_size=1024)
    for step, batch in zip(range(train.steps_per_epoch * 90), train): ...

It divides the global batch over the processes (`pipeline.stages.plan.process_batch_size`), builds
`make_dataset`'s stages + `device_prefetch` and returns an `Input`: a Grain iterator
(checkpoint it with `grain.checkpoint.CheckpointSave(train)`) that knows `num_examples`,
`steps_per_epoch` (the stages' `plan.Sizes`), `num_classes`, `classes`, the `manifest`, and
what the spec made of the images: `image_size` and the `batch_ops` each batch goes through
last, and the `memory` it planned. A finite stream (eval) starts a new pass after each one ends:
each `for` loop is one pass; `repeat=True` runs pass after pass for loops of `next()` calls.
A train and an eval stream share one host's memory budget when the eval one is opened
`beside` the train one:

    val = pipeline.input("data/imagenet", "validation", global_batch_size=1024, beside=train)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, Literal

import grain
import jax

from pipeline import dataset, device, mixture
from pipeline.catalog.manifest import Manifest
from pipeline.host import memory
from pipeline.host.memory import Split
from pipeline.options import Performance, coerce
from pipeline.spec import Spec
from pipeline.stages import plan, stats
from pipeline.stages.stream import stats_of, stop_after


def input(
  data_dir,
  split: str = "train",
  *,
  global_batch_size: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
  train: bool | None = None,
  layout: Literal["global", "pmap"] = "global",
  normalize: device.Normalize = None,
  dtype: Any = None,
  data_axis: str = "data",
  depth: int = 2,
  repeat: bool = False,
  beside: Input | None = None,
  **make_dataset_keywords,
) -> Input:
  """`split` of the dataset in `data_dir` (converted, or a TFDS ArrayRecord build: see
  `make_dataset`) as batches of device arrays.

  Args:
    global_batch_size: examples per step over all processes; each process reads its share.
    mesh, data_axis, layout, depth: where batches go (see `device_prefetch`); default mesh:
      every device on one "data" axis. layout="pmap": [devices, rows per device, ...].
    train: default: the split's name starts with "train". Train streams shuffle, augment
      and repeat, in full batches of "image" and "label"; eval streams are one ordered pass,
      the last batch padded, with a "mask" (1 real, 0 pad) in every batch and label -1 on
      padded rows (a one-hot of zeros, never a correct prediction).
    repeat: an eval stream starts its next pass where one ends instead of raising
      StopIteration (tf.data's `ds.repeat()`, as the Flax ImageNet example's eval): a loop of
      `steps_per_epoch` next() calls per evaluation then sees every example once.
    beside: the stream this one shares the host's memory with (the train stream, for an eval
      stream): unless this one sets its own performance.memory_mb, it plans within what
      `beside`'s plan left of its budget. Where even its least does not fit there, it plans
      within a default budget of its own if `beside`'s was the default; if `beside`'s was
      set, `pipeline.host.memory.BudgetError` refuses in one line.
    normalize, dtype: on the device, `image` becomes (pixels - mean) / std as `dtype`
      ("minus_one_one", "zero_one", "imagenet" or (mean, std) in pixel units); default:
      uint8 as stored.
    **make_dataset_keywords: the rest of `make_dataset`'s keywords (seed, image_size,
      augment, performance, ...), except batch_size, which this derives.
  """
  if "batch_size" in make_dataset_keywords:
    raise TypeError(
      "pipeline.input takes global_batch_size=; the per-process batch_size is derived from it"
    )
  if global_batch_size is None:  # a required keyword; a misspelt one would land in the rest
    near = difflib.get_close_matches("global_batch_size", list(make_dataset_keywords), 1)
    raise TypeError(
      "pipeline.input needs global_batch_size= (examples per step over all processes)"
      + (f"; got {near[0]}=" if near else "")
    )
  train = split.startswith("train") if train is None else train
  where = device.make_layout(mesh, data_axis, layout)
  shard_index, shard_count = where.shard
  batch_size = plan.process_batch_size(global_batch_size, shard_count)
  where.check(batch_size)
  keywords = {"shard_index": shard_index, "shard_count": shard_count, **make_dataset_keywords}
  keywords.update(batch_size=batch_size, train=train)
  memory_mb = coerce(Performance, keywords.get("performance")).memory_mb
  open_ = functools.partial(_stages, data_dir, split)
  if beside is not None and memory_mb is None:
    stages, drop_remainder = _beside(open_, keywords, beside)
  else:
    stages, drop_remainder = open_(keywords)
  # Streams that drop their remainder only ever hold full batches: no mask to add.
  fed = device.device_prefetch(
    dataset.chain(stages),
    mesh,
    data_axis=data_axis,
    depth=depth,
    remainder="drop" if drop_remainder else "pad",
    normalize=normalize,
    dtype=dtype,
    batch_size=batch_size,
    layout=layout,
  )
  return Input(
    fed,
    num_examples=stages.plan.sampler.num_records,
    steps_per_epoch=stages.sizes.steps_per_epoch,
    manifest=stages.manifest,
    image_size=stages.decode.head.image_size,
    batch_ops=stages.finish.batch_ops,
    memory=stages.read.memory,
    memory_mb=memory_mb,
    global_batch_size=global_batch_size,
    batch_size=batch_size,
    train=train,
    stream=stages.stream,
    repeat=repeat,
    spec=stages.spec,
  )


def _stages(data_dir, split: str, keywords: dict) -> tuple[dataset.Stages, bool]:
  """(the stages of `split`, whether they drop the remainder); a mixture's (`pipeline.mixture`)
  are a training stream's, without a remainder."""
  if mixture.is_mixture(data_dir):
    return dataset.Stages(**mixture.stages(data_dir, split, **keywords)), True
  spec = Spec.of(data_dir, split, **keywords)
  return dataset.build(spec), spec.drop_remainder


def _beside(open_, keywords: dict, beside: Input) -> tuple[dataset.Stages, bool]:
  """`open_(keywords)` within what `beside`'s plan left of its budget, or on the terms `input`
  gives for `beside=` where even its least does not fit there."""
  taken = beside.memory.total
  left = max(1, beside.memory.budget - taken)  # a byte at least: the refusal names the least
  perf = coerce(Performance, keywords.get("performance"))
  rest = dataclasses.replace(perf, memory_mb=left / memory.MB)
  try:
    return open_({**keywords, "performance": rest})
  except memory.BudgetError as e:
    if beside.memory_mb is None:  # the default budget: this stream's own, half of what is free now
      return open_(keywords)
    raise memory.BudgetError(
      f"{memory.FLAG}={memory.given(beside.memory_mb)} holds this stream and the one beside it, "
      f"whose plan takes {memory.mb(taken)} MB; the {memory.mb(left)} MB left are below the "
      f"least this stream holds, {memory.mb(e.least)} MB ({e.parts}): raise it, or give this "
      f"stream a {memory.FLAG} of its own",
      e.least,
      e.parts,
    ) from None


ENDED = (
  "end of the eval pass ({steps} batches of {batch}, {examples} examples, padded rows masked "
  "with label -1): loop over it with `for batch in ...:` (each loop one pass), or pass "
  "pipeline.input(..., repeat=True) and call next() steps_per_eval = .steps_per_epoch = {steps} "
  "times per evaluation"
)


class Input(grain.DatasetIterator):
  """Device batches of one split, with the sizes a training loop needs.

  A Grain `DatasetIterator`: `get_state`/`set_state` (and Orbax through
  `grain.checkpoint.CheckpointSave/CheckpointRestore`) save and resume the position. When
  a finite pass ends (StopIteration, whose line says how to loop), the next `next()` or `for`
  loop starts a new pass (with `repeat`, that next batch comes instead of the StopIteration);
  `reset()` starts one at once. `dataset` is the underlying `grain.IterDataset`.
  `image_size` is the side of its square images (the spec's, a pp string's head's, or the
  default); `batch_ops` the ops run on each whole batch (pp's or `batch_ops=`), in order;
  `memory` the loader's share of `performance.memory_mb` as planned (`pipeline.host.memory`),
  `memory_mb` that setting as given (None: the default budget);
  `stream` what decides its order (seed, order, sharding, shards: the tag its states carry);
  `spec` the dataset's `Spec`, its image size resolved (None: a mixture), as
  `pipeline.explain.from_stats` reads it beside `stats()`.
  `stop_after(n)` ends a pass n batches from where it stands: a run's remaining steps.
  """

  def __init__(
    self,
    dataset: grain.IterDataset,
    *,
    num_examples: int,
    steps_per_epoch: int,
    manifest: Manifest,
    image_size: int,
    batch_ops: tuple,
    memory: Split,
    memory_mb: float | None,
    global_batch_size: int,
    batch_size: int,
    train: bool,
    stream: dict,
    repeat: bool = False,
    spec: Spec | None = None,
  ):
    super().__init__()
    self.dataset = dataset
    self.num_examples = num_examples
    self.steps_per_epoch = steps_per_epoch
    self.manifest = manifest
    self.classes = list(manifest.classes)
    self.image_size = image_size
    self.batch_ops = tuple(batch_ops)
    self.memory = memory
    self.memory_mb = memory_mb
    self.global_batch_size = global_batch_size
    self.batch_size = batch_size
    self.train = train
    self.stream = stream
    self.repeat = repeat
    self.spec = spec
    self._it: grain.DatasetIterator | None = None
    self._stop: int | None = None  # stop_after's count, for this pass

  @property
  def num_classes(self) -> int:
    return len(self.classes)

  def _live(self) -> grain.DatasetIterator:
    self._assert_not_closed()
    if self._it is None:
      self._it = self.dataset.__iter__()
    return self._it

  def __next__(self) -> dict:
    it = self._live()
    try:
      return next(it)
    except StopIteration:
      stop = self._stop
      self.reset()
      if stop is not None:
        raise StopIteration(
          f"end of the stream: the {stop} batches stop_after({stop}) asked for"
        ) from None
      if self.repeat:
        return next(self._live())
      raise StopIteration(
        ENDED.format(
          steps=self.steps_per_epoch, batch=self.global_batch_size, examples=self.num_examples
        )
      ) from None

  def reset(self) -> None:
    """Drops the current pass; the next batch is the first of a new one."""
    self._stop = None
    if self._it is not None:
      self._it.close()
      self._it = None

  def stop_after(self, num_batches: int) -> None:
    """Ends this pass `num_batches` batches from where it stands (its start, or the state just
    set, which may count other batches than the run's steps: a state saved at another global
    batch): read-ahead plans none past them. Call it before the first batch and before
    `start_prefetch`; the next pass (`reset`) is whole again."""
    stop_after(self._live(), num_batches)
    self._stop = num_batches

  def get_state(self) -> dict[str, Any]:
    return self._live().get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._live().set_state(state)

  def stats(self) -> stats.Stats:
    """Each stage's figures in this process and its worker processes (`pipeline.stages.stats`)."""
    return stats_of(self._live())

  def start_prefetch(self) -> None:
    self._live().start_prefetch()

  def close(self) -> None:
    self.reset()
    self._closed = True

  def __str__(self) -> str:
    return (
      f"Input({self.num_examples} examples, global batch {self.global_batch_size}, "
      f"{'train' if self.train else 'eval'})"
    )
