"""`pip install .` has only the library: a command that needs an extra names it in one line."""

import subprocess
import sys

import pytest

from tests.conftest import REPO


def run_without(tmp_path, module: str, *args: str) -> subprocess.CompletedProcess:
  """Runs `python ARGS` from the checkout as if `module` were not installed (a package of
  that name that fails to import, first on the path, as an absent one does)."""
  fake = tmp_path / "absent" / module
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text(
    f"raise ModuleNotFoundError({'No module named ' + repr(module)!r}, name={module!r})\n"
  )
  env = {"PYTHONPATH": f"{fake.parent}:{REPO}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
  return subprocess.run(
    [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )


@pytest.mark.parametrize(
  "module, args, line",
  [
    (
      "optax",
      ["-m", "train", "--config", "default", "--workdir", "w"],
      "python -m train needs optax (No module named 'optax'), from the "
      "'train' extra: pip install -e '.[train]' in the checkout (or pip install optax)",
    ),
    (
      "sklearn",
      ["-m", "pipeline.convert", "builtin", "DATA"],
      "error: convert builtin needs scikit-learn (No module named 'sklearn'), from the 'data' "
      "extra: pip install -e '.[data]' in the checkout (or pip install scikit-learn)",
    ),
    (
      "matplotlib",
      ["-m", "bench.doctor", "DATA"],
      "error: python -m bench.doctor needs matplotlib (No module named 'matplotlib'), from "
      "the 'bench' extra: pip install -e '.[bench]' in the checkout (or pip install matplotlib)",
    ),
    (
      "psutil",
      ["-m", "bench", "ceiling", "DATA"],
      "error: python -m bench needs psutil (No module named 'psutil'), from "
      "the 'bench' extra: pip install -e '.[bench]' in the checkout (or pip install psutil)",
    ),
    (
      "matplotlib",
      ["-m", "pipeline.show", "DATA", "--out", "grid.png"],
      "error: python -m pipeline.show needs matplotlib (No module named 'matplotlib'), from "
      "the 'bench' extra: pip install -e '.[bench]' in the checkout (or pip install matplotlib)",
    ),
  ],
)
def test_a_missing_extra_is_named_in_one_line(tmp_path, module, args, line):
  args = [a.replace("DATA", str(tmp_path / "data")) for a in args]
  out = run_without(tmp_path, module, *args)
  assert out.returncode != 0
  assert out.stderr.strip() == line, out.stderr[-2000:]
