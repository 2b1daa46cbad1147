"""The op contract and the shipped ops under one name, `pipeline.ops` (`pipeline.pp.ops`):
the contract, generators and runners from `contract`, the image ops from `image_ops`, the
batch ops from `batch_ops`. Importing it registers the shipped ops."""

from pipeline.pp.batch_ops import BigVisionMixup, Keep, OneHot, PermutedMixup, ValueRange
from pipeline.pp.contract import (
  MASK_KEY,
  BatchOp,
  ImageOp,
  OpError,
  apply,
  apply_batch,
  batch_rng,
  example_rng,
  example_view,
  reused_example_rng,
  takes_example,
)
from pipeline.pp.image_ops import ColorJitter

__all__ = [
  "MASK_KEY",
  "BatchOp",
  "BigVisionMixup",
  "ColorJitter",
  "ImageOp",
  "Keep",
  "OneHot",
  "OpError",
  "PermutedMixup",
  "ValueRange",
  "apply",
  "apply_batch",
  "batch_rng",
  "example_rng",
  "example_view",
  "reused_example_rng",
  "takes_example",
]
