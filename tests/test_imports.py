"""The library's import boundaries: `pipeline/` never imports the repository's tools or
trainer, and converting a folder loads neither Grain nor JAX."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUTSIDE = {"bench", "train", "configs", "tests"}  # repository folders beside the library


def imported_modules(path: pathlib.Path) -> list[str]:
  """Every module a file names in an import statement or an `import_module("...")` call."""
  names = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.append(node.module)
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
      func = node.func
      called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
      if called in ("import_module", "__import__"):
        names.append(str(node.args[0].value))
  return names


def test_the_library_imports_nothing_from_the_repositorys_tools_or_trainer():
  files = sorted((ROOT / "pipeline").rglob("*.py"))
  assert len(files) > 20
  found = {
    f"{path.relative_to(ROOT)}: {name}"
    for path in files
    for name in imported_modules(path)
    if name.split(".")[0] in OUTSIDE
  }
  assert not found, sorted(found)


def test_converting_a_folder_loads_neither_grain_nor_jax(tmp_path):
  rng = np.random.default_rng(0)
  for label in ("cat", "dog"):
    (tmp_path / "src" / label).mkdir(parents=True)
    for i in range(3):
      pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
      Image.fromarray(pixels).save(tmp_path / "src" / label / f"{i}.jpg", quality=90)
  # Every process (the CLI's and its conversion workers') reports each import on stderr.
  env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "TQDM_DISABLE": "1"}
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "pipeline.convert",
      "images",
      str(tmp_path / "src"),
      str(tmp_path / "out"),
      "--workers",
      "2",
      "--no-progress",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert manifest["splits"]["train"]["num_records"] == 6
  imported = {
    line.split("|")[-1].strip().split(".")[0]
    for line in proc.stderr.splitlines()
    if line.startswith("import time:") and "|" in line
  }
  assert {"pipeline", "array_record"} <= imported  # the report covers the conversion
  assert not imported & {"grain", "jax", "jaxlib"}, imported & {"grain", "jax", "jaxlib"}
