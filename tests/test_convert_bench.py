"""`python -m pipeline.bench convert`: our converter beside a sequential one, same files."""

from __future__ import annotations

import json

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
    assert row["images_per_s"] > 0 and row["mb_per_s"] > 0 and row["cpu_seconds"] > 0
  assert json.loads((tmp_path / "convert.json").read_text())["rows"] == result["rows"]
  table = capsys.readouterr().out
  assert "| sequential (Pillow full decode, 1 process) |" in table
  assert "| pipeline.convert, 2 workers |" in table
