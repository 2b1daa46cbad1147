"""The doctor counts storage requests and names storage's request budget when it binds.

Storage that answers only so many requests a second, however many are in flight, is not
fixed by threads or worker processes: the doctor names the budget, its requests/s ceiling and
the settings that change it (max_requests_per_s, order, block_records). The reasoning is
specified on given measurements; the command line runs the real pipeline through the
storage rig (bench/rig.py) with a request cap, and on local disk.
"""

import dataclasses

import pytest

from bench import doctor
from bench.storage_check import Level, StorageCheck
from pipeline import explain
from pipeline.explain import Requests, Run
from tests.bench.test_doctor import measured, proposal, settings, stage_costs


def capped_check(ceiling=250.0) -> StorageCheck:
  """Storage at 20 ms per read alone whose throughput stops at `ceiling` reads/s while the
  latency of more reads in flight grows (as the rig at 20 ms and 250 requests/s measures)."""
  levels = [
    Level(1, 256, 20.3, 20.4, 49.0, 5.0, 0.02),
    Level(16, 256, 64.0, 66.0, ceiling, 25.0, 0.03),
    Level(128, 256, 512.0, 520.0, ceiling, 25.0, 0.03),
  ]
  return StorageCheck("gs-fuse/ds", 100_000, 111, 100.0, 40.0, levels)


def requests(per_s=248.0, order="global", block_records=None, latency_ms=400.0) -> Requests:
  per = 1.0 if order == "global" else 15.4
  return Requests(1000, per_s, 110.0 * per, per, order, block_records, None, 20.6, latency_ms)


def run_with(rate: float, q: Requests, cpu_ms=1.5) -> Run:
  return Run(rate, 1.0, 2000, 8.0, cpu_ms, requests=q)


def storage_bound(rate: float, q: Requests, python_us=13_492.0) -> doctor.Measurements:
  """Measurements of a run held at storage's request ceiling; `python_us` as the emulated
  run measures it there (it too waits on storage: issue 28's 13,492 us "GIL")."""
  m = measured(stage_costs(read=(4.0, 0.1)), rate=rate)
  m.run, m.storage, m.python_us = (
    run_with(rate, q, m.run.cpu_ms_per_image),
    capped_check(),
    python_us,
  )
  return m


def test_a_run_at_storages_request_ceiling_names_the_budget_not_the_gil():
  m = storage_bound(245.0, requests())
  d = doctor.diagnose(settings(128, num_workers=0, num_threads=None), m, cores=224)
  text = doctor.report(d)
  assert d.bottleneck == explain.REQUEST_BUDGET and "~250 requests/s" in d.limit, text
  assert "python" not in d.costs and "the GIL" not in d.limit
  assert d.limits["requests"] == 250.0
  under = proposal(d, "max_requests_per_s")
  assert (under.proposed, under.writes) == (237, {"performance.max_requests_per_s": 237})
  blocks = proposal(d, "order")
  assert (blocks.proposed, blocks.writes) == ("blocks", {"order": "blocks"})
  assert blocks.expected_images_per_sec == pytest.approx(237 * 16, rel=0.01)
  assert proposal(d, "num_workers x num_threads") is None  # 218 workers fix no storage cap
  assert "storage requests (order='global': one per image)" in text
  assert "248/s, 110 KB and 1.0 images per request" in text


