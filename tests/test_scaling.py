"""The scaling benchmark at tiny sizes: it runs end to end and reports well-formed, sane
figures and projections. No speed is asserted (the machines are shared)."""

import json

import pytest

from bench import scaling


def test_scaling_measures_costs_and_projects_hosts(photos_dir, tmp_path):
  out = tmp_path / "scaling.json"
  result = scaling.main(
    [
      str(photos_dir),
      "--batch-size",
      "8",
      "--image-size",
      "64",
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
  assert result["gil_held_us_per_image"] < result["cpu_us_per_image"]
  assert [r["threads"] for r in result["threads"]] == [1, 2]
  assert result["process_ceiling_img_s"] == max(r["img_s"] for r in result["threads"])
  workers = result["workers"]
  assert workers["first_batch_s"] > 0 and workers["rss_mb_per_worker"] > 50
  assert workers["receive_us_per_image"] >= 0 and workers["send_us_per_image"] >= 0
  hosts = result["hosts"]
  assert [h["cores"] for h in hosts] == [224, 2, 8]
  assert hosts[1]["workers"] == 0  # two cores: one process, whatever the costs
  by_cores = sorted(hosts, key=lambda h: h["cores"])
  rates = [h["projected_img_s"] for h in by_cores]
  assert rates == sorted(rates) and rates[0] > 0
  for h in hosts:
    assert max(h["workers"], 1) * h["threads"] <= h["cores"]
  assert json.loads(out.read_text())["hosts"] == hosts


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
