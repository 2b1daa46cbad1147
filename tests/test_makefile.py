"""The Makefile's targets are safe to start twice at once in a fresh clone."""

import os
import shutil
import stat
import subprocess

import pytest

from tests.conftest import REPO

FAKE_PYTHON = """#!/bin/sh
# python3 -m venv DIR: a venv whose pip logs each install and takes a while, as pip does.
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'PIP'
#!/bin/sh
echo "pip $*" >> "$(dirname "$0")/../../pip.log"
sleep 1
PIP
chmod +x "$3/bin/pip"
"""


@pytest.mark.skipif(not shutil.which("flock") or not shutil.which("make"), reason="needs make")
def test_two_makes_at_once_in_a_fresh_clone_install_the_environment_once(tmp_path):
  clone = tmp_path / "clone"
  (clone / "pipeline").mkdir(parents=True)
  shutil.copy(REPO / "Makefile", clone)
  for name in ("pyproject.toml", "setup.py", "pipeline/_jpeg.c"):
    (clone / name).write_text("")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "python3").write_text(FAKE_PYTHON)
  (bin_dir / "python3").chmod(stat.S_IRWXU)
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
  runs = [
    subprocess.Popen(
      ["make", "setup"],
      cwd=clone,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for _ in range(2)
  ]
  outs = [run.communicate(timeout=60)[0] for run in runs]
  assert [run.returncode for run in runs] == [0, 0], outs
  installs = (clone / "pip.log").read_text().splitlines()
  assert installs == [
    "pip install --quiet --upgrade pip",
    "pip install --quiet -e .[train,data,bench,dev]",
  ]
  assert sum("installed by another make meanwhile" in out for out in outs) == 1
  assert (clone / ".venv" / ".installed").exists()
