"""`python -m bench convert`: our converter beside a sequential one, same files."""

from __future__ import annotations

import json

import pytest

from bench import convert_speed as bench_convert


def test_reports_rates_for_every_contender_on_the_same_images(photos_dir, tmp_path, capsys):
  result = bench_convert.main(
    [str(photos_dir), "--repeats", "1", "--workers", "2", "--json", str(tmp_path / "convert.json")]
  )
  assert result["images"] == 64
  assert result["source"].endswith("raw")  # found through the manifest's source
  assert len(result["rows"]) == 3
  for row in result["rows"].values():
    assert row["images"] == 64
    # the rates are the counts over the timed seconds (no speed is asserted: CI is shared)
    assert row["images_per_s"] == pytest.approx(64 / row["seconds"])
    assert row["images_per_cpu_s"] == pytest.approx(64 / row["cpu_seconds"])
  assert json.loads((tmp_path / "convert.json").read_text())["rows"] == result["rows"]
  table = capsys.readouterr().out
  assert "| sequential (Pillow full decode, 1 process) |" in table
  assert "| pipeline.convert, 2 workers |" in table
