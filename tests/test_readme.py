"""The README's usage examples run as written, from an empty folder; it stays short and its
links, and those of docs/, lead somewhere."""

import os
import pathlib
import re
import sys

import pytest

import pipeline
from tests.conftest import run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("data", ["digits_dir", "classes20_dir"])
def test_readme_flax_example_runs_as_written(data, request, tmp_path):
  """On the built-in digits and on a 20-class folder: nothing assumes 10 classes."""
  data_dir = request.getfixturevalue(data)
  classes = pipeline.load_manifest(data_dir).num_classes
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## Using the pipeline in your own Flax experiment")[1].split("\n## ")[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 3
  home = tmp_path / "home"
  (home / "pipeline-data").mkdir(parents=True)
  (home / "pipeline-data" / "digits").symlink_to(data_dir)
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
  # The tree under test, not an installed copy; from an empty folder, as a saved script.
  env = dict(os.environ, HOME=str(home), XLA_FLAGS="--xla_force_host_platform_device_count=4")
  env["PYTHONPATH"] = str(ROOT)
  empty = tmp_path / "cwd"
  empty.mkdir()
  script = empty / "experiment.py"
  script.write_text(check)
  out = run_command([sys.executable, script], cwd=empty, env=env)
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

  from bench import doctor
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
        assert parsed.config and doctor._module_name(parsed.config)[0], span
    else:
      continue
    checked.add(args[0] if tool == "pipeline.convert" else tool)
  assert {"images", "tfrecord", "tfds", "verify", "builtin", "bench.doctor"} <= checked


@pytest.mark.parametrize("data", ["digits_dir", "classes20_dir"])
def test_readme_big_vision_pp_example_runs_as_written(data, request, tmp_path):
  data_dir = request.getfixturevalue(data)
  classes = pipeline.load_manifest(data_dir).num_classes
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## Coming from big_vision / the Flax ImageNet example")[1]
  blocks = re.findall(r"```python\n(.*?)```", section.split("\n## ")[0], re.S)
  assert len(blocks) == 1
  home = tmp_path / "home"
  (home / "pipeline-data").mkdir(parents=True)
  (home / "pipeline-data" / "digits").symlink_to(data_dir)
  check = blocks[0] + (
    '\nif __name__ == "__main__":'
    "\n  assert batch['image'].shape == (64, 64, 64, 3) and str(batch['image'].dtype) == 'float32'"
    f"\n  assert batch['labels'].shape == (64, {classes}) and set(batch) == {{'image', 'labels'}}"
    "\n  assert -1 <= float(batch['image'].min()) and float(batch['image'].max()) <= 1"
    "\n  assert seen == val.num_examples"
    "\n  print('OK')\n"
  )
  env = dict(os.environ, HOME=str(home), PYTHONPATH=str(ROOT))
  empty = tmp_path / "cwd"
  empty.mkdir()
  script = empty / "big_vision.py"
  script.write_text(check)
  out = run_command([sys.executable, script], cwd=empty, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "OK" in out.stdout


def test_every_test_the_guarantees_table_names_exists():
  """A row's `file.py::name` (or `::name`, of the row's last file; `name_*`: tests named so)
  is a test in tests/."""
  rows = [line for line in (ROOT / "README.md").read_text().splitlines() if "| `test_" in line]
  rows += [line for line in (ROOT / "README.md").read_text().splitlines() if "| `bench/" in line]
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
