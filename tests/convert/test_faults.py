"""Conversion under faults: killed at random points, or out of disk space, then resumed."""

import random
import resource
import signal
import subprocess
import sys
import time

import pytest

from pipeline.convert import images, shards, verify
from tests.conftest import REPO, run_command

CONVERT_IMAGES = [sys.executable, "-m", "pipeline.convert", "images"]
ARGS = ["--shard-size-mb", "0.5", "--val-fraction", "0.1", "--no-progress"]


@pytest.fixture(scope="module")
def whole(big_src, tmp_path_factory):
  out = tmp_path_factory.mktemp("faults") / "whole"
  images.convert(
    images.Request(big_src, out, shard_size_mb=0.5, val_fraction=0.1), workers=1, progress=False
  )
  return out


def convert_cmd(src, out, workers=2) -> list[str]:
  """The command line converting SRC into OUT in shards of 0.5 MB, a tenth for validation."""
  return [*CONVERT_IMAGES, str(src), str(out), *ARGS, "--workers", str(workers)]


def assert_identical(out, whole):
  names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
  assert names == sorted(p.name for p in whole.iterdir() if not p.name.startswith("."))
  for name in names:
    assert (out / name).read_bytes() == (whole / name).read_bytes(), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_at_a_random_point_then_rerun_gives_identical_shards(
  big_src, whole, tmp_path, seed
):
  out = tmp_path / "out"
  child = subprocess.Popen(
    convert_cmd(big_src, out), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  time.sleep(random.Random(seed).uniform(0.5, 3.0))  # start-up, planning or writing
  child.send_signal(signal.SIGKILL)
  child.wait()
  if (out / "manifest.json").exists():  # finished before the kill: still must be whole
    assert verify.verify(out, progress=False).ok
  rerun = run_command(convert_cmd(big_src, out, workers=1))
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert_identical(out, whole)
  assert verify.verify(out, progress=False).ok


def _limit_file_size(limit: int):
  def apply():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

  return apply


def test_disk_full_fails_clearly_leaves_nothing_complete_looking_and_resumes(
  big_src, whole, tmp_path
):
  out = tmp_path / "out"
  full = subprocess.run(
    convert_cmd(big_src, out),
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    preexec_fn=_limit_file_size(200_000),
  )
  assert full.returncode != 0
  assert "File too large" in full.stderr or "No space" in full.stderr, full.stderr[-2000:]
  assert "Traceback" not in full.stderr and "re-run the same command" in full.stderr
  assert not (out / "manifest.json").exists()
  assert not list(out.glob("*.array_record-*"))  # nothing is swapped into OUT before the end
  listed = [
    p for p in (out / shards.BUILD_DIR).glob("*.array_record-*") if not p.name.startswith(".")
  ]
  for shard in listed:  # whatever was renamed into place is a complete shard; the rest
    # (the shard being written) stays under a hidden temporary name
    assert shard.read_bytes() == (whole / shard.name).read_bytes(), shard.name
  rerun = run_command(convert_cmd(big_src, out))
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert_identical(out, whole)
