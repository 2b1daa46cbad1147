"""Each block read once across the pod: in the block order every block of an epoch is read by
exactly one process (a block cut between shares: each part by one), whatever the process count
and the split's size (partial windows and splits smaller than one window included), in
training and in evaluation, shuffled or not, while every record still comes once per epoch
and a batch still mixes many random blocks.

The processes' index lists come from the sampler alone (what `make_dataset` plans from), at
the global batch of 32 per process with the default window of 4 global batches of blocks; and
real processes joined on 127.0.0.1 (tests/multihost_blocks_worker.py), each behind its own
storage rig mount, count the storage reads they make.
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import numpy as np
import pytest

import pipeline
from pipeline import dataset
from pipeline.catalog import manifest
from pipeline.order.blocks import WINDOW_BATCHES, Blocks, label_distance
from pipeline.order.sampling import PAD, Sampler
from pipeline.stages import read
from pipeline.stages.stream import StateError
from tests.cluster import run_processes
from tests.multihost_blocks_worker import BLOCK_RECORDS

BATCH, RECORDS = 32, 16  # per process; records per block
EPOCHS = 3


def shards_of(blocks: int) -> tuple[int, ...]:
  """Shards of 1,000 records (62 blocks of 16 and one of 8), then one of whole blocks: a
  split of `blocks` blocks."""
  whole, rest = divmod(blocks, 63)
  return (1000,) * whole + ((rest * RECORDS,) if rest else ())


def streams(shards, hosts: int, train: bool = True, shuffle: bool = True) -> list[tuple]:
  """(epoch, record) of every position of each process's stream over EPOCHS epochs."""
  blocks = Blocks(shards, RECORDS, WINDOW_BATCHES * BATCH * hosts)
  out = []
  for p in range(hosts):
    s = Sampler(
      sum(shards),
      seed=1,
      shuffle=shuffle,
      num_epochs=EPOCHS,
      shard_index=p,
      shard_count=hosts,
      remainder="drop" if train else "pad",
      block=BATCH,
      blocks=blocks,
    )
    out.append(s.records(np.arange(len(s))))
  return out


