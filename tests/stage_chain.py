"""The stages of a converted dataset, for the tests that drive one stage over Grain."""

from __future__ import annotations

import grain

from pipeline.dataset import Stages, build
from pipeline.spec import Spec


def stages(data_dir, split: str = "train", **keywords) -> Stages:
  keywords = {"batch_size": 8, "image_size": 32, "shard_index": 0, "shard_count": 1, **keywords}
  return build(Spec.of(data_dir, split, **keywords))


def planned(s: Stages) -> grain.IterDataset:
  """Stage 1 alone: batch index -> its `Batch` plan, as a Grain iterable."""
  ds = grain.MapDataset.range(s.sizes.num_batches).map(s.plan)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
