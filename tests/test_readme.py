"""The README's usage examples run as written, from an empty folder."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_flax_example_runs_as_written(digits_dir, tmp_path):
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## Using the pipeline in your own Flax experiment")[1].split("\n## ")[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 3
  home = tmp_path / "home"
  (home / "pipeline-data").mkdir(parents=True)
  (home / "pipeline-data" / "digits").symlink_to(digits_dir)
  check = "\n".join(blocks) + (
    "\nassert batch['image'].sharding.spec[0] == 'data'"
    "\nassert 0 <= hits <= 60 and float(loss) > 0"
    "\nassert next(train)['image'].shape[0] == 64"
    "\nassert batch['label'].shape == (64, 10) and batch['label2'].shape == (64,)"
    "\nassert batch['filename'].dtype.kind == 'S' and b'/' in batch['filename'][0]"
    "\nprint('OK')\n"
  )
  env = dict(os.environ, HOME=str(home), XLA_FLAGS="--xla_force_host_platform_device_count=4")
  env.pop("PYTHONPATH", None)
  empty = tmp_path / "cwd"
  empty.mkdir()
  out = subprocess.run(
    [sys.executable, "-c", check], cwd=empty, env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout
