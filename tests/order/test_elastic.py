"""Elastic resume: a train stream read by n processes gives the 1-process global batches, and
its state, saved by process 0 of n, continues on m processes with the same global batches.

Real clusters of 1 to 4 processes (tests/elastic_pipeline_worker.py) read 45 records with a
global batch of 12 for 8 steps (epoch boundaries at positions 45 and 90). A step's global
batch (the processes' batches in process order, as a global array holds them) is compared
with the unresized 1-process run's, as a list of (label, pixels): a record and its random
crop, in place. States are saved after step 2 (mid-epoch; the rest crosses both
boundaries) and after step 4 (just past a batch that spans a boundary).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from pipeline.convert import images
from pipeline.order.sampling import Sampler
from pipeline.stages.stream import StateError
from tests.cluster import run_processes
from tests.conftest import assert_same_batches, take
from tests.elastic_pipeline_worker import GLOBAL_BATCH, examples, make_dataset
from tests.order.test_multihost_pipeline import odd_dir  # noqa: F401 - a fixture

STEPS, SAVES = 8, (2, 4)
PAIRS = [(2, 1), (1, 2), (3, 2), (2, 3), (4, 2)]


def by_step(results: list[list[list[str]]]) -> list[list[str]]:
  """Each step's global batch: the processes' batches, in process order."""
  return [sum(step, []) for step in zip(*results, strict=True)]


@pytest.fixture(scope="module")
def reference(odd_dir) -> list[list[str]]:  # noqa: F811
  """The unresized run: one process, the whole global batch."""
  it = iter(make_dataset(odd_dir, 0, 1))
  steps = [examples(next(it)) for _ in range(STEPS)]
  it.close()
  return steps


@pytest.fixture(scope="module")
def runs(odd_dir, tmp_path_factory) -> dict:  # noqa: F811
  """{n: [process results]} of fresh runs, and {(n, m, step): global batches} of m processes
  resumed from the state process 0 of n saved after `step`."""
  root = tmp_path_factory.mktemp("elastic")
  fresh, resumed = {}, {}

  def cluster(n: int, resume_from=(), workers: int = 0) -> None:
    files = [root / f"state-{f}-{s}.json" for f in resume_from for s in SAVES]
    out = root / f"run{len(fresh)}-{n}"
    out.mkdir()
    run_processes(
      "elastic_pipeline_worker.py",
      n,
      data=odd_dir,
      steps=STEPS,
      save_at=",".join(map(str, SAVES)),
      resume=",".join(map(str, files)),
      workers=workers,
      out=out / "{i}.json",
    )
    results = [json.loads((out / f"{i}.json").read_text()) for i in range(n)]
    fresh.setdefault(n, results)
    for s in SAVES:
      (root / f"state-{n}-{s}.json").write_text(json.dumps(results[0]["states"][str(s)]))
    for f in resume_from:
      for s in SAVES:
        path = str(root / f"state-{f}-{s}.json")
        resumed[(f, n, s)] = by_step([r["resumed"][path] for r in results])

  cluster(2)
  cluster(1, resume_from=[2], workers=2)  # states of a worker process, and into one
  cluster(3, resume_from=[2])
  cluster(4)
  cluster(2, resume_from=[1, 3, 4])
  return {"fresh": fresh, "resumed": resumed}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_processes_blocks_of_a_step_are_the_one_process_batch(n):
  one = Sampler(45, seed=3, block=GLOBAL_BATCH)
  parts = [
    Sampler(45, seed=3, shard_index=p, shard_count=n, block=GLOBAL_BATCH // n) for p in range(n)
  ]
  for step in range(STEPS):  # across the epoch boundaries at 45 and 90
    first = np.arange(step * GLOBAL_BATCH // n, (step + 1) * GLOBAL_BATCH // n)
    together = [np.concatenate(x) for x in zip(*(s.records(first) for s in parts))]
    expected = one.records(np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
    np.testing.assert_array_equal(together, expected)  # epochs and records, in place


@pytest.mark.slow  # clusters of 1-4 real processes
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_process_count_reads_the_same_global_batches(runs, reference, n):
  results = runs["fresh"][n]
  assert by_step([r["steps"] for r in results]) == reference
  for r in results:  # each process its own share of each step
    assert all(len(step) == GLOBAL_BATCH // n for step in r["steps"])


@pytest.mark.slow  # the clusters of `runs`
@pytest.mark.parametrize("saved_on, resumed_on", PAIRS, ids=[f"{n}to{m}" for n, m in PAIRS])
@pytest.mark.parametrize("step", SAVES, ids=["mid_epoch", "past_a_spanning_batch"])
def test_a_state_continues_on_another_process_count(runs, reference, saved_on, resumed_on, step):
  assert runs["resumed"][(saved_on, resumed_on, step)] == reference[step:]


def make(data, *, shard_count: int, batch_size: int = 4, **kwargs):
  """Process 0 of `shard_count` of the workers' dataset, in batches of `batch_size`."""
  return make_dataset(data, 0, shard_count, batch_size=batch_size, **kwargs)


def state_after(ds, batches: int) -> dict:
  it = iter(ds)
  for _ in range(batches):
    next(it)
  state = it.get_state()
  it.close()
  return state


@pytest.mark.parametrize(
  "kwargs, refusal",
  [
    (dict(sharding="shards"), "owned shards (sharding='shards') saved on 2 process(es)"),
    (dict(train=False, num_epochs=2), "a padded eval stream saved on 2 process(es)"),
  ],
  ids=["owned_shards", "eval"],
)
def test_states_whose_order_depends_on_the_count_are_refused_in_one_line(
  odd_dir,  # noqa: F811
  kwargs,
  refusal,
):
  state = state_after(make(odd_dir, shard_count=2, **kwargs), 1)
  with pytest.raises(StateError, match="resume on 2 process") as e:
    iter(make(odd_dir, shard_count=1, batch_size=8, **kwargs)).set_state(state)
  assert refusal in str(e.value) and "\n" not in str(e.value)


