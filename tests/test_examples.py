"""examples/: complete experiments on the pipeline run as written, from any folder."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "custom_ops.py"


def run(args: list[str], cwd: pathlib.Path) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  out = subprocess.run(
    [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def losses(stdout: str) -> dict[int, str]:
  return {int(s): loss for s, loss in re.findall(r"step (\d+): loss (\S+)", stdout)}


@pytest.mark.slow
def test_custom_ops_example_trains_and_resumes_exactly_from_any_folder(tmp_path):
  flags = ["--steps", "6", "--log-every", "1", "--batch-size", "16", "--image-size", "16"]
  data = tmp_path / "digits"
  straight = run([str(EXAMPLE), str(data), "--make-digits", "100", *flags], cwd=tmp_path)
  assert "validation accuracy" in straight and "e.g. wrong:" in straight
  # Interrupted after 3 steps, then resumed in the same workdir: the same losses.
  resume = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('custom_ops', {str(EXAMPLE)!r})\n"
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
    f"flags = {flags!r}\n"
    f"m.main([{str(data)!r}, '--workdir', 'run', *flags[2:], '--steps', '3'])\n"
    f"m.main([{str(data)!r}, '--workdir', 'run', *flags])\n"
  )
  resumed = run(["-c", resume], cwd=tmp_path)
  assert "resumed at step 3" in resumed
  assert losses(resumed) == losses(straight) and len(losses(straight)) == 6


def test_the_example_says_what_is_missing_without_data(tmp_path):
  out = subprocess.run(
    [sys.executable, str(EXAMPLE), str(tmp_path / "none")],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 2
  assert out.stderr.strip().endswith("convert a dataset there first, or pass --make-digits N")


@pytest.mark.slow
def test_the_flax_imagenet_port_evaluates_every_image_once_per_epoch(tmp_path):
  """Its eval loop calls next() steps_per_eval times per evaluation (repeat=True), and its
  metrics count the rows of the mask: each evaluation is one whole pass of the 60 images."""
  port = ROOT / "examples" / "flax_imagenet.py"
  flags = ["--make-digits", "300", "--epochs", "2", "--batch-size", "32", "--image-size", "16"]
  out = run([str(port), str(tmp_path / "digits"), *flags], cwd=tmp_path)
  epochs = re.findall(
    r"epoch (\d): train loss \S+, eval loss \S+, accuracy \S+ over (\d+) images", out
  )
  assert epochs == [("0", "60"), ("1", "60")], out
