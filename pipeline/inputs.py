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
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

import grain
import jax

from pipeline import dataset, device, mixture
from pipeline.catalog.manifest import Manifest
from pipeline.host.memory import Split
from pipeline.spec import Spec
from pipeline.stages import plan, stats
from pipeline.stages.stream import stats_of


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
  if mixture.is_mixture(data_dir):  # `pipeline.mixture`: a training stream, no remainder
    fields = mixture.stages(data_dir, split, batch_size=batch_size, train=train, **keywords)
    stages = dataset.Stages(**fields)
    drop_remainder = True
  else:
    spec = Spec.of(data_dir, split, batch_size=batch_size, train=train, **keywords)
    stages, drop_remainder = dataset.build(spec), spec.drop_remainder
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
    global_batch_size=global_batch_size,
    batch_size=batch_size,
    train=train,
    stream=stages.stream,
    repeat=repeat,
  )


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
  `memory` the loader's share of `performance.memory_mb` as planned (`pipeline.host.memory`);
  `stream` what decides its order (seed, order, sharding, shards: the tag its states carry).
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
    global_batch_size: int,
    batch_size: int,
    train: bool,
    stream: dict,
    repeat: bool = False,
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
    self.global_batch_size = global_batch_size
    self.batch_size = batch_size
    self.train = train
    self.stream = stream
    self.repeat = repeat
    self._it: grain.DatasetIterator | None = None

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
      self.reset()
      if self.repeat:
        return next(self._live())
      raise StopIteration(
        ENDED.format(
          steps=self.steps_per_epoch, batch=self.global_batch_size, examples=self.num_examples
        )
      ) from None

  def reset(self) -> None:
    """Drops the current pass; the next batch is the first of a new one."""
    if self._it is not None:
      self._it.close()
      self._it = None

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
