"""`python -m bench convert`: our converter beside a sequential one, same files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


@pytest.mark.slow
def test_the_emulator_row_converts_the_same_images_from_gs_into_gs(photos_dir, tmp_path):
  """`--emulator`: SRC copied into a local Cloud Storage emulator and converted gs:// to gs://
  (its own process: it points gcsfs at the emulator for good)."""
  pytest.importorskip("gcp_storage_emulator", reason="the dev extra")
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "convert.json"
  command = [sys.executable, "-m", "bench", "convert", str(photos_dir), "--repeats", "1"]
  command += ["--workers", "2", "--emulator", "--json", str(out)]
  p = subprocess.run(
    command, cwd=repo, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": repo}
  )
  assert p.returncode == 0, p.stderr[-2000:]
  rows = json.loads(out.read_text())["rows"]
  assert [row["images"] for row in rows.values()] == [64] * 4
  assert "| pipeline.convert gs:// to gs:// (emulator), 2 workers |" in p.stdout
