"""Stage 4, finish (pipeline.stages.finish): a decoded `Batch` -> the batch dict: labels checked
against the manifest's classes, the eval mask, extra features, your ops."""

import numpy as np
import pytest

from pipeline import dataset
from pipeline.stages.ahead import AheadIterDataset
from pipeline.stages.finish import SKIPPED_KEY as SKIPPED
from tests import stage_chain
from tests.conftest import assert_same_batches


def finished(s):
  """Stages 1-4 over Grain; the stream stage (pipeline.stages.stream) would take the skip count."""
  decoded = AheadIterDataset(AheadIterDataset(stage_chain.planned(s), s.read), s.decode)
  return decoded.map(s.finish).map(lambda batch: {k: v for k, v in batch.items() if k != SKIPPED})


@pytest.mark.parametrize("train", [True, False])
def test_the_finish_stage_over_grain_makes_the_batches_the_chain_serves(photos_dir, train):
  split = "train" if train else "validation"
  s = stage_chain.stages(photos_dir, split, train=train, num_epochs=1)
  batches = list(finished(s))
  assert_same_batches(
    batches, list(dataset.chain(stage_chain.stages(photos_dir, split, train=train, num_epochs=1)))
  )
  keys = {"image", "label"} | (set() if train else {"mask"})
  assert all(set(b) == keys and b["label"].dtype == np.int32 for b in batches)
  if not train:  # padding slots are masked out, and every record is counted once
    masked = sum(int(b["mask"].sum()) for b in batches)
    assert masked == s.manifest.splits[split].num_records


def test_the_finish_stage_runs_your_ops_and_passes_features_through(photos_dir):
  s = stage_chain.stages(
    photos_dir, ops="color_jitter(0.4)", features={"file": "image/filename"}, num_epochs=1
  )
  batch = next(iter(finished(s)))
  assert batch["file"].dtype == object and all(name.endswith(b".jpg") for name in batch["file"])
  plain = next(iter(finished(stage_chain.stages(photos_dir, num_epochs=1))))
  assert np.array_equal(batch["label"], plain["label"])
  assert not np.array_equal(batch["image"], plain["image"])  # the op changed the pixels
