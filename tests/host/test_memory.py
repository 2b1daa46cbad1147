"""One memory budget (`performance.memory_mb`, `pipeline.host.memory`): the plan line prints
its split; a small budget shrinks the record cache, then the read-ahead, and changes no batch;
one too small for the least the loader holds is refused in one line."""

import itertools
import json
import os
import re

import pytest

import pipeline
from pipeline.host import memory
from pipeline.image import augment
from pipeline.stages import decode
from tests.conftest import assert_same_batches

MB = 2**20
SPLIT = re.compile(
  r"memory: ([\d.,]+) of ([\d.,]+) MB \(read-ahead ([\d.,]+), blocks ([\d.,]+), record cache "
  r"([\d.,]+), batches ([\d.,]+), working ([\d.,]+), workers 0\); performance.memory_mb sets"
)


PLAN = [""]


def split_of(data_dir, capfd, **performance) -> tuple[dict[str, float], list[dict]]:
  """The memory split make_dataset prints (MB) and the first 12 train batches (two epochs);
  the whole plan line is left in `PLAN[0]`."""
  ds = pipeline.make_dataset(
    data_dir,
    batch_size=8,
    image_size=64,
    order="blocks",
    block_records=4,
    seed=3,
    performance={"num_workers": 0, **performance},
  )
  got = list(itertools.islice(iter(ds), 12))
  PLAN[:] = [capfd.readouterr().err]
  found = SPLIT.search(PLAN[0])
  assert found, "no memory split in the plan line"
  names = ("total", "budget", "read_ahead", "blocks", "record_cache", "batches", "working")
  return {n: float(v.replace(",", "")) for n, v in zip(names, found.groups())}, got


def test_the_plan_line_prints_every_part_within_the_budget(photos_dir, capfd):
  split, _ = split_of(photos_dir, capfd, memory_mb=2000, record_cache_mb=4)
  assert split["budget"] == 2000
  assert split["read_ahead"] == 256 and split["record_cache"] == 4.0
  assert split["blocks"] > 0 and split["batches"] > 0  # two windows of blocks; 4 batches
  parts = sum(split[n] for n in ("read_ahead", "blocks", "record_cache", "batches", "working"))
  assert split["total"] == pytest.approx(parts, abs=1) and split["total"] <= 2000


def test_a_small_budget_shrinks_the_cache_then_the_read_ahead_and_no_batch(photos_dir, capfd):
  roomy, want = split_of(photos_dir, capfd, record_cache_mb=64)
  fixed = roomy["blocks"] + roomy["batches"] + roomy["working"]
  small, got = split_of(photos_dir, capfd, record_cache_mb=64, memory_mb=fixed + 1.5)
  assert small["record_cache"] == 0 and 0 < small["read_ahead"] < 3  # parts printed to 1 MB
  assert "record cache off: the memory budget left none of the 64 MB it wanted" in PLAN[0]
  assert small["total"] <= small["budget"] + 1  # both printed to the nearest MB above 10
  assert_same_batches(got, want)


def test_a_budget_below_the_least_the_loader_holds_is_refused_in_one_line(photos_dir):
  with pytest.raises(ValueError, match=r"^performance.memory_mb=0.01 is below the least") as e:
    pipeline.make_dataset(photos_dir, batch_size=8, performance={"memory_mb": 0.01})
  assert "\n" not in str(e.value) and "performance.num_workers" in str(e.value)


def test_a_process_working_memory_is_a_fixed_part_its_threads_arenas_and_batches_of_records(
  photos_dir, capfd
):
  split, _ = split_of(photos_dir, capfd, num_threads=3)
  train = json.load(open(os.path.join(photos_dir, "manifest.json")))["splits"]["train"]
  record_bytes = sum(s["bytes"] for s in train["shards"]) / train["num_records"]
  arenas = 3 * decode.arena_bytes(augment.Head(image_size=64))
  want = memory.WORKING_FIXED + arenas + memory.RECORD_BATCHES * 8 * record_bytes
  assert split["working"] == pytest.approx(want / MB, abs=0.6)  # printed to the nearest MB


def test_the_cache_shrinks_first_then_the_read_ahead_for_every_process():
  parts = dict(read_ahead=100 * MB, least_read_ahead=MB, record_cache=50 * MB, blocks=0)
  kw = dict(workers=2, batches=10 * MB, working=5 * MB, worker_bytes=300 * MB, **parts)
  assert memory.fit(1000 * MB, **kw).total == 920 * MB  # all fits: nothing shrinks
  cache_cut = memory.fit(870 * MB, **kw)
  assert (cache_cut.record_cache, cache_cut.read_ahead) == (50 * MB, 200 * MB)
  ahead_cut = memory.fit(710 * MB, **kw)
  assert (ahead_cut.record_cache, ahead_cut.per_process("read_ahead")) == (0, 45 * MB)
  with pytest.raises(ValueError, match="least this loader holds, 622 MB"):
    memory.fit(621 * MB, **kw)
