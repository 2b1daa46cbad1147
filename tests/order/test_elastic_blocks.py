"""Elastic resume in the block order (`pipeline.order.elastic.rest_of_epoch`): a state saved on
n processes continues on m, reading every record of the interrupted epoch once across the
resume, in blocks, then the next epochs as a fresh m-process run does.

Processes are emulated in-process by their `Sampler`s (the order is a pure function of the
layout and position); a global batch of 24 keeps the windows (4 global batches of blocks).
One split has shares of whole blocks alike, the other so few blocks that the shares are cut
at records (`Blocks.cut_shares`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pipeline.order.blocks import Blocks
from pipeline.order.sampling import Sampler
from tests.conftest import assert_same_batches, take
from tests.elastic_pipeline_worker import make_dataset
from tests.order.test_blocks import block_of
from tests.order.test_multihost_pipeline import NUM_RECORDS, odd_dir  # noqa: F401 - a fixture

FIXED, CUT = (300, 300, 250), (60, 50)


def process(shards, p: int, n: int, resumed=()) -> Sampler:
  blocks = Blocks(shards, block_records=16, window_blocks=4 * 24)
  return Sampler(
    sum(shards), seed=5, shard_index=p, shard_count=n, block=24 // n, blocks=blocks, resumed=resumed
  )


def read(samplers, batches: int) -> tuple[list, list]:
  """Each process's (epochs, records) of its first `batches` batches."""
  out = [s.records(np.arange(batches * s.block)) for s in samplers]
  return [e for e, _ in out], [r for _, r in out]


def epoch_records(samplers, batches: int, epoch: int) -> list[np.ndarray]:
  epochs, records = read(samplers, batches)
  return [r[e == epoch] for e, r in zip(epochs, records, strict=True)]


@pytest.mark.parametrize("shards", [FIXED, CUT], ids=["whole_shares", "cut_shares"])
@pytest.mark.parametrize("n, m, saved_after", [(3, 2, 25), (2, 3, 7), (3, 1, 40), (1, 4, 30)])
def test_a_block_order_state_continues_on_another_count_with_every_record_once(
  shards, n, m, saved_after
):
  total = sum(shards)
  before = [process(shards, p, n) for p in range(n)]
  epochs, _ = read(before, saved_after + 1)
  interrupted = min(int(e[saved_after * (24 // n)]) for e in epochs)
  after = [process(shards, p, m, resumed=((n, 24 // n, saved_after),)) for p in range(m)]
  steps = (interrupted + 4) * total // 24  # past the end of the next two epochs, fresh too
  taken = epoch_records(before, saved_after, interrupted) + epoch_records(after, steps, interrupted)
  assert sorted(np.concatenate(taken).tolist()) == list(range(total))
  for later in (interrupted + 1, interrupted + 2):  # as a fresh m-process run
    fresh = [process(shards, p, m) for p in range(m)]
    for resumed, expected in zip(
      epoch_records(after, steps, later), epoch_records(fresh, steps, later), strict=True
    ):
      np.testing.assert_array_equal(resumed, expected)


@pytest.mark.parametrize("shards", [FIXED, CUT], ids=["whole_shares", "cut_shares"])
def test_the_rest_of_the_epoch_is_read_in_blocks_each_on_one_process(shards):
  after = [process(shards, p, 2, resumed=((3, 8, 20),)) for p in range(2)]
  epoch = int(after[0].records(np.array([0]))[0][0])
  rest = epoch_records(after, 2 * sum(shards) // 24, epoch)
  blocks = [block_of(r, shards) for r in rest]
  assert len(blocks[0]) and len(blocks[1]) and not set(blocks[0]) & set(blocks[1])
  for b in blocks:  # in rounds: the first takes one record of each block of the window
    lanes = min(len(set(b.tolist())), 4 * 24 // 2)
    assert len(set(b[:lanes].tolist())) == lanes


def test_a_state_resumed_twice_still_reads_every_record_once():
  shards, total = FIXED, sum(FIXED)
  first = [process(shards, p, 3) for p in range(3)]
  once = ((3, 8, 20),)
  second = [process(shards, p, 2, resumed=once) for p in range(2)]
  third = [process(shards, p, 4, resumed=(*once, (2, 12, 6))) for p in range(4)]
  taken = epoch_records(first, 20, 0) + epoch_records(second, 6, 0) + epoch_records(third, 60, 0)
  assert sorted(np.concatenate(taken).tolist()) == list(range(total))


def labels_by_record(data) -> np.ndarray:
  """Each record's label, in record order (one unshuffled eval pass)."""
  ds = make_dataset(data, 0, 1, batch_size=NUM_RECORDS, train=False, shuffle=False)
  return next(iter(ds))["label"]


@pytest.mark.parametrize("workers", [0, 2], ids=["threads", "worker_processes"])
def test_make_dataset_continues_a_block_order_state_of_two_processes_on_one(
  odd_dir,  # noqa: F811
  caplog,
  workers,
):
  blocks = dict(order="blocks", block_records=4)
  it = iter(make_dataset(odd_dir, 1, 2, **blocks))
  for _ in range(2):
    next(it)
  state = it.get_state()
  it.close()
  resumed = iter(make_dataset(odd_dir, 0, 1, workers=workers, **blocks))
  with caplog.at_level(logging.WARNING):
    resumed.set_state(state)
  said = [r.getMessage() for r in caplog.records if "continues on 1 x 12" in r.getMessage()]
  assert len(said) == 1 and "other global batches than the uninterrupted run's" in said[0]
  got = np.concatenate([next(resumed)["label"] for _ in range(6)])
  order = resumed.plan.fn.sampler
  assert order.resumed == ((2, 6, 2),)
  assert resumed.get_state()["resumed"] == [[2, 6, 2]]
  resumed.close()
  np.testing.assert_array_equal(got, labels_by_record(odd_dir)[order.records(np.arange(72))[1]])


def test_a_state_saved_after_such_a_resume_continues_on_its_count_and_on_another(
  odd_dir,  # noqa: F811
):
  blocks = dict(order="blocks", block_records=4)
  it = iter(make_dataset(odd_dir, 1, 2, **blocks))
  take(it, 2)
  resumed = iter(make_dataset(odd_dir, 0, 1, **blocks))
  resumed.set_state(it.get_state())
  take(resumed, 2)
  state = resumed.get_state()
  expected = take(resumed, 3)
  again = iter(make_dataset(odd_dir, 0, 1, **blocks))
  again.set_state(state)
  assert_same_batches(expected, take(again, 3))
  elsewhere = iter(make_dataset(odd_dir, 2, 3, **blocks))
  elsewhere.set_state(state)
  assert elsewhere.plan.fn.sampler.resumed == ((2, 6, 2), (1, 12, 2))
  for x in (it, resumed, again, elsewhere):
    x.close()
