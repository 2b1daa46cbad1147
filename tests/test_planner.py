"""The host plan (`pipeline.planner`): every number a dataset's stages run with (order, workers x
threads, the memory split, the record cache, the read-ahead, the block reads), decided once from
the spec, the split's manifest and its opened shards; the stages are made from it and plan
nothing themselves."""

import ast
import pathlib

import pytest

import pipeline
from pipeline import dataset, planner
from pipeline.catalog import split
from pipeline.host import memory, parallelism
from pipeline.image import augment
from pipeline.stages import decode

MB = 2**20
PINNED = {"num_workers": 0, "num_threads": 2, "memory_mb": 700}  # the same host plan anywhere
SLOW, FAST = (0.020, 3000.0), (0.0001, 3000.0)  # a read measured at open: (seconds, bytes)
ROOT = pathlib.Path(__file__).resolve().parent.parent


def opened(data_dir, **keywords):
  """(spec, manifest, source) of a train split of 64-px images in batches of 8."""
  spec = pipeline.Spec.of(data_dir, batch_size=8, image_size=64, seed=1, **keywords)
  meta, source, _ = split.open(spec.data_dir, spec.split)
  return spec, meta, source


def decide(data_dir, measured=SLOW, **keywords) -> planner.HostPlan:
  spec, meta, source = opened(data_dir, **keywords)
  arena = decode.arena_bytes(augment.Head(image_size=64))
  return planner.decide(spec, meta, source, measured, image_size=64, arena_bytes=arena)


def test_a_plan_is_a_function_of_the_spec_the_split_and_the_read_measured_at_open(photos_dir):
  one = decide(photos_dir, performance=PINNED)
  assert one == decide(photos_dir, performance=PINNED)
  assert one.parallel.workers == 0 and one.parallel.threads == 2 and one.order == "global"
  fast = decide(photos_dir, FAST, performance=PINNED)
  assert fast.sampler == one.sampler and fast.memory.budget == one.memory.budget
  # slow storage (>= 2 ms a read): more batches read ahead, and the split kept in RAM
  assert fast.reads.depth[0] < one.reads.depth[0] <= one.reads.depth[1]
  assert fast.reads.cache_bytes == 0 < one.reads.cache_bytes == one.reads.cache_wanted
  assert one.reads.cache_bytes >= sum(s.bytes for s in opened(photos_dir)[1].splits["train"].shards)


def test_the_memory_split_stays_within_memory_mb_the_cache_shrinking_first(photos_dir):
  roomy = decide(photos_dir, performance={**PINNED, "record_cache_mb": 64})
  assert roomy.memory.total <= roomy.memory.budget == 700 * MB
  assert roomy.reads.cache_bytes == roomy.memory.record_cache == 64 * MB
  fixed = roomy.memory.total - roomy.memory.record_cache - roomy.memory.read_ahead
  tight = fixed / MB + 2 * roomy.reads.batch_size * roomy.reads.record_bytes / MB
  small = decide(photos_dir, performance={**PINNED, "record_cache_mb": 64, "memory_mb": tight})
  assert small.memory.total <= small.memory.budget == round(tight * MB)
  assert small.reads.cache_bytes == small.memory.record_cache == 0
  assert small.reads.cache_wanted == 64 * MB and small.reads.ahead_bytes == small.memory.read_ahead
  assert "record cache off: the memory budget left none of the 64 MB" in small.reads.describe()
  with pytest.raises(memory.BudgetError, match=r"^performance.memory_mb=0.01 is below the least"):
    decide(photos_dir, performance={**PINNED, "memory_mb": 0.01})


def test_workers_x_threads_you_give_are_kept_and_counted_in_the_memory_split(photos_dir):
  given = decide(photos_dir, performance={**PINNED, "num_workers": 2, "num_threads": 1})
  assert (given.parallel.workers, given.parallel.threads) == (2, 1)
  assert given.memory.workers == given.memory.processes == 2
  assert given.memory.worker_bytes == 110 * MB  # a light worker: no JAX
  assert given.reads.ahead_bytes == given.memory.read_ahead // 2  # each worker reads its own


def test_decoding_on_the_device_runs_in_this_process_with_every_planned_thread():
  on = planner.on_device(parallelism.Plan(3, 2, "auto"), None, [])
  assert (on.workers, on.threads) == (0, min(6, parallelism.available_cores()))
  assert on.why == "windows decoded by nvImageCodec's CPU backend (no GPU here)"
  with pytest.raises(ValueError, match="set performance.num_workers=0 or None, got 2$"):
    planner.on_device(parallelism.Plan(3, 2, "auto"), 2, [])


def test_shards_on_a_mount_are_read_in_block_order_local_ones_in_the_global_shuffle(
  storage_rig, photos_dir
):
  local = planner.plan(*opened(photos_dir, performance=PINNED), image_size=64)
  assert local.order == "global" and local.reads.block_records is None
  assert "order" not in local.stream
  with storage_rig.mount(photos_dir, latency_ms=1) as mounted:
    remote = planner.plan(*opened(str(mounted.path), performance=PINNED), image_size=64)
  assert remote.order == "blocks" and remote.sampler.blocks is not None
  assert remote.reads.block_records == remote.sampler.blocks.block_records
  assert remote.stream["order"].startswith(f"blocks of {remote.sampler.blocks.block_records}")
  assert remote.reads.latency_s >= 0.001  # the probe read through the mount


def test_the_stages_are_made_from_the_plan_and_print_it(photos_dir, capfd):
  spec = opened(photos_dir, performance={**PINNED, "memory_mb": 701})[0]
  stages = dataset.build(spec)
  host = stages.host
  assert stages.plan.sampler == host.sampler and stages.stream == host.stream
  assert stages.workers == host.parallel.workers and stages.decode.threads.size == 2
  assert stages.read.memory == host.memory and stages.read.bounds() == host.reads.depth
  assert stages.read.fetcher.opened == (host.reads.latency_s, host.reads.record_bytes)
  err = capfd.readouterr().err
  assert f"pipeline: {host.reads.describe()}\n" in err
  assert f"{host.parallel.describe()}; override with" in err and host.memory.describe() in err


def imports(path: pathlib.Path) -> set[str]:
  """The project modules and names `path` imports ("module" or "module.name")."""
  got = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module.startswith("pipeline"):
      got |= {f"{node.module}.{a.name}" for a in node.names}
    elif isinstance(node, ast.Import):
      got |= {a.name for a in node.names if a.name.startswith("pipeline")}
  return got


def test_no_stage_plans_it_takes_numbers_and_touches_the_host_only_for_types_and_guards():
  planning = ("pipeline.planner", "pipeline.spec", "pipeline.options", "pipeline.host.parallelism")
  for folder in ("stages", "mixing"):
    for path in sorted((ROOT / "pipeline" / folder).glob("*.py")):
      names = imports(path)
      assert not [n for n in names if n.startswith(planning)], path
      assert {n for n in names if n.startswith("pipeline.host.memory")} <= {
        "pipeline.host.memory.Split"
      }, path
      tree = ast.parse(path.read_text())
      functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
      takes_spec = [f.name for f in functions if "spec" in [a.arg for a in f.args.args]]
      assert not takes_spec, (path, takes_spec)
