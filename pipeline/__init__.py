"""A Grain input pipeline that keeps TPUs and GPUs fed when training Flax models with JAX.

    ds = pipeline.make_dataset("data/photos", "train", batch_size=128)   # grain.IterDataset
    ds = pipeline.device_prefetch(ds, mesh)                             # global jax.Arrays
"""

from pipeline.dataset import BadRecordError, make_dataset
from pipeline.manifest import Manifest
from pipeline.options import Augment, Performance
from pipeline.manifest import load as load_manifest
from pipeline.records import Keys

__version__ = "0.1.0"
__all__ = ["Augment", "BadRecordError", "Keys", "Manifest", "Performance", "device_prefetch",
           "load_manifest", "make_dataset", "normalize_images"]


def __getattr__(name: str):
  """Device feeding imports JAX, so it loads on first use (workers stay light)."""
  if name in ("device_prefetch", "normalize_images"):
    from pipeline import device

    return getattr(device, name)
  raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
