"""Multi-host on one machine: 2 and 4 processes joined by jax.distributed read one split.

Each process runs `make_dataset(shard_index=jax.process_index(), shard_count=
jax.process_count())` for 2 epochs (tests/multihost_pipeline_worker.py). Per epoch the
processes' examples must cover the split exactly once, every process must yield the same
number of batches, and a state saved mid-way must resume exactly in another process (this
one, from the state's JSON, with the saving process's shard_index and shard_count).
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest

import pipeline
from pipeline.convert import builtin, images
from tests.cluster import run_processes
from tests.multihost_pipeline_worker import BATCH, hashes, make_dataset

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUM_RECORDS = 45  # divides by neither 2 nor 4: the last places of a slice are padding


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory) -> pathlib.Path:
  """45 digits in several small shards, converted by the real converter."""
  root = tmp_path_factory.mktemp("multihost")
  builtin.make_digits(root / "raw", num_images=NUM_RECORDS)
  images.convert(
    images.Request(root / "raw", root / "data", shard_size_mb=0.01), workers=1, progress=False
  )
  assert len(pipeline.load_manifest(root / "data").splits["train"].shards) > 2
  return root / "data"


@pytest.fixture(scope="module")
def record_hashes(odd_dir) -> set[str]:
  """The hash of every record's eval image, read by one process in order."""
  ds = make_dataset(odd_dir, 0, 1, shuffle=False, num_epochs=1)
  real = [h for b in ds for h in hashes(b) if h is not None]
  assert len(set(real)) == len(real) == NUM_RECORDS  # a hash identifies a record
  return set(real)


def run_cluster(num_processes: int, data: pathlib.Path, out: pathlib.Path, save_at: int):
  """The JSON of `num_processes` workers joined on a fresh localhost port."""
  out.mkdir(parents=True, exist_ok=True)
  run_processes(
    "multihost_pipeline_worker.py", num_processes, data=data, save_at=save_at, out=out / "{i}.json"
  )
  return [json.loads((out / f"{i}.json").read_text()) for i in range(num_processes)]


def by_epoch(results: list[dict], num_processes: int) -> list[list[str]]:
  """Every process's real examples, grouped by the epoch of their stream position."""
  per_epoch = math.ceil(NUM_RECORDS / num_processes)
  epochs = [[], []]
  for r in results:
    for position, h in enumerate(h for batch in r["batches"] for h in batch):
      if h is not None:
        epochs[position // per_epoch].append(h)
  return epochs


def stream(data, state: dict, shard_index: int, shard_count: int) -> list[list[str | None]]:
  """The rest of a process's stream after `state`, as the worker writes it."""
  it = iter(make_dataset(data, shard_index, shard_count))
  it.set_state(json.loads(json.dumps(state)))
  return [hashes(b) for b in it]


@pytest.mark.parametrize("num_processes", [2, 4])
def test_processes_cover_each_epoch_once_and_resume_exactly(
  tmp_path, odd_dir, record_hashes, num_processes
):
  per_process = 2 * math.ceil(NUM_RECORDS / num_processes)
  num_batches = math.ceil(per_process / BATCH)
  save_at = num_batches // 2 - 1  # mid-way through the first epoch
  first = run_cluster(num_processes, odd_dir, tmp_path, save_at)

  assert sorted(r["process_index"] for r in first) == list(range(num_processes))
  assert all(r["process_count"] == num_processes for r in first)
  for r in first:  # the same count everywhere, or a synchronous step would hang
    assert r["batch_counts"] == [num_batches] * num_processes
  epochs = by_epoch(first, num_processes)
  for seen in epochs:  # complete and disjoint
    assert len(seen) == NUM_RECORDS and set(seen) == record_hashes
  assert epochs[0] != epochs[1]  # a fresh shuffle each epoch
  padding = sum(h is None for r in first for b in r["batches"] for h in b)
  assert padding == 2 * (num_processes * math.ceil(NUM_RECORDS / num_processes) - NUM_RECORDS)

  for r in first:
    rest = stream(odd_dir, r["state"], r["process_index"], num_processes)
    assert rest == r["batches"][save_at:]


def test_a_state_from_another_process_count_is_refused_clearly(odd_dir):
  """An eval stream is padded per epoch and process count: its state resumes on that count."""
  it = iter(make_dataset(odd_dir, 1, 2))
  next(it)
  state = it.get_state()
  with pytest.raises(ValueError, match="cannot continue on 4 x 4: .* resume on 2 process"):
    stream(odd_dir, state, shard_index=1, shard_count=4)