def test_in_the_block_order_larger_blocks_reach_the_rate_the_host_allows():
  q = requests(240.0, "blocks", 16)
  m = storage_bound(3700.0, q)
  d = doctor.diagnose(settings(128, num_workers=0, num_threads=None), m, cores=224)
  assert d.bottleneck == explain.REQUEST_BUDGET, doctor.report(d)
  assert proposal(d, "order") is None
  bigger = proposal(d, "block_records")
  assert bigger.current == 16 and bigger.proposed > 16, doctor.report(d)
  assert bigger.writes == {"block_records": bigger.proposed}
  # the rate the rest of the host allows, at 237 requests/s of that many images each
  assert bigger.proposed == -(-bigger.expected_images_per_sec // 237)


def test_reads_waiting_for_a_cpu_on_a_loaded_machine_are_no_request_budget():
  """Local disk beside other jobs (seen from a fresh clone's CI): more reads in flight give
  no more throughput and a longer latency, but far under the queue a rate cap makes."""
  levels = [
    Level(1, 24, 0.03, 0.05, 6538.0, 7.5, 0.19),
    Level(8, 24, 0.06, 0.22, 1545.0, 1.8, 0.19),
  ]
  check = StorageCheck("data/digits", 1438, 1, 0.1, 1.1, levels)
  assert check.request_budget_per_s(cores=2) is None
  assert capped_check().request_budget_per_s(cores=2) == 250.0  # a real cap still is one


def test_a_run_well_under_the_ceiling_keeps_the_verdict():
  m = storage_bound(400.0, requests(per_s=25.0, order="blocks", block_records=16, latency_ms=21))
  m.python_us = None
  d = doctor.diagnose(settings(), m)
  plain = doctor.diagnose(settings(), measured(stage_costs(read=(4.0, 0.1)), rate=400.0))
  assert d.bottleneck == plain.bottleneck != explain.REQUEST_BUDGET
  assert "requests" not in d.limits and not proposal(d, "max_requests_per_s")
  assert [r.field for r in d.recommendations] == [r.field for r in plain.recommendations]


QUICK = ["--seconds", "1", "--sample", "8", "--batch-size", "8", "--image-size", "32"]
QUICK += ["--storage-levels", "1,8", "--storage-reads", "24", "--record-cache-mb", "0"]
QUICK += ["--timeline", "", "--json", ""]


def test_through_a_request_capped_rig_the_verdict_is_the_request_budget(
  storage_rig, digits_dir, capsys
):
  with storage_rig.mount(digits_dir, latency_ms=10, requests_per_s=40) as rig:
    d = doctor.main([str(rig.path), *QUICK, "--order", "global"])
    capped = rig.stats()["capped"]
  text = capsys.readouterr().out
  assert capped > 0
  assert d.bottleneck == explain.REQUEST_BUDGET, text
  # 24 reads at 8 in flight take 23 turns of 1/40 s: never more than 40 x 24 / 23 a second
  ceiling = d.measured.storage.request_budget_per_s(d.cores)
  assert ceiling <= 40 * 24 / 23 and d.limits["requests"] == ceiling
  q = d.run.requests
  assert q.made > 0 and q.images_per_request == 1.0 and q.order == "global"
  under = proposal(d, "max_requests_per_s")
  assert under.proposed == int(0.95 * ceiling) and under.proposed < 40
  assert proposal(d, "order").proposed == "blocks"
  assert f"bottleneck on this host ({d.cores} cores): storage request budget" in text
  assert "The request budget binds" in text  # the storage check's table says so too


def test_in_the_block_order_a_bucket_gets_by_default_the_budget_is_named_too(
  storage_rig, digits_dir, capsys
):
  with storage_rig.mount(digits_dir, latency_ms=10, requests_per_s=20) as rig:
    # a FUSE mount: the block order (blocks of 16: by default these 1.6 KB digits would
    # make one block of a shard)
    d = doctor.main([str(rig.path), *QUICK, "--block-records", "16"])
  text = capsys.readouterr().out
  assert d.bottleneck == explain.REQUEST_BUDGET, text
  q = d.run.requests
  assert q.order == "blocks" and q.block_records == 16 and q.images_per_request > 1
  assert d.limits["requests"] == pytest.approx(  # limits are rounded to 0.1
    d.measured.storage.request_budget_per_s(d.cores) * q.images_per_request, abs=0.05
  )
  assert proposal(d, "max_requests_per_s").proposed < 20 and not proposal(d, "order")
  assert "python" not in d.costs  # the emulated run would have waited on storage


def test_on_local_disk_the_verdict_does_not_name_the_request_budget(digits_dir, capsys):
  d = doctor.main([str(digits_dir), *QUICK, "--order", "global"])
  text = capsys.readouterr().out
  assert d.bottleneck != explain.REQUEST_BUDGET and "requests" not in d.limits, text
  assert "request budget" not in text and not proposal(d, "max_requests_per_s")
  q = d.run.requests
  assert q.made > 0 and q.images_per_request == 1.0  # global order: a request per image


def test_with_worker_processes_their_requests_are_counted_and_the_budget_named(
  storage_rig, digits_dir, capsys
):
  with storage_rig.mount(digits_dir, latency_ms=10, requests_per_s=40) as rig:
    d = doctor.main([str(rig.path), *QUICK, "--order", "global", "--num-workers", "2"])
    served = rig.stats()["reads"]
  text = capsys.readouterr().out
  q = d.run.requests
  assert q is not None and 0 < q.made <= served and q.images_per_request == 1.0, text
  assert d.bottleneck == explain.REQUEST_BUDGET, text
  assert "requests/s" in text


def test_a_max_requests_per_s_under_the_ceiling_is_the_budget_and_not_proposed_again():
  q = dataclasses.replace(requests(230.0, "blocks", 16), max_per_s=237.0)
  d = doctor.diagnose(settings(128), storage_bound(3500.0, q), cores=224)
  assert d.bottleneck == explain.REQUEST_BUDGET, doctor.report(d)
  assert d.limits["requests"] == pytest.approx(237 * 15.4, abs=0.1)
  assert "max_requests_per_s=237" in d.limit and not proposal(d, "max_requests_per_s")
