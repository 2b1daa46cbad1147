"""`iterator.stats()`: each stage's figures in every process that runs it, storage's requests,
and the periodic table (`performance.stats_every_s`). Batches hold none of it."""

import gc
import re
import time
import weakref

import jax
import numpy as np
import pytest

import pipeline
from pipeline import dataset
from pipeline.spec import Spec
from pipeline.stages import stats

STAGES = {"plan", "read", "decode", "finish"}


def stream(data_dir, **performance):
  return iter(
    pipeline.make_dataset(
      data_dir,
      batch_size=8,
      image_size=16,
      shard_index=0,
      shard_count=1,
      performance={"num_threads": 1, "num_workers": 0, **performance},
    )
  )


def by_process(s: stats.Stats) -> dict[str, dict[str, stats.Row]]:
  out: dict = {}
  for row in s.rows:
    out.setdefault(row.process, {})[row.stage] = row
  return out


def test_one_process_counts_every_stage_and_each_storage_read(digits_dir):
  it = stream(digits_dir)
  batches = [next(it) for _ in range(10)]
  s = it.stats()
  it.close()
  assert all(set(b) == {"image", "label"} for b in batches)
  (main,) = by_process(s).values()
  assert set(main) == STAGES | {"handoff"}
  assert main["handoff"].items == 10 and main["handoff"].queued is None
  for stage in STAGES:  # work started ahead is counted too, never less than what came out
    assert main[stage].items >= 10, (stage, s.table())
  assert main["decode"].busy > 0 and main["decode"].p99_ms >= main["decode"].p50_ms > 0
  # the CPU seconds of the stage's threads: within their busy seconds (the clocks read apart)
  assert 0 < main["decode"].cpu <= 1.05 * main["decode"].busy + 1e-3, s.table()
  assert main["read"].queued is not None
  # the global order reads one record per request; a digits record is ~1 KB
  assert s.storage.requests == s.storage.reads >= 80
  assert s.storage.images_per_request == 1.0 and 0.3 < s.storage.kb_per_request < 3
  assert "storage: " in s.table().splitlines()[-1] and str(s) == s.table()


def test_worker_processes_report_their_own_rows_through_the_batches(digits_dir):
  it = stream(digits_dir, num_workers=2)
  for _ in range(12):
    next(it)
  s = it.stats()
  it.close()
  processes = by_process(s)
  main = next(p for p in processes if p.startswith("main"))
  workers = [p for p in processes if p.startswith("worker")]
  assert set(processes[main]) == {"handoff"} and processes[main]["handoff"].items == 12
  assert len(workers) == 2, s.table()
  for w in workers:
    assert set(processes[w]) == STAGES and processes[w]["finish"].items >= 6, s.table()
  assert s.storage.reads >= 12 * 8  # every worker's reads, summed
  # each process's memory and start-up: the workers never loaded JAX (pipeline.host.light)
  assert [p.process for p in s.processes] == [main, *workers]
  for p in s.processes[1:]:
    assert 20 < p.rss_mb < 1000 and p.started_s > 0 and not p.jax, s.table()
    assert f"{p.process}: {p.rss_mb:,.0f} MB resident, started in " in s.table()


def test_the_table_is_printed_every_stats_every_s(digits_dir, capfd):
  it = stream(digits_dir, stats_every_s=1e-6)
  next(it)
  next(it)
  it.close()
  err = capfd.readouterr().err
  assert err.count("pipeline stats:") == 2, err
  assert "decode" in err and "storage: " in err


def test_without_stats_every_s_nothing_is_printed(digits_dir, capfd):
  it = stream(digits_dir)
  next(it)
  it.close()
  assert "pipeline stats:" not in capfd.readouterr().err


def test_stats_every_s_must_be_positive(digits_dir):
  with pytest.raises(
    ValueError,
    match=r"performance.stats_every_s must be None \(never\) or a finite number > 0, got 0",
  ):
    stream(digits_dir, stats_every_s=0)


def test_latency_quantiles_come_from_log2_bins_within_a_factor_of_two():
  r = stats.Recorder()
  for _ in range(98):
    r.task("decode", 0.001)
  for _ in range(2):
    r.task("decode", 0.1)
  snapshot = r.snapshot()
  row = next(x for x in stats.collect({1: snapshot}, 1).rows if x.stage == "decode")
  assert 0.5 <= row.p50_ms <= 2 and 50 <= row.p99_ms <= 200
  assert row.items == 0 and np.isclose(row.busy * snapshot[0, 1], 0.298)


