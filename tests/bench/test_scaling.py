"""The scaling benchmark at tiny sizes: it runs end to end and reports well-formed figures
and projections. No speed is asserted, nor any order between two measured costs (the
machines are shared: either may be inflated); relations the arithmetic makes are."""

import json

import pytest

from bench import scaling
from pipeline.host import parallelism
from pipeline.stages import read as read_lib


@pytest.mark.slow
def test_scaling_measures_costs_and_projects_hosts(photos_dir, tmp_path):
  out = tmp_path / "scaling.json"
  result = scaling.main(
    [
      str(photos_dir),
      "--batch-size",
      "8",
      "--image-size",
      "128",  # decode well above the rest's CPU even on a loaded machine
      "--seconds",
      "0.1",
      "--threads",
      "1,2",
      "--workers",
      "1",
      "--worker-threads",
      "1",
      "--cores",
      "224,2,8",
      "--latency-ms",
      "5",
      "--repeat",
      "2",
      "--host-batch",
      "8,16",
      "--json",
      str(out),
    ]
  )
  assert result["emulation_honoured"]  # the loader replaced decode and resize by waits
  for key in (
    "process_ceiling_img_s",
    "gil_held_us_per_image",
    "cpu_us_per_image",
    "decode_us_per_image",
  ):
    assert result[key] > 0, key
  assert 0 < result["resize_share"] < 1
  # the GIL-held time is measured: the rest's CPU less the read's GIL-free CPU
  assert 0 <= result["gil_held_us_per_image"] <= result["rest_cpu_us_per_image"]
  assert result["read_cpu_us_per_image"] > 0 and result["read_copy_us_per_image"] > 0
  # relations that rounding each figure keeps (the arithmetic itself: gil_terms' test below)
  assert 0 <= result["read_gil_free_us_per_image"] <= result["read_cpu_us_per_image"]
  assert result["gil_fitted_us_per_image"] > 0
  assert result["ceiling_bound_by"] in ("cores", "gil") and result["ceiling_cores_used"] > 0
  assert result["ceiling_gil_busy"] >= 0
  # the model's GIL time is the shim's direct measure (bench.gil), the median of 2 runs
  direct, gil = result["gil_direct_us_per_image"], result["costs"]["gil_us"]
  assert direct > 0 and round(gil, 1) == max(direct, 1.0)
  if gil > 1.0:  # the model's figure is the measure itself, not its floor of 1 us
    assert result["process_ceiling_gil_img_s"] == round(1e6 / gil)
  spreads = result["spreads"]
  # the figure is rounded to 0.1 us, the spread's ends to 0.01 us
  assert spreads["gil_direct_us"]["min"] - 0.05 <= direct <= spreads["gil_direct_us"]["max"] + 0.05
  for key in ("cpu_us", "rest_cpu_us", "send_us", "main_us@8", "main_us@16"):
    s = spreads[key]
    assert s["min"] <= s["median"] <= s["max"] and s["spread"] >= 0, key
  assert result["repeat"] == 2
  spied = result["gil_pyspy_us_per_image"]
  assert spied is None or spied >= 0
  assert [r["threads"] for r in result["threads"]] == [1, 2]
  assert result["process_ceiling_img_s"] == max(r["img_s"] for r in result["threads"])
  workers = result["workers"]
  assert workers["first_batch_s"] > 0 and workers["rss_mb_per_worker"] > 50
  assert workers["receive_us_per_image"] >= 0 and workers["send_us_per_image"] >= 0
  assert set(workers["main_us_per_image"]) == {"8", "16"}  # measured at each host batch
  assert result["costs"]["threads_per_core"] == 2 and result["costs"]["step_us"] > 0
  hosts = [h for h in result["hosts"] if h["batch"] == 8]
  assert [h["cores"] for h in hosts] == [224, 2, 8]
  assert hosts[1]["workers"] == 0  # two cores: one process, whatever the costs
  by_cores = sorted(hosts, key=lambda h: h["cores"])
  rates = [h["projected_img_s"] for h in by_cores]
  assert rates == sorted(rates) and rates[0] > 0
  for h in hosts:
    assert max(h["workers"], 1) * h["threads"] <= h["cores"]
  storage = result["storage"]  # step 8: the best run again behind the 5 ms rig
  assert storage["latency_ms"] == 5 and storage["img_s"] > 0
  assert storage["reads_per_image"] > 0 and storage["max_reads_in_flight"] >= 1
  assert storage["rig_0ms_img_s"] > 0 and storage["of_rig_0ms"] > 0
  for h in hosts:
    assert h["at_latency_img_s"] <= h["projected_img_s"]
    assert h["reads_in_flight"] == read_lib.reads_in_flight(h["at_latency_img_s"], 0.005)
    assert h["gets_per_s"] == round(h["at_latency_img_s"] * storage["reads_per_image"])
  store = result["store"]  # the block order: its workers share each block's read
  assert store["us_per_image"] > 0 and store["gil_us_per_image"] > 0
  assert store["block_records"] >= 16
  for h in hosts:
    b = h["blocks"]
    assert b["images_per_request"] == store["block_records"] and b["reads_per_block_per_host"] == 1
    # the store's CPU on top (a plan is any within 3% of the best: it may pick another)
    assert 0 < b["projected_img_s"] <= h["projected_img_s"] / parallelism.NEAR_BEST
  assert "The block order" in scaling.table(result)
  assert json.loads(out.read_text())["hosts"] == result["hosts"]


