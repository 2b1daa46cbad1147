"""A Grain input pipeline that keeps TPUs and GPUs fed when training Flax models with JAX.

ds = pipeline.make_dataset("data/photos", "train", batch_size=128)   # grain.IterDataset
ds = pipeline.device_prefetch(ds, mesh)                             # global jax.Arrays
train = pipeline.input("data/photos", "train", global_batch_size=128)   # both, in one call
ds = pipeline.make_dataset(..., pp="decode_jpeg_and_inception_crop(224)|flip_lr|...")  # big_vision
@pipeline.registry.register("my_op", "image")   # your own op, named in pp strings
print(pipeline.stats_of(it).table())   # every stage, every process, storage requests
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

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
  if name == "Mixup":
    raise AttributeError("pipeline.Mixup is now pipeline.PermutedMixup ('mixup' is big_vision's)")
  raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


# Modules that moved into the role folders (round of 2026-11-27): `import pipeline.sampling`
# and `from pipeline import sampling` keep working, as the same module object, with a
# FutureWarning naming the new path, until version 0.2 removes them.
_MOVED = {
  "ahead": "stages.ahead",
  "augment": "image.augment",
  "blocks": "order.blocks",
  "budget": "storage.budget",
  "cache": "storage.cache",
  "decode": "image.decode",
  "elastic": "order.elastic",
  "errors": "stages.errors",
  "extras": "host.extras",
  "fallback": "image.fallback",
  "features": "pp.features",
  "finish": "stages.finish",
  "guards": "host.guards",
  "handoff": "stages.handoff",
  "images": "stages.decode",
  "lifecycle": "host.lifecycle",
  "manifest": "catalog.manifest",
  "ops": "pp.ops",
  "parallelism": "host.parallelism",
  "plan": "stages.plan",
  "randaugment": "pp.randaugment",
  "ranges": "storage.ranges",
  "reads": "stages.read",
  "records": "catalog.records",
  "registry": "pp.registry",
  "remote": "storage.remote",
  "sampling": "order.sampling",
  "schema": "catalog.schema",
  "shuffle": "order.shuffle",
  "source": "storage.source",
  "stats": "stages.stats",
  "stream": "stages.stream",
  "tfds_folder": "catalog.tfds_folder",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds `pipeline.OLD` for a module now at `pipeline.FOLDER.NEW` and hands out that one."""

  def find_spec(self, fullname, path=None, target=None):
    package, _, name = fullname.rpartition(".")
    if package != "pipeline" or name not in _MOVED:
      return None
    return importlib.util.spec_from_loader(fullname, self)

  def create_module(self, spec):
    new = f"pipeline.{_MOVED[spec.name.rpartition('.')[2]]}"
    warnings.warn(
      f"{spec.name} is now {new}; the old path goes in 0.2", FutureWarning, stacklevel=2
    )
    module = importlib.import_module(new)
    spec.loader_state = module.__spec__
    return module

  def exec_module(self, module):
    """The module ran at its own path already; it keeps that path's spec."""
    module.__spec__ = module.__spec__.loader_state


sys.meta_path.append(_MovedModules())
