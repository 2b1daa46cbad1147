"""The README's usage examples run as written, from an empty folder; it stays short and its
links, and those of docs/, lead somewhere."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import pipeline
from tests.conftest import run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent


def python_blocks(title: str) -> list[str]:
  """The code of the ```python blocks in the README's section TITLE."""
  section = (ROOT / "README.md").read_text().split(f"## {title}")[1].split("\n## ")[0]
  return re.findall(r"```python\n(.*?)```", section, re.S)


def run_saved(code: str, name: str, data_dir, tmp_path, **env) -> subprocess.CompletedProcess:
  """CODE saved as the script NAME in an empty folder and run there, with the tree under test
  on the path (not an installed copy) and ~/pipeline-data/digits the dataset `data_dir`."""
  home = tmp_path / "home"
  (home / "pipeline-data").mkdir(parents=True)
  (home / "pipeline-data" / "digits").symlink_to(data_dir)
  empty = tmp_path / "cwd"
  empty.mkdir()
  script = empty / name
  script.write_text(code)
  env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), **env}
  return run_command([sys.executable, script], cwd=empty, env=env)


@pytest.fixture(params=["digits_dir", "classes20_dir"])
def data_dir(request) -> pathlib.Path:
  """The built-in digits, and a folder of 20 classes: nothing may assume 10 classes."""
  return request.getfixturevalue(request.param)


@pytest.mark.slow
def test_readme_flax_example_runs_as_written(data_dir, tmp_path):
  classes = pipeline.load_manifest(data_dir).num_classes
  blocks = python_blocks("Using the pipeline in your own Flax experiment")
  assert len(blocks) == 3
  check = "\n".join(blocks) + (
    '\nif __name__ == "__main__":'
    "\n  assert batch['image'].sharding.spec[0] == 'data'"
    "\n  assert 0 <= hits <= val.num_examples and float(loss) > 0"
    "\n  assert next(train)['image'].shape[0] == 64"
    f"\n  assert train.num_classes == {classes}"
    "\n  image, label = host_to_device['image'], host_to_device['label']"
    "\n  assert image.shape == (64, 32, 32, 3) and str(image.dtype) == 'float32'"
    "\n  assert -1 <= float(image.min()) and float(image.max()) <= 1"
    "\n  assert label.shape == (64,) and 0 <= int(label.min()) and int(label.max()) <= 1"
    "\n  print('OK')\n"
  )
  devices = "--xla_force_host_platform_device_count=4"
  out = run_saved(check, "experiment.py", data_dir, tmp_path, XLA_FLAGS=devices)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout


def pages() -> list[pathlib.Path]:
  """The README and the guides it links to."""
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_fits_its_line_budget():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"


def anchor(heading: str) -> str:
  """GitHub's anchor of a Markdown heading."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_of_the_readme_and_docs_lead_to_files_and_headings():
  broken = []
  for page in [*pages(), ROOT / "bench" / "REPORT.md"]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if target.startswith(("http://", "https://")):
        continue
      path, _, fragment = target.partition("#")
      linked = (page.parent / path).resolve() if path else page
      if not linked.exists():
        broken.append(f"{page.name}: {target}")
      elif fragment and linked.suffix == ".md":
        headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
        if fragment not in {anchor(h) for h in headings}:
          broken.append(f"{page.name}: {target} (no such heading)")
  assert not broken, broken


def test_readme_convert_and_doctor_commands_parse_as_written():
  """Every `python -m pipeline.convert ...` and `python -m bench.doctor ...` the README and
  docs/ show is accepted by its CLI (placeholders filled in): no required option left out,
  none misspelled."""
  import shlex

  from bench import doctor, recipe
  from pipeline.convert import __main__ as convert

  text = "\n".join(page.read_text() for page in pages())
  found = re.findall(r"`(python -m (?:pipeline|bench)\.[^`]+)`", text, re.S)
  spans = [" ".join(m.split()) for m in found]
  fill = {"N": "10", "[--cores": "--cores", "N]": "10"}
  checked = set()
  for span in spans:
    words = [fill.get(w, w) for w in shlex.split(span)[2:]]
    tool, args = words[0], words[1:]
    if not args:  # the tool named, not a command line
      continue
    if tool == "pipeline.convert":
      convert._parser().parse_args(args)
    elif tool == "bench.doctor":
      parsed = doctor.parser().parse_args(args)
      if parsed.apply:  # --apply needs a --config inside a package (the doctor's rule)
        assert parsed.config and recipe.module_name(parsed.config)[0], span
    else:
      continue
    checked.add(args[0] if tool == "pipeline.convert" else tool)
  assert {"images", "tfrecord", "tfds", "verify", "builtin", "bench.doctor"} <= checked


@pytest.mark.slow
def test_readme_big_vision_pp_example_runs_as_written(data_dir, tmp_path):
  classes = pipeline.load_manifest(data_dir).num_classes
  blocks = python_blocks("Coming from big_vision / the Flax ImageNet example")
  assert len(blocks) == 1
  check = blocks[0] + (
    '\nif __name__ == "__main__":'
    "\n  assert batch['image'].shape == (64, 64, 64, 3) and str(batch['image'].dtype) == 'float32'"
    f"\n  assert batch['labels'].shape == (64, {classes}) and set(batch) == {{'image', 'labels'}}"
    "\n  assert -1 <= float(batch['image'].min()) and float(batch['image'].max()) <= 1"
    "\n  assert seen == val.num_examples"
    "\n  print('OK')\n"
  )
  out = run_saved(check, "big_vision.py", data_dir, tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout


def test_every_test_the_guarantees_table_names_exists():
  """A row's `file.py::name` (or `::name`, of the row's last file; `name_*`: tests named so)
  is a test in tests/."""
  lines = (ROOT / "README.md").read_text().splitlines()
  rows = [line for line in lines if re.search(r"\| `(\w+/)?test_\w+\.py", line)]
  assert len(rows) >= 20
  missing = []
  for row in rows:
    proof = row.rstrip(" |").rsplit(" | ", 1)[1]
    file = None
    for ref in re.findall(r"`([^`]+)`", proof):
      path, _, name = ref.partition("::")
      if path.endswith(".py"):
        file = ROOT / path if path.startswith("tests/") else ROOT / "tests" / path
        if not file.is_file():
          missing.append(ref)
          continue
      name = name.split("[")[0]  # a parametrized case, or a prefix ending in `*`
      wanted = f"def {name[:-1]}" if name.endswith("*") else f"def {name}("
      if name and (file is None or wanted not in file.read_text()):
        missing.append(f"{file and file.name}::{name}")
  assert not missing, missing
