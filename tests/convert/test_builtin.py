"""Built-in datasets: digits and ImageNet-like photos made from images packages ship."""

from __future__ import annotations

import pathlib
import time

import pytest
from PIL import Image

from pipeline.catalog import manifest
from pipeline.convert import __main__ as cli
from pipeline.convert import builtin, verify


def test_digits_are_small_rgb_jpegs_in_class_folders(tmp_path):
  assert builtin.make_digits(tmp_path, num_images=50) == 50
  files = sorted(tmp_path.rglob("*.jpg"))
  assert len(files) == 50
  assert sorted(p.name for p in tmp_path.iterdir()) == [str(d) for d in range(10)]
  with Image.open(files[0]) as im:
    assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (32, 32))


def test_photos_are_imagenet_like_and_reproducible(tmp_path):
  builtin.make_photos(tmp_path / "a", num_images=6, seed=3, num_classes=3, workers=1)
  builtin.make_photos(tmp_path / "b", num_images=6, seed=3, num_classes=3, workers=2)
  builtin.make_photos(tmp_path / "c", num_images=6, seed=4, num_classes=3, workers=1)
  files = sorted((tmp_path / "a").rglob("*.jpg"))
  assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["astronaut", "chelsea", "coffee"]
  assert len(files) == 6
  for f in files:
    with Image.open(f) as im:
      assert im.format == "JPEG" and im.mode == "RGB"
      assert 430 <= im.width <= 510 and 350 <= im.height <= 430
    assert 40_000 < f.stat().st_size < 200_000
    assert f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes()
  assert (
    files[0].read_bytes() != (tmp_path / "c" / files[0].relative_to(tmp_path / "a")).read_bytes()
  )


def test_every_command_has_help(capsys):
  for command in ([], ["images"], ["tfrecord"], ["tfds"], ["verify"], ["builtin"]):
    with pytest.raises(SystemExit) as exit_info:
      cli.main(command + ["--help"])
    assert exit_info.value.code == 0
    assert "usage: python -m pipeline.convert" in capsys.readouterr().out


@pytest.mark.slow
def test_build_makes_both_datasets_once(tmp_path):
  made = builtin.build(tmp_path, progress=False)
  assert made["digits"].num_classes == 10
  assert (
    made["digits"].splits["train"].num_records + made["digits"].splits["validation"].num_records
    == 1797
  )
  assert made["photos"].num_classes == len(builtin.PHOTO_SOURCES)
  assert sum(s.num_records for s in made["photos"].splits.values()) == 1000
  for name in ("digits", "photos"):
    assert verify.verify(tmp_path / name, progress=False).ok
  start = time.monotonic()
  assert builtin.build(tmp_path, progress=False) == made
  assert time.monotonic() - start < 30  # nothing regenerated or rewritten
  assert manifest.load(tmp_path / "photos").created_by["source"] == str(tmp_path / "raw" / "photos")


def test_a_second_builtin_build_of_the_same_folder_waits_for_the_first(tmp_path):
  # The first build holds DATA/.builtin.lock; a second `convert builtin DATA` says it waits
  # and touches nothing (before: both built raw/ and one died with "Directory not empty").
  import fcntl
  import subprocess
  import sys

  with open(tmp_path / ".builtin.lock", "a") as held:
    fcntl.flock(held, fcntl.LOCK_EX)
    second = subprocess.Popen(
      [sys.executable, "-m", "pipeline.convert", "builtin", str(tmp_path)],
      cwd=pathlib.Path(__file__).resolve().parents[2],
      stderr=subprocess.PIPE,
      text=True,
    )
    try:
      line = second.stderr.readline()
      assert line.strip() == (
        f"convert builtin: another process is building {tmp_path}; waiting for it to finish"
      )
      time.sleep(0.5)
      assert second.poll() is None and not (tmp_path / "raw").exists()
    finally:
      second.kill()
      second.wait()


@pytest.mark.slow
def test_two_builtin_builds_at_once_both_succeed_with_one_dataset(tmp_path):
  import subprocess
  import sys

  command = [sys.executable, "-m", "pipeline.convert", "builtin", str(tmp_path)]
  repo = pathlib.Path(__file__).resolve().parents[2]
  runs = [
    subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(2)
  ]
  outs = [run.communicate(timeout=900) for run in runs]
  assert [run.returncode for run in runs] == [0, 0], outs
  assert sum("waiting for it to finish" in err for _, err in outs) == 1
  for name in ("digits", "photos"):
    assert verify.verify(tmp_path / name, progress=False).ok
