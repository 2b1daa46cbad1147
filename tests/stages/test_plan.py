"""Stage 1, plan (pipeline.stages.plan over pipeline.order.sampling): batch i -> the (epoch, record)
of each slot, a pure function of (seed, position): every record once per epoch, a new order each
epoch, disjoint process slices."""

import math

import grain
import numpy as np
import pytest

from pipeline.order.sampling import PAD, Sampler
from tests import stage_chain


def test_the_plan_over_grain_is_random_access_and_covers_each_epoch_once(photos_dir):
  s = stage_chain.stages(photos_dir, num_epochs=2, drop_remainder=False)
  plans = grain.MapDataset.range(s.sizes.num_batches).map(s.plan)
  batches = list(plans)
  assert [b.index for b in batches] == list(range(s.sizes.num_batches))
  assert plans[3].indices.tolist() == batches[3].indices.tolist()  # any batch, no history
  epochs = np.concatenate([b.epochs for b in batches])
  indices = np.concatenate([b.indices for b in batches])
  num_records = s.manifest.splits["train"].num_records
  for epoch in (0, 1):
    assert sorted(indices[epochs == epoch].tolist()) == list(range(num_records))
  assert indices[epochs == 0].tolist() != indices[epochs == 1].tolist()
  iterated = [b.indices.tolist() for b in stage_chain.planned(s)]
  assert iterated == [b.indices.tolist() for b in batches]


@pytest.mark.parametrize("n", [1, 7, 64])
def test_every_record_once_per_epoch_and_new_order_each_epoch(n):
  s = Sampler(n, seed=3, num_epochs=3)
  epochs = [[s.record_index(e * n + j) for j in range(n)] for e in range(3)]
  for order in epochs:
    assert sorted(order) == list(range(n))
  if n > 5:
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("n,procs", [(10, 3), (64, 4), (5, 5)])
def test_process_slices_are_disjoint_and_complete_with_padding(n, procs):
  for epoch in range(2):
    seen = []
    for k in range(procs):
      s = Sampler(n, seed=1, num_epochs=2, shard_index=k, shard_count=procs, remainder="pad")
      assert s.per_epoch == math.ceil(n / procs)
      seen += [s.record_index(epoch * s.per_epoch + j) for j in range(s.per_epoch)]
    real = [i for i in seen if i != PAD]
    assert sorted(real) == list(range(n))
    assert len(seen) - len(real) == procs * math.ceil(n / procs) - n


def test_drop_remainder_slices_are_disjoint_and_equal_sized():
  n, procs = 10, 3
  parts = [Sampler(n, seed=1, shard_index=k, shard_count=procs) for k in range(procs)]
  assert all(p.per_epoch == 3 for p in parts)
  seen = [p.record_index(j) for p in parts for j in range(3)]
  assert len(set(seen)) == 9 and PAD not in seen


def test_sampler_rejects_bad_arguments():
  with pytest.raises(ValueError, match="shard_index"):
    Sampler(10, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match="cannot feed"):
    Sampler(2, shard_count=3)