def test_a_position_that_is_no_whole_global_batch_is_refused(odd_dir):  # noqa: F811
  state = state_after(make(odd_dir, shard_count=2, batch_size=6), 1)  # position 12
  with pytest.raises(StateError, match="12 is not a multiple of the global batch 8") as e:
    iter(make(odd_dir, shard_count=1, batch_size=8)).set_state(state)
  assert e.value.global_batch == 12 and e.value.fix.endswith("keep the global batch 12")
  it = iter(make(odd_dir, shard_count=1, batch_size=3))  # another global batch that divides
  it.set_state(state)
  assert it.get_state()["position"] == 12


def with_shards(data, tmp_path, change) -> pathlib.Path:
  """A copy of `data` whose manifest lists the train shards as `change` makes them."""
  copy = tmp_path / "data"
  shutil.copytree(data, copy)
  manifest = json.loads((copy / "manifest.json").read_text())
  split = manifest["splits"]["train"]
  split["shards"] = change(split["shards"])
  split["num_records"] = sum(s["num_records"] for s in split["shards"])
  (copy / "manifest.json").write_text(json.dumps(manifest))
  return copy


@pytest.mark.parametrize("order", ["global", "blocks"])
def test_a_state_resumed_over_the_same_shards_in_another_order_is_refused_in_one_line(
  odd_dir,  # noqa: F811
  tmp_path,
  order,
):
  state = state_after(make(odd_dir, shard_count=1, order=order), 2)
  reordered = with_shards(odd_dir, tmp_path, lambda shards: shards[::-1])
  with pytest.raises(StateError) as e:
    iter(make(reordered, shard_count=1, order=order)).set_state(state)
  assert str(e.value).startswith("iterator state of another shard list (the same ")
  assert "in another order" in str(e.value) and "\n" not in str(e.value)
  iter(make(odd_dir, shard_count=1, order=order)).set_state(state)  # the same list resumes


def test_a_state_resumed_over_the_same_records_in_other_shards_names_their_counts(
  odd_dir,  # noqa: F811
  tmp_path,
):
  state = state_after(make(odd_dir, shard_count=1), 2)
  count = state["stream"]["shards"]["count"]
  images.convert(
    images.Request(odd_dir.parent / "raw", tmp_path, shard_size_mb=1), workers=1, progress=False
  )
  with pytest.raises(
    StateError, match=f"shard list \\({count} shard\\(s\\) in the state, 1 here\\)"
  ):
    iter(make(tmp_path, shard_count=1)).set_state(state)


def test_a_state_saved_before_states_named_their_shards_resumes_as_before(odd_dir):  # noqa: F811
  it = iter(make(odd_dir, shard_count=1))
  take(it, 2)
  state = it.get_state()
  expected = take(it, 2)
  del state["stream"]["shards"]
  resumed = iter(make(odd_dir, shard_count=1))
  resumed.set_state(state)
  assert_same_batches(expected, take(resumed, 2))


def test_a_block_order_state_in_the_global_order_names_the_order_to_pass(odd_dir):  # noqa: F811
  state = state_after(make(odd_dir, shard_count=1, order="blocks"), 2)
  with pytest.raises(StateError) as e:
    iter(make(odd_dir, shard_count=1, order="global")).set_state(state)
  assert str(e.value) == (
    "iterator state of order='blocks' cannot continue in order='global': pass order='blocks'"
  )
  assert e.value.passes == {"order": "blocks"} and e.value.fix == "pass order='blocks'"


def test_a_block_order_state_in_other_windows_names_the_window_blocks_to_pass(
  odd_dir,  # noqa: F811
):
  state = state_after(make(odd_dir, shard_count=1, batch_size=4, order="blocks"), 2)
  with pytest.raises(StateError) as e:
    iter(make(odd_dir, shard_count=1, batch_size=4, order="blocks", window_blocks=64)).set_state(
      state
    )
  assert str(e.value).endswith("pass window_blocks=16") and "\n" not in str(e.value)
  it = iter(make(odd_dir, shard_count=1, batch_size=4, order="blocks", window_blocks=16))
  it.set_state(state)  # as the message says
  assert it.get_state()["position"] == 8


@pytest.mark.parametrize("order", ["global", "blocks"])
def test_a_state_resumed_over_shards_converted_again_under_the_same_names_is_refused(
  odd_dir,  # noqa: F811
  tmp_path,
  order,
):
  """Two shards of as many records whose contents changed places (as a conversion run again
  may leave them), the manifest saying so: the same names and record counts, other records
  under them; the state's positions would repeat some records and skip others."""
  state = state_after(make(odd_dir, shard_count=1, order=order), 2)

  def swap_two(shards):
    counts = [s["num_records"] for s in shards]
    i = next(i for i, c in enumerate(counts) if counts.count(c) > 1)
    j = counts.index(counts[i], i + 1)
    a, b = tmp_path / "data" / shards[i]["file"], tmp_path / "data" / shards[j]["file"]
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    for key in ("sha256", "bytes", "crc32c"):
      shards[i][key], shards[j][key] = shards[j].get(key), shards[i].get(key)
    return shards

  swapped = with_shards(odd_dir, tmp_path, swap_two)
  with pytest.raises(StateError) as e:
    iter(make(swapped, shard_count=1, order=order)).set_state(state)
  assert str(e.value).startswith("iterator state of other shard contents (the same ")
  assert "\n" not in str(e.value)