def block_ids(records: np.ndarray, shards, block: int, cuts=()) -> np.ndarray:
  """A number for the (shard, block of `block` records, part between `cuts`) of each record."""
  ends = np.cumsum(shards)
  shard = np.searchsorted(ends, records, side="right")
  part = np.searchsorted(np.asarray(cuts, np.int64), records, side="right")
  return (shard * 10**6 + (records - (ends - shards)[shard]) // block) * 10**3 + part


def hosts_per_block(shards, parts, block: int = RECORDS, cuts=()) -> np.ndarray:
  """For each (epoch, block or part of a cut block) any process reads: how many processes
  read it."""
  pairs = []
  for epochs, records in parts:
    real = records != PAD
    ids = block_ids(records[real], shards, block, cuts)
    pairs.append(np.unique(epochs[real] * 10**12 + ids))
  return np.unique(np.concatenate(pairs), return_counts=True)[1]


def cuts_of(shards, hosts: int, shuffle: bool = True) -> np.ndarray:
  return Blocks(shards, RECORDS).cuts(hosts, 1 if shuffle else None)


def assert_every_record_once_per_epoch(shards, parts, epochs) -> None:
  epoch = np.concatenate([e for e, _ in parts])
  records = np.concatenate([r for _, r in parts])
  for e in range(epochs):
    assert sorted(records[(epoch == e) & (records != PAD)]) == list(range(sum(shards)))


SIZES = {  # process count -> split sizes in blocks, around its window (4 x 32 x hosts blocks)
  2: [2, 5, 90, 200, 255, 256, 257, 300, 520, 1000],
  3: [2, 100, 383, 384, 385, 700, 1153],
  8: [7, 100, 700, 1023, 1024, 1025, 4375, 4796],
}


@pytest.mark.parametrize("hosts", SIZES)
def test_training_reads_each_block_of_an_epoch_on_one_process(hosts):
  per_block = {}
  for blocks in SIZES[hosts]:
    shards = shards_of(blocks)
    parts = streams(shards, hosts)
    per_block[blocks] = float(hosts_per_block(shards, parts, cuts=cuts_of(shards, hosts)).mean())
    # epochs run on into each other: all but the last are whole (the stream stops after
    # the last whole global batch of EPOCHS epochs, as the global order's does)
    assert_every_record_once_per_epoch(shards, parts, EPOCHS - 1)
  assert per_block == dict.fromkeys(SIZES[hosts], 1.0)


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in_order"])
@pytest.mark.parametrize("hosts", SIZES)
def test_evaluation_reads_each_block_on_one_process_and_every_record_once(hosts, shuffle):
  per_block = {}
  for blocks in SIZES[hosts]:
    shards = shards_of(blocks)
    parts = streams(shards, hosts, train=False, shuffle=shuffle)
    cuts = cuts_of(shards, hosts, shuffle)
    per_block[blocks] = float(hosts_per_block(shards, parts, cuts=cuts).mean())
    assert_every_record_once_per_epoch(shards, parts, EPOCHS)
    assert len({len(r) for _, r in parts}) == 1  # as many batches on each process
  assert per_block == dict.fromkeys(SIZES[hosts], 1.0)
  if not shuffle:  # each process its run of blocks in record order, as one process reads all
    ((_, records),) = streams(shards_of(100), 1, train=False, shuffle=False)
    assert records.tolist() == list(range(sum(shards_of(100)))) * EPOCHS


def test_the_plan_line_says_the_requests_this_process_makes(digits_dir):
  spec = pipeline.Spec.of(  # 240 records: 15 blocks, 5 each
    digits_dir, batch_size=8, order="blocks", block_records=16, shard_index=0, shard_count=3
  )
  said = read.requests(dataset.build(spec).read)
  assert "one per block of 16 records, about 5 an epoch from this process's own blocks" in said


def test_a_state_saved_in_the_previous_block_order_is_refused_in_one_line(digits_dir):
  def make():
    perf = dict(num_workers=0)
    return pipeline.make_dataset(
      digits_dir, batch_size=8, seed=1, order="blocks", block_records=16, performance=perf
    )

  it = iter(make())
  next(it)
  state = it.get_state()
  it.close()
  state["stream"]["order"] = "blocks of 16 in rounds over windows of 32"  # as it tagged them
  with pytest.raises(StateError, match="order blocks of 16 in rounds over windows of 32 in") as e:
    iter(make()).set_state(state)
  assert "\n" not in str(e.value)


def pod_run(storage_rig, data, tmp_path, hosts: int, **flags) -> list[dict]:
  """Each of `hosts` processes' results (tests/multihost_blocks_worker.py, with `flags`),
  each host behind its own rig mount."""
  with contextlib.ExitStack() as mounts:
    for i in range(hosts):
      mounts.enter_context(storage_rig.mount(data, latency_ms=1, mountpoint=tmp_path / f"m{i}"))
    run_processes(
      "multihost_blocks_worker.py",
      hosts,
      data=tmp_path / "m{i}",
      out=tmp_path / "{i}.json",
      **flags,
    )
  return [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(hosts)]


def pod_reads(storage_rig, data, tmp_path, hosts: int) -> dict[str, float]:
  """{split: the storage reads of `hosts` processes, summed, per (epoch, block or part of a
  cut block) they took}: the worker's `spec` of each split, each host behind its own rig
  mount."""
  results = pod_run(storage_rig, data, tmp_path, hosts)
  splits = manifest.load(data).splits
  per_block = {}
  for split in ("train", "validation"):
    shards = [s.num_records for s in splits[split].shards]
    parts = [(np.array(r[split]["epochs"]), np.array(r[split]["records"])) for r in results]
    taken = len(hosts_per_block(shards, parts, BLOCK_RECORDS, results[0][split]["cuts"]))
    per_block[split] = sum(r[split]["reads"] for r in results) / taken
  return per_block


@pytest.mark.parametrize("hosts", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_processes_behind_the_rig_read_each_block_once_from_storage(
  storage_rig, digits_dir, tmp_path, hosts
):
  per_block = pod_reads(storage_rig, digits_dir, tmp_path, hosts)
  assert per_block == {
    "train": pytest.approx(1, abs=0.01),
    "validation": pytest.approx(1, abs=0.01),
  }


def test_each_process_keeps_its_share_of_the_blocks_every_epoch_and_batches_still_mix():
  """Shares alike (about 20 blocks a process or more): the same blocks every epoch, in a new
  order, the processes' shares apart and together the split; a global batch's label mix stays
  within 1.25x a global shuffle's."""
  shards = shards_of(300)
  blocks = Blocks(shards, RECORDS, WINDOW_BATCHES * BATCH * 2)
  assert not blocks.cut_shares(2) and not len(blocks.cuts(2, 1))
  parts = streams(shards, 2)
  sets = []
  for epochs, records in parts:
    mine = [set(block_ids(records[epochs == e], shards, RECORDS)) for e in range(EPOCHS - 1)]
    assert mine[0] == mine[1]
    assert not np.array_equal(records[epochs == 0][:64], records[epochs == 1][:64])
    sets.append(mine[0])
  assert not sets[0] & sets[1] and len(sets[0] | sets[1]) == blocks.count
  labels = np.random.default_rng(0).integers(0, 10, sum(shards))  # a label for each record
  steps = min(len(r) for _, r in parts) // BATCH
  global_batches = np.stack([r[: steps * BATCH].reshape(steps, BATCH) for _, r in parts], 1)
  shuffled = np.random.default_rng(1).permutation(sum(shards))
  ours = label_distance(labels[global_batches.reshape(-1)], 2 * BATCH)
  assert ours <= 1.25 * label_distance(labels[shuffled], 2 * BATCH)


def test_with_a_record_cache_a_pod_reads_the_split_as_often_as_one_host(
  storage_rig, digits_dir, tmp_path
):
  """3 epochs and 3 evaluations, a record cache on each host: one host reads the split once;
  two hosts, each behind its own mount, read it once between them (bytes per mount). Blocks
  of 2 records: shares of 60 and 15 blocks, alike enough to be fixed."""
  flags = dict(cache_mb=64, epochs=3, block_records=2)
  alone = pod_run(storage_rig, digits_dir, tmp_path / "one", 1, **flags)
  pod = pod_run(storage_rig, digits_dir, tmp_path / "two", 2, **flags)
  for split in ("train", "validation"):
    one = alone[0][split]["bytes"]
    both = [host[split]["bytes"] for host in pod]
    assert sum(both) <= 1.15 * one, (split, one, both)
    assert min(both) > 0, both  # each host reads its own share


@pytest.mark.parametrize("hosts", [2, 3])
def test_shares_whole_blocks_cannot_make_alike_are_cut_at_records_and_kept_every_epoch(hosts):
  """A few blocks a process (7 blocks of 16): whole blocks would leave one share a block
  larger, so the shares are cut at records: each process takes the same records every epoch,
  the shares within one record of each other, apart, together the split,
  with at most hosts - 1 blocks cut; a global batch mixes labels (shards in class order, 8
  records a class) within 1.25x a global shuffle's distance."""
  shards = shards_of(7)
  blocks = Blocks(shards, RECORDS, WINDOW_BATCHES * BATCH * hosts)
  assert blocks.cut_shares(hosts) and len(blocks.cuts(hosts, 1)) <= hosts - 1
  parts = streams(shards, hosts)
  mine = []
  for epochs, records in parts:
    taken = [records[epochs == e] for e in range(EPOCHS - 1)]
    assert set(taken[0]) == set(taken[1])
    mine.append(set(taken[0]))
  assert max(map(len, mine)) - min(map(len, mine)) <= 1
  assert sorted(set().union(*mine)) == list(range(sum(shards))) == sorted(sum(map(list, mine), []))
  labels = np.arange(sum(shards)) // 8
  steps = min(len(r) for _, r in parts) // BATCH
  global_batches = np.stack([r[: steps * BATCH].reshape(steps, BATCH) for _, r in parts], 1)
  shuffled = np.random.default_rng(1).permutation(np.tile(np.arange(sum(shards)), EPOCHS))
  ours = label_distance(labels[global_batches.reshape(-1)], hosts * BATCH)
  assert ours <= 1.25 * label_distance(labels[shuffled], hosts * BATCH)


def host_bytes(data, split: str, host: int, hosts: int) -> int:
  """The bytes process `host` of `hosts` (emulated in this process: the order is a pure
  function of the layout) reads through its mount `data` in EPOCHS epochs (training) or
  evaluations of `split` in the block order, in the default blocks, with the default record
  cache; the shards' open not counted."""
  spec = pipeline.Spec.of(
    data,
    split,
    batch_size=16,
    train=split == "train",
    num_epochs=EPOCHS,
    seed=3,
    image_size=8,
    order="blocks",
    shard_index=host,
    shard_count=hosts,
    performance=dict(num_workers=0, num_threads=1),
  )
  st = dataset.build(spec)
  assert st.read.cache is not None  # the default: the rig's reads are slow
  source = st.read.source
  for shard in range(len(source.paths)):
    source.read_range(shard, 0, 1)
  (pathlib.Path(data) / ".rig-reset").read_text()
  it = iter(dataset.chain(st))
  for _ in it:
    pass
  it.close()
  return json.loads((pathlib.Path(data) / ".rig-stats").read_text())["bytes"]


@pytest.mark.parametrize("hosts", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_hosts_whose_shares_are_cut_read_the_split_once_between_them_with_the_record_cache(
  storage_rig, digits_dir, tmp_path, hosts
):
  """The tests' digits (240 train, 60 validation records) in the default blocks: each split
  one block, so whole blocks would leave all shares but one empty (they rotated with the
  epoch: each host read the block again in its turn). One host alone, then each of `hosts`
  behind its own rig mount (3 ms a read: the record cache on by default), 3 epochs and 3
  evaluations: the mounts serve at most 1.15x the bytes one host reads; each host reads."""
  with contextlib.ExitStack() as mounts:
    path = [
      mounts.enter_context(storage_rig.mount(digits_dir, 3, tmp_path / f"m{p}")).path
      for p in range(hosts + 1)
    ]
    for split in ("train", "validation"):
      one = host_bytes(path[hosts], split, 0, 1)
      pod = [host_bytes(path[p], split, p, hosts) for p in range(hosts)]
      assert sum(pod) <= 1.15 * one and min(pod) > 0, (split, one, pod)
