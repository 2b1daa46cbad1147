"""A Grain input pipeline that keeps TPUs and GPUs fed when training Flax models with JAX.

ds = pipeline.make_dataset("data/photos", "train", batch_size=128)   # grain.IterDataset
ds = pipeline.device_prefetch(ds, mesh)                             # global jax.Arrays
train = pipeline.input("data/photos", "train", global_batch_size=128)   # both, in one call
ds = pipeline.make_dataset(..., pp="decode_jpeg_and_inception_crop(224)|flip_lr|...")  # big_vision
@pipeline.registry.register("my_op", "image")   # your own op, named in pp strings
print(pipeline.stats_of(it).table())   # every stage, every process, storage requests
"""

import importlib

from pipeline import pp
from pipeline.catalog.manifest import Manifest
from pipeline.catalog.manifest import load as load_manifest
from pipeline.catalog.records import Keys
from pipeline.options import Augment, Decoding, Performance
from pipeline.pp import features, ops, randaugment, registry
from pipeline.pp.batch_ops import BigVisionMixup, OneHot, PermutedMixup
from pipeline.pp.features import Feature
from pipeline.pp.image_ops import ColorJitter
from pipeline.spec import Spec
from pipeline.stages.errors import BadRecordError

__version__ = "0.1.0"
__all__ = [
  "Augment",
  "BadRecordError",
  "BigVisionMixup",
  "ColorJitter",
  "Decoding",
  "Feature",
  "Input",
  "Keys",
  "Manifest",
  "OneHot",
  "Performance",
  "PermutedMixup",
  "Source",
  "Spec",
  "device_prefetch",
  "features",
  "input",
  "load_manifest",
  "make_dataset",
  "normalize_images",
  "ops",
  "pp",
  "randaugment",
  "registry",
  "stats_of",
]

_LAZY = {
  "make_dataset": "dataset",
  "device_prefetch": "device",
  "normalize_images": "device",
  "input": "inputs",
  "Input": "inputs",
  "stats_of": "stages.stream",
  "Source": "mixture",
}


def __getattr__(name: str):
  """Names that import Grain or JAX load on first use, so converters and workers stay light."""
  if name in _LAZY:
    return getattr(importlib.import_module(f"pipeline.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
