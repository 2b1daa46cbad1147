"""A stream of known length (`num_batches`: a run's steps) ends there, and its read-ahead never
plans or reads a batch past it: the plan stage is asked for those batches only, and storage
for their records only."""

from __future__ import annotations

import pytest

import pipeline
from pipeline import dataset
from pipeline.stages.stream import stats_of


def test_the_read_ahead_stops_at_the_last_batch_the_run_takes(digits_dir):
  perf = dict(num_workers=0, read_ahead=8, record_cache_mb=0)
  spec = pipeline.Spec.of(digits_dir, batch_size=8, image_size=16, num_batches=5, performance=perf)
  st = dataset.build(spec)
  it = iter(dataset.chain(st))
  assert len(list(it)) == 5  # then the stream ends
  planned = [r.items for r in stats_of(it).rows if r.stage == "plan"]
  assert planned == [5]
  assert st.read.stats.request_records == 5 * 8  # one request per record on local disk
  it.close()


def test_num_batches_is_checked():
  with pytest.raises(ValueError, match="^num_batches must be None or positive, got 0$"):
    pipeline.Spec.of("x", batch_size=8, num_batches=0)
