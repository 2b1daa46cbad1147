"""The pipeline doctor names the stage made slow on purpose and recommends the fix.

Slowness is injected into the real pipeline (real shards, real JPEGs, real threads): a
source that sleeps per record, an augment that sleeps per image, one decode thread.
"""

import json
import pathlib
import subprocess
import sys
import time

import pytest

import pipeline.dataset
import pipeline.source
from bench import doctor
from pipeline import augment

ROOT = pathlib.Path(__file__).resolve().parent.parent


def settings(data_dir, **kw) -> doctor.Settings:
  return doctor.Settings(str(data_dir), **{"batch_size": 8, "image_size": 64, **kw})


def quick(s: doctor.Settings, **kw) -> doctor.Diagnosis:
  return doctor.diagnose(s, **{"seconds": 1.0, "sample": 24, **kw})


def proposal(d: doctor.Diagnosis, field: str):
  return next((r for r in d.recommendations if r.field == field), None)


def test_slow_source_is_named_read_and_more_prefetch_recommended(photos_dir, monkeypatch):
  fast = pipeline.source.ShardedSource

  class SlowSource(fast):  # storage with 10 ms of latency per record
    def read(self, indices):
      time.sleep(0.01 * len(indices))
      return super().read(indices)

  monkeypatch.setattr(pipeline.dataset, "ShardedSource", SlowSource)
  d = quick(settings(photos_dir, num_threads=2, prefetch=2))
  assert d.costs["read"].wall_ms >= 10
  assert d.bottleneck == "read", doctor.report(d)
  assert "prefetch" in d.limit
  more = proposal(d, "prefetch")
  assert more is not None and more.proposed > 2 and more.gain > 1.05, doctor.report(d)


def test_slow_map_is_named_augment_and_more_threads_than_cores_recommended(
    photos_dir, monkeypatch):
  resize = augment.resize

  def slow_resize(image, size, out=None):  # an augmentation that waits 15 ms (GIL released)
    time.sleep(0.015)
    return resize(image, size, out)

  monkeypatch.setattr(augment, "resize", slow_resize)
  d = quick(settings(photos_dir, num_threads=2))
  assert d.bottleneck == "augment", doctor.report(d)
  threads = proposal(d, "num_threads")
  # The work mostly waits, so threads beyond the cores pay.
  assert threads is not None and threads.proposed > max(2, d.cores), doctor.report(d)


@pytest.mark.skipif(doctor.default_threads() < 2, reason="needs two cores")
def test_one_thread_on_decode_heavy_photos_cli_recommends_a_thread_per_core(
    photos_dir, tmp_path):
  tuned, picture, out = tmp_path / "tuned.py", tmp_path / "timeline.png", tmp_path / "d.json"
  d = doctor.main([str(photos_dir), "--config", str(ROOT / "configs" / "default.py"),
                   "--num-threads", "1", "--image-size", "224", "--batch-size", "8",
                   "--cache-mb", "0", "--seconds", "1", "--sample", "24",
                   "--apply", str(tuned), "--timeline", str(picture), "--json", str(out)])
  assert d.bottleneck == "decode", doctor.report(d)
  assert "num_threads=1" in d.limit
  threads = proposal(d, "num_threads")
  assert threads is not None and threads.proposed >= 2 and threads.gain > 1.05

  # --apply: a config on top of the base one with the diagnosed and the tuned fields.
  assert "from configs import default as base" in tuned.read_text()
  config = doctor.load_config(str(tuned))
  assert config.num_threads == threads.proposed
  assert (config.data_dir, config.image_size, config.batch_size) == (str(photos_dir), 224, 8)
  assert config.model == "mobilenet_v1"  # everything else comes from the base config
  assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  saved = json.loads(out.read_text())
  assert saved["bottleneck"] == "decode" and saved["run"]["images_per_sec"] > 0


def test_fast_input_beside_a_slow_step_names_the_step(digits_dir):
  d = quick(doctor.Settings(str(digits_dir), batch_size=16, image_size=32), step_ms=100)
  assert d.bottleneck == "train step", doctor.report(d)
  assert d.consumer_run is not None and 0 <= d.consumer_run.wait_share < 0.5
  assert d.consumer_run.images_per_sec <= 16 / 0.100 * 1.05  # the step sets the pace
  assert not d.recommendations  # a faster input would not train faster


def test_stage_costs_and_model_agree_on_the_limit(photos_dir):
  d = quick(settings(photos_dir))
  assert {"read", "parse", "decode", "augment", "batch"} <= d.costs.keys()
  assert all(c.wall_ms > 0 and c.cpu_ms >= 0 for c in d.costs.values())
  assert d.predicted == min(d.limits.values())
  assert d.run.images_per_sec > 0 and d.run.first_batch_s > 0
  for rec in d.recommendations:
    assert rec.gain >= 1.05 and rec.expected_images_per_sec > d.run.images_per_sec


def test_cli_help_and_missing_data_dir(capsys):
  help_ = subprocess.run([sys.executable, "-m", "pipeline.doctor", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
  assert "--apply" in help_.stdout and "bottleneck" in help_.stdout
  with pytest.raises(SystemExit) as exit_:
    doctor.main([])
  assert exit_.value.code == 2 and "DATA_DIR or --config" in capsys.readouterr().err
