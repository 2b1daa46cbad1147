"""`Spec`: every setting of one dataset, checked once, in one frozen object.

`make_dataset(data_dir, split, **keywords)` is `chain(build(Spec.of(data_dir, split,
**keywords)))`; its keywords are the spec's fields, the `transforms` group's spread out
(`SIGNATURE`, which is also `make_dataset`'s signature).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from collections.abc import Mapping, Sequence

from pipeline.catalog import records
from pipeline.options import Augment, Decoding, Performance, check_types, coerce
from pipeline.order import blocks


@dataclasses.dataclass(frozen=True)
class Transforms:
  """The ops group: what runs on the images after the built-in head (see `Spec`)."""

  pp: str | None = None
  ops: str | Sequence = ()
  batch_ops: str | Sequence = ()
  features: Mapping | None = None


# make_dataset keywords that are gone: the one line that refuses each, with the new spelling.
REMOVED = {
  "normalize": (
    "make_dataset(normalize=) is gone: normalize on the device (pipeline.input(..., "
    "normalize='minus_one_one'), device_prefetch(normalize=...) or pipeline.normalize_images "
    "in your step; uint8 moves 4x fewer bytes), or on the host with "
    "batch_ops='value_range(-1, 1)' (in a pp string: value_range)"
  ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
  """What `make_dataset` makes: batches {"image": uint8[B, S, S, 3], "label": int32[B]}
  (+ "mask": bool[B] in eval). Made by `Spec.of`, which checks the values and fills in the
  defaults that follow from `train` (shuffle, drop_remainder, num_epochs) and the groups.

  Args:
    data_dir: a converted dataset (holds manifest.json), or a TFDS ArrayRecord build read in
      place (its version folder, or "tfds://name[:version]"); local, gs:// or mounted.
    split: the manifest split to read.
    batch_size: examples per batch *of this process*.
    train: random-resized-crop + flip, shuffled, repeated forever, drops the remainder;
      otherwise centre crop, in order, one epoch, padded with mask=False examples (label -1,
      zero pixels) so every process yields the same number of batches and every record counts
      exactly once.
    seed: seeds the shuffle (a new order per epoch) and the augmentation.
    image_size: S, the side of the square output images (default 224, or pp's size).
    num_epochs: None repeats forever (train default); eval default is 1.
    num_batches: the batches this process takes at most (a run of known length: its steps);
      the stream ends there, and its read-ahead never reads past it. None: no limit.
    shuffle: default `train`.
    drop_remainder: drop the last partial batch of a finite stream (default: train).
    shard_index, shard_count: this process's slice; default jax.process_index()/count(). A
      train stream's global batches, and its states, are the same on any count
      (`pipeline.order.elastic`).
    sharding: "records" (default): the global shuffle is dealt out to the processes, each its
      block of every global batch;
      "shards": each process owns whole shards (shard k: process k % shard_count) and
      shuffles within them, so a host reads and caches 1/shard_count of the dataset (the
      shuffle then never mixes records across processes' shards).
    order: the shuffle's order (it changes which records a batch holds). "global": every
      record anywhere, one storage request per image. "blocks": runs of `block_records`
      consecutive records of a shard (default: 16, 32, ... until a run holds 2 MiB), the
      blocks shuffled and taken in windows of `window_blocks` blocks (default: 4 global
      batches' worth), each batch one record of each of as many blocks (`pipeline.order.blocks`):
      a process reads only its own blocks, one request each, and a batch's label mix is a
      global shuffle's. None (default): "blocks" for a bucket (gs:// or a FUSE mount such as
      gcsfuse), "global" on local disk.
    keys: feature keys of the records (default: the manifest's).
    on_error: "raise" (default) or "skip" a bad record; errors name the shard and record.
      The skip count is `iterator.skipped`, also in `get_state()["skipped"]`.
    verify: what is checked of the shards at open against the manifest: "size" (regular
      files, sizes, record counts), "sha256" (also every byte), or "none".
    augment: the crop, flip and resize filter (`pipeline.Augment` or a dict of its fields).
    transforms (keywords pp, ops, batch_ops, features of `make_dataset`):
      pp: a big_vision pp string, e.g. "decode_jpeg_and_inception_crop(224)|flip_lr|
        value_range(-1, 1)|onehot(1000, key='label', key_result='labels')|keep('image',
        'labels')": its decode/crop/resize/flip ops set the fused head (train must match
        its head, augment may not set what it sets), the rest become ops and batch ops (so
        not with ops= / batch_ops=); see `pipeline.pp`.
      ops: your per-image ops, run after the built-in head on each image with a per-example
        RNG: callables or a pp string without a head ("color_jitter(0.4)"; `pipeline.pp`);
        batch_ops: the same for whole batches (e.g. "permuted_mixup(0.2)").
      features: extra Example features to pass through, {name: key or pipeline.Feature}.
      Batches leave the host as uint8: normalize on the device (`pipeline.input`'s
      normalize=, `pipeline.normalize_images`), or on the host with `value_range`.
    decoding: the decoded-image cache, DCT scaling and the fast IDCT (`pipeline.Decoding` or
      a dict of its fields): faster decoding that changes pixels (never records, order or
      labels), by the amounts its docstring gives.
    performance: threads, worker processes, prefetch, read-ahead, the record cache, request
      budget, deadline (`pipeline.Performance` or a dict of its fields); never changes what a
      batch holds.
      Threads and workers left None are chosen for this host (`pipeline.host.parallelism`; 2
      cores: no workers, a thread per core), the read-ahead for the read latency measured at
      open (`pipeline.stages.read`), and the choice is printed once.
  """

  data_dir: str | os.PathLike
  split: str = "train"
  batch_size: int
  train: bool = True
  seed: int = 0
  image_size: int | None = None
  # the epochs
  num_epochs: int | None = None
  num_batches: int | None = None
  shuffle: bool | None = None
  drop_remainder: bool | None = None
  # the sharding
  shard_index: int | None = None
  shard_count: int | None = None
  sharding: str = "records"
  # the order
  order: str | None = None
  block_records: int | None = None
  window_blocks: int | None = None
  # the records
  keys: records.Keys | None = None
  on_error: str = "raise"
  verify: str = "size"
  # the groups (`of` makes augment, decoding and performance their classes)
  augment: Augment | Mapping | None = None
  transforms: Transforms = Transforms()
  decoding: Decoding | Mapping | None = None
  performance: Performance | Mapping | None = None

  @classmethod
  def of(cls, data_dir, split: str = "train", **keywords) -> Spec:
    """The spec of `make_dataset(data_dir, split, **keywords)`, checked and completed."""
    for name in (n for n in keywords if n in REMOVED):
      raise TypeError(REMOVED[name])
    for name in (n for n in keywords if n in ("weights", "labels")):
      raise TypeError(
        f"{name}= is a mixture's: give data_dir as {{name: data_dir}} (`pipeline.mixture`)"
      )
    unknown = sorted(set(keywords) - set(SIGNATURE.parameters))
    if unknown:
      raise TypeError(f"make_dataset() got an unexpected keyword argument {unknown[0]!r}")
    try:
      bound = SIGNATURE.bind(data_dir, split, **keywords)
    except TypeError as e:
      raise TypeError(f"make_dataset() {e}") from None
    bound.apply_defaults()
    values = bound.arguments
    group = {f.name: values.pop(f.name) for f in dataclasses.fields(Transforms)}
    if values["on_error"] not in ("raise", "skip"):
      raise ValueError(f"on_error must be 'raise' or 'skip', not {values['on_error']!r}")
    check_types(cls, "", values)
    if values["batch_size"] < 1:
      raise ValueError(f"batch_size must be positive, got {values['batch_size']}")
    if values["sharding"] not in ("records", "shards"):
      raise ValueError(f"sharding must be 'records' or 'shards', not {values['sharding']!r}")
    if values["order"] not in (None, "global", "blocks"):
      raise ValueError(f"order must be 'global', 'blocks' or None, not {values['order']!r}")
    sizes = [1 if values[k] is None else values[k] for k in ("block_records", "window_blocks")]
    blocks.Blocks((), *sizes)  # checks them
    if values["num_batches"] is not None and values["num_batches"] < 1:
      raise ValueError(f"num_batches must be None or positive, got {values['num_batches']}")
    if values["image_size"] is not None and values["image_size"] < 1:
      raise ValueError(f"image_size must be positive, got {values['image_size']}")
    train = values["train"]
    if values["shuffle"] is None:
      values["shuffle"] = train
    if values["drop_remainder"] is None:
      values["drop_remainder"] = train
    if values["num_epochs"] is None and not train:
      values["num_epochs"] = 1
    values["augment"] = coerce(Augment, values["augment"])
    values["decoding"] = coerce(Decoding, values["decoding"])
    values["performance"] = coerce(Performance, values["performance"])
    return cls(**values, transforms=Transforms(**group))


def _signature() -> inspect.Signature:
  """make_dataset's parameters: data_dir and split, then the spec's other fields as
  keywords, the transforms group's in its place."""
  hints = {**typing.get_type_hints(Spec), **typing.get_type_hints(Transforms)}
  params = []
  for field in dataclasses.fields(Spec):
    for f in dataclasses.fields(Transforms) if field.name == "transforms" else (field,):
      kind = inspect.Parameter.KEYWORD_ONLY
      if f.name in ("data_dir", "split"):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
      default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
      params.append(inspect.Parameter(f.name, kind, default=default, annotation=hints[f.name]))
  return inspect.Signature(params)


SIGNATURE = _signature()