def test_gil_held_time_is_the_rest_less_the_reads_gil_free_cpu():
  terms = scaling.gil_terms(rest_cpu=110.0, read_cpu=70.0, copy=5.0)
  assert terms["read_gil_free_us_per_image"] == 65.0
  assert terms["gil_held_us_per_image"] == 45.0
  # a read costing more than the rest (noise) never makes the GIL time negative
  assert scaling.gil_terms(rest_cpu=50.0, read_cpu=80.0, copy=5.0)["gil_held_us_per_image"] == 0


def test_a_ceiling_that_fills_the_machine_is_bound_by_cores():
  full = {"img_s": 10_000.0, "cpu_us": 180.0}  # 1.8 cores busy
  assert scaling.ceiling_bound(full, cores=2) == (1.8, "cores")
  assert scaling.ceiling_bound(full, cores=8) == (1.8, "gil")


def test_the_gil_fit_recovers_a_known_curve():
  gil, handoff = 100.0, 0.05
  curve = [
    {"threads": t, "img_s": min(t * 800.0, 1e6 / (gil * (1 + handoff * (t - 1))))}
    for t in (1, 2, 4, 8, 16, 32)
  ]
  fitted_gil, fitted_handoff = scaling.fit_gil(curve)
  assert fitted_gil == pytest.approx(gil, rel=0.02)
  assert fitted_handoff == pytest.approx(handoff, abs=0.003)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--threads", "0,2"], "comma-separated positive integers"),
    (["--cores", "many"], "comma-separated positive integers"),
  ],
)
def test_usage_errors_are_one_line_with_exit_2(photos_dir, argv, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    scaling.main([str(photos_dir), *argv])
  assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_dataset_is_one_line_with_exit_2(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    scaling.main([str(tmp_path / "nowhere")])
  err = capsys.readouterr().err.strip()
  assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "manifest.json" in err


def test_a_hosts_storage_needs_are_those_of_its_published_rate():
  storage = {"latency_ms": 5.0, "reads_per_image": 7.377, "of_rig_0ms": 0.613}
  rows = scaling.hosts(parallelism.COSTS, [2, 8, 224], 128, [128], 224, storage, 110.0)
  for h in rows:
    assert h["gets_per_s"] == round(h["at_latency_img_s"] * storage["reads_per_image"])
    assert h["reads_in_flight"] == read_lib.reads_in_flight(h["at_latency_img_s"], 0.005)


def test_the_block_order_gets_the_global_orders_workers_less_only_the_stores_cpu():
  store = {"us_per_image": 55.0, "gil_us_per_image": 4.0, "block_records": 32}
  (row,) = scaling.hosts(parallelism.COSTS, [224], 128, [1024], 224, record_kb=110.0, store=store)
  b = row["blocks"]
  assert b["workers"] > 4  # no longer only counts dividing a window's 4 batches
  assert 0.9 * row["projected_img_s"] <= b["projected_img_s"] <= row["projected_img_s"]
  assert b["images_per_request"] == 32 and b["blocks_held_mb"] == round(
    2 * 4 * 1024 * 32 * 110 / 1024
  )
