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
  (clone / "pipeline" / "image").mkdir(parents=True)
  shutil.copy(REPO / "Makefile", clone)
  for name in ("pyproject.toml", "setup.py", "pipeline/image/_jpeg.c"):
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
    "pip install --quiet -e .[train,tensorboard,data,bench,dev,gpu]",
  ]
  assert sum("installed by another make meanwhile" in out for out in outs) == 1
  assert (clone / ".venv" / ".installed").exists()


FAKE_MAKEFILE = """\
test:
\t@echo "test ARGS=$(ARGS)" >> log; exit $(TEST_RC)
lint:
\t@echo lint >> log; exit $(LINT_RC)
"""


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
@pytest.mark.parametrize("test_rc, lint_rc", [(1, 0), (0, 1), (0, 0)])
def test_ci_runs_lint_even_when_tests_fail_and_fails_if_either_does(tmp_path, test_rc, lint_rc):
  (tmp_path / ".ci").mkdir()
  shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
  (tmp_path / "Makefile").write_text(FAKE_MAKEFILE)
  env = dict(os.environ, TEST_RC=str(test_rc), LINT_RC=str(lint_rc))
  run = subprocess.run(["bash", ".ci/run"], cwd=tmp_path, env=env, capture_output=True, timeout=60)
  assert (tmp_path / "log").read_text().splitlines() == ["test ARGS=", "lint"]  # all tests run
  assert (run.returncode == 0) == (test_rc == lint_rc == 0), run