def test_each_call_covers_the_interval_since_the_last_in_images_per_second(digits_dir):
  it = stream(digits_dir)
  next(it)  # the first batch: the stream's start, the slowest of all
  first = it.stats()
  for _ in range(3):
    next(it)
  s = it.stats()
  it.close()
  (main,) = by_process(s).values()
  assert by_process(first)[next(iter(by_process(first)))]["handoff"].items == 1
  assert main["handoff"].items == 3  # this interval's batches only, not the 4 since the start
  assert 0 < s.seconds and main["handoff"].images_per_s == pytest.approx(3 * 8 / s.seconds)
  table = s.table().splitlines()
  assert table[0].split()[2:4] == ["batches", "images/s"]
  assert s.slowest in STAGES and table[-2].startswith(f"slowest stage: {s.slowest}, holding")
  assert 0 < s.slowest_share <= s.stages_share <= 1.0


def test_the_slowest_stage_is_the_one_that_held_the_batches_up_longest():
  r = stats.Recorder()
  r.task("read", 5.0)  # busy on its own threads, ahead of need: held nothing up
  r.handed("read", 0.01, 3)
  r.task("finish", 0.04, 1)  # runs in its consumer's thread: all of it holds the batch up
  before = r.snapshot()
  r.handed("decode", 0.3, 1)  # its consumer waited for it
  r.task("finish", 0.06, 1)
  r.handed("read", 0.04, 3)
  s = stats.collect({1: r.snapshot()}, 1, batch_size=8, since={1: before})
  assert s.slowest == "decode"  # of the interval's seconds: 0.3 s decode of 0.4 s all stages
  assert s.slowest_share * s.seconds == pytest.approx(0.3)
  assert s.stages_share * s.seconds == pytest.approx(0.4)
  line = s.table().splitlines()[-2]
  assert re.fullmatch(
    r"slowest stage: decode, holding the batches up \d+% of the last \d+\.\d s \(all stages "
    r"\d+%; the rest: hand-off and consumer\)",
    line,
  ), line
  read = next(row for row in s.rows if row.stage == "read")
  assert read.items == 1 and read.busy == 0  # the interval's: the 5 s of busy came before it
  whole = stats.collect({1: r.snapshot()}, 1, batch_size=8)  # since the start
  assert whole.slowest == "decode" and next(x for x in whole.rows if x.stage == "read").items == 2


def test_pipeline_input_gives_its_streams_stats(digits_dir):
  train = pipeline.input(
    digits_dir, "train", global_batch_size=8, image_size=16, performance={"num_workers": 0}
  )
  next(train)
  next(train)
  s = train.stats()
  train.close()
  handoff = next(r for r in s.rows if r.stage == "handoff")
  assert handoff.items >= 2 and s.storage.reads >= 16


def test_a_jax_profiler_trace_shows_each_stage(digits_dir, tmp_path):
  it = stream(digits_dir)
  next(it)
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(3):
      next(it)
  it.close()
  (trace,) = tmp_path.glob("plugins/profile/*/*.xplane.pb")
  data = trace.read_bytes()
  for stage in STAGES | {"handoff"}:
    assert f"pipeline.{stage}".encode() in data, stage
  assert b"_ipl_stage_cat" in data  # as Grain tags its stages for the input-pipeline view


def test_a_closed_stream_frees_its_stages_at_once_not_at_the_next_gc(digits_dir):
  """The counters hold no stage (a cycle through a stage's thread pool kept its threads alive
  until a collection: the soak saw threads and file descriptors pile up across restarts)."""
  spec = Spec.of(
    digits_dir,
    "train",
    batch_size=8,
    image_size=16,
    shard_index=0,
    shard_count=1,
    performance={"num_workers": 0, "num_threads": 1},
  )
  gc.disable()
  try:
    stages = dataset.build(spec)
    it = iter(dataset.chain(stages))
    read = weakref.ref(stages.read)
    next(it)
    it.close()
    del it, stages
    deadline = time.monotonic() + 30  # the prefetch thread may still be leaving its last call
    while read() is not None and time.monotonic() < deadline:
      time.sleep(0.05)
    assert read() is None
  finally:
    gc.enable()
