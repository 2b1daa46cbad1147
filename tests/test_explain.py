"""`pipeline.explain` names what bounds a pipeline and what to change, from measured costs.

The costs given here are the planner's own (`parallelism.COSTS`, split into stages as a run
measures them), so the explanation must agree with the plan the planner makes: its limits
are the planner's model at that plan, and what it proposes for processes x threads is the
planner's choice. Nothing here depends on this machine's speed.
"""

import dataclasses

import pytest

import pipeline
from pipeline.explain import Cost, Measured, Requests, Run, binding, explain, from_stats
from pipeline.host import parallelism
from pipeline.spec import Spec

GIB = 2**30
BATCH = 128


def planner_costs() -> dict[str, Cost]:
  """`parallelism.COSTS` as stages alone: 1,064 us of CPU per image, 61 us of it holding
  the GIL (read + parse + "other", the run's rest; "python", as the doctor measures it)."""
  ms = {"read": 0.02, "parse": 0.017, "decode": 0.803, "augment": 0.2}
  costs = {name: Cost(v, v) for name, v in ms.items()}
  return {**costs, "cache_fill": Cost(3.0, 3.0), "augment_cached": Cost(0.3, 0.3)}


def measured(rate=900.0) -> Measured:
  """A run on 2 cores (no workers) whose CPU per image is the planner's 1,064 us: 24 us
  beyond its stages ("other")."""
  q = Requests(2000, rate, 110.0, 1.0, "global", None, None, 0.05, 0.05)
  run = Run(rate, 0.5, 2000, 2000 / rate, 1.064, requests=q)
  return Measured(2, planner_costs(), run, cache_mb=1e9, dct_share=0.4, python_us=61.0)


def spec(**performance) -> Spec:
  return Spec.of("data/photos", batch_size=BATCH, image_size=224, performance=performance)


def planned(cores: int) -> parallelism.Plan:
  """The planner's choice for a host of `cores` cores with cores GiB, as make_dataset asks."""
  image = 224 * 224 * 3
  return parallelism.plan(cores, batch_size=BATCH, image_bytes=image, memory_bytes=cores * GIB)


def test_the_explained_host_runs_the_planners_plan_and_its_limits_are_the_planners_model():
  e = explain(spec(), measured(), cores=224)
  chosen = planned(224)
  assert (e.plan["workers"], e.plan["threads"]) == (chosen.workers, chosen.threads)
  assert chosen.workers > 1 and not e.here
  costs = parallelism.at_batch(parallelism.COSTS, BATCH)
  model = parallelism.limits(224, costs, chosen)
  for name in ("threads", "gil", "cores", "main"):
    assert e.limits[name] == pytest.approx(model[name], rel=1e-3), (name, e.limits, model)
  # the loader's own limits (reads, prefetch) come on top of the planner's projection
  assert e.predicted <= parallelism.project(224, costs, chosen) * 1.001
  # the planner's own choice is not proposed again
  assert not [r for r in e.recommendations if r.field == "num_workers x num_threads"]
  assert f"on 224 cores make_dataset chooses {chosen.describe()}" in e.notes


def test_one_process_on_many_cores_is_gil_bound_and_the_fix_is_the_planners_plan():
  e = explain(spec(num_workers=0, num_threads=64), measured(), cores=224)
  assert e.limit.startswith("the GIL: one process x ") and e.bottleneck in ("python", "other")
  assert e.limits["gil"] == pytest.approx(
    1e6 / 61 / parallelism.handoff_factor(e.plan["threads"], parallelism.COSTS.handoff), rel=1e-3
  )
  (rec,) = [r for r in e.recommendations if r.field == "num_workers x num_threads"]
  chosen = planned(224)
  assert rec.proposed == f"{chosen.workers} x {chosen.threads}" and rec.gain > 3
  assert rec.writes == {
    "performance.num_workers": chosen.workers,
    "performance.num_threads": chosen.threads,
  }


def test_on_the_measured_host_expected_rates_scale_the_measured_rate():
  e = explain(spec(num_threads=1), measured(rate=500.0))
  assert e.here and (e.plan["workers"], e.plan["threads"]) == (0, 1)
  assert e.limit.startswith("num_threads=1 decode threads per process")
  (rec,) = [r for r in e.recommendations if r.field == "num_workers x num_threads"]
  assert rec.proposed == "0 x 2" and rec.expected_images_per_sec == pytest.approx(
    500.0 * rec.gain, rel=0.01
  )


def test_every_limit_the_model_names_can_bind():
  names = set(parallelism.limits(224, parallelism.COSTS, parallelism.Plan(8, 2), batch_size=128))
  for name in names | {"requests", "reads", "prefetch"}:
    assert binding({n: 2.0 if n == name else 3.0 for n in names | {name}}) == name


def test_an_input_faster_than_the_step_names_the_step_and_changes_nothing():
  e = explain(spec(), measured(rate=900.0), step_ms=1000.0)  # the step needs 128 img/s
  assert e.bottleneck == "train step" and e.recommendations == []
  assert "keeps up with a 1000 ms step (128 img/s)" in e.notes[0]


def test_a_running_streams_own_stats_are_evidence_the_explanation_reads(photos_dir):
  """`from_stats`: each stage's busy and CPU time per image over the stream's processes, its
  rate and storage requests, from `iterator.stats()` of a real stream."""
  keywords = dict(batch_size=8, image_size=64, shard_index=0, shard_count=1)
  spec = Spec.of(photos_dir, **keywords, performance={"num_workers": 0, "num_threads": 1})
  it = iter(pipeline.make_dataset(photos_dir, **keywords, performance=spec.performance))
  for _ in range(12):
    next(it)
  stats = it.stats()
  it.close()
  m = from_stats(spec, stats, cores=8)
  (finish,) = [r for r in stats.rows if r.stage == "finish"]
  assert m.run.images_per_sec == pytest.approx(finish.images_per_s, rel=0.01)
  decode = m.costs["decode"]
  assert 0 < decode.cpu_ms <= 1.1 * decode.wall_ms and m.costs["parse"].wall_ms == 0.0
  assert m.run.cpu_ms_per_image >= decode.cpu_ms + m.costs["read"].cpu_ms
  assert m.run.requests.made == stats.storage.requests > 0 and m.cache_mb is m.dct_share is None
  # on 8 cores one decode thread binds; the planner's plan for the measured costs is proposed
  e = explain(spec, m, cores=8)
  assert (
    e.limit.startswith("num_threads=1 decode threads per process") and e.input_stage == "decode"
  )
  assert [r.field for r in e.recommendations][:1] == ["num_workers x num_threads"]
  assert not [r for r in e.recommendations if r.field in ("cache_mb", "dct_scaling")]
  assert not [n for n in e.notes if "DCT" in n or "caching" in n]  # neither was measured
  with pytest.raises(ValueError, match="no finished batch"):
    from_stats(spec, dataclasses.replace(stats, rows=()), cores=8)
