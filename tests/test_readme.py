"""The README's usage example runs as written."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_flax_example_runs_as_written(digits_dir, tmp_path):
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## Using the pipeline in your own Flax experiment")[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "digits").symlink_to(digits_dir)
  check = code + (
      "\nassert logits.shape == (64, 10), logits.shape"
      "\nassert batch['image'].sharding.spec[0] == 'data'\nprint('OK')\n")
  env = dict(os.environ, PYTHONPATH=str(ROOT),
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  out = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().endswith("OK")
