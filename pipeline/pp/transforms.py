"""A dataset's image work: the fused head's settings (`pipeline.image.augment.Head`) from the
augment and decoding groups, and the ops after it, from `pp=` (its head merged into those
settings) or `ops=` / `batch_ops=`."""

from __future__ import annotations

import dataclasses

from pipeline import pp as pp_lib
from pipeline.image import augment as augment_lib
from pipeline.options import Augment
from pipeline.spec import Spec


def transforms(spec: Spec, num_classes: int) -> tuple[augment_lib.Head, tuple, tuple]:
  """(head, image ops, batch ops): the built-in head and the ops after it, pp's merged in."""
  aug, image_size, group = spec.augment, spec.image_size, spec.transforms
  ops, batch_ops = group.ops, group.batch_ops
  if group.pp is not None:
    aug, image_size, ops, batch_ops = _merge_pp(
      group.pp, num_classes, spec.train, image_size, aug, ops, batch_ops
    )
  image_size = 224 if image_size is None else image_size
  if (ops or batch_ops) and group.pp is None:
    context = dict(image_size=image_size, num_classes=num_classes)
    ops = pp_lib.build(ops, "image", **context)
    batch_ops = pp_lib.build(batch_ops, "batch", **context)
  head = augment_lib.Head(
    image_size=image_size,
    train=spec.train,
    area_range=aug.area_range,
    aspect_range=aug.aspect_range,
    flip=aug.flip,
    crop_fraction=aug.eval_fraction(image_size),
    bicubic=aug.interpolation == "bicubic",
    crop=aug.crop,
    eval_order=aug.eval_order,
    min_object_covered=aug.min_object_covered,
    flax_center=aug.crop_padding is not None,
    dct_scaling=spec.decoding.dct_scaling,
    fast_dct=spec.decoding.fast_dct,
  )
  return head, ops, batch_ops


def _merge_pp(pp, num_classes, train, image_size, aug, ops, batch_ops):
  """`pp`'s head settings merged into `aug` and its ops; any setting it conflicts with is an
  error naming both."""
  if ops or batch_ops:
    raise ValueError(
      "pass either pp= or ops= / batch_ops=: a pp string holds the ops (name yours in it "
      "after pipeline.pp.registry.register)"
    )
  compiled = pp_lib.compile(pp, num_classes=num_classes, image_size=image_size)
  if compiled.train != train:
    head = "an inception-crop (train)" if compiled.train else "a resize_small|central_crop (eval)"
    raise ValueError(
      f"pp {pp!r} has {head} head but train={train}: pass train={compiled.train} "
      "(train also decides shuffle, repeat and the eval mask)"
    )
  if image_size is not None and image_size != compiled.image_size:
    raise ValueError(
      f"image_size={image_size} but pp {pp!r} makes {compiled.image_size}: leave image_size out"
    )
  defaults = Augment()
  for field, value in compiled.augment.items():
    mine = getattr(aug, field)
    if mine != getattr(defaults, field) and mine != value:
      raise ValueError(
        f"augment.{field}={mine!r} conflicts with pp {pp!r}, which sets {field}={value!r}: "
        "set it in one place"
      )
  aug = dataclasses.replace(aug, **compiled.augment)
  return aug, compiled.image_size, compiled.image_ops, compiled.batch_ops
