"""The library's import boundaries: `pipeline/` never imports the repository's tools or
trainer, its modules import each other at the top and in no circle, and converting a folder
loads neither Grain nor JAX, nor Beam or its engine."""

import ast
import json
import os
import pathlib
import sys

import numpy as np
from PIL import Image

from tests.conftest import run_command

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


def pipeline_imports(path: pathlib.Path, modules: set[str]):
  """(module, function or None, line) of each `pipeline` module that `path` imports: a
  submodule where `from pipeline.x import y` names one, "pipeline.<dynamic>" for an
  `import_module` of a computed name."""
  tree = ast.parse(path.read_text(), str(path))
  within = {}
  for func in ast.walk(tree):
    if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for node in ast.walk(func):
        within.setdefault(id(node), func.name)  # ast.walk goes outside in: the outermost
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [
        f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
        for a in node.names
      ]
    elif isinstance(node, ast.Call) and node.args:
      func = node.func
      called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
      if called in ("import_module", "__import__"):
        arg = node.args[0]
        names = [arg.value if isinstance(arg, ast.Constant) else "pipeline.<dynamic>"]
    for name in names:
      if name.split(".")[0] == "pipeline":
        yield name, within.get(id(node)), node.lineno


def _module(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


# The package's lazy names (those that need Grain or JAX).
PACKAGE_LAZY = {("pipeline", "__getattr__")}


def test_pipeline_modules_import_each_other_at_the_top_and_in_no_circle():
  """A CLI's `__main__.py` may import lazily (a fast --help), and the package loads the names
  that need Grain or JAX on first use; nothing else imports inside a function, and no module
  reaches itself through its imports."""
  files = {_module(path): path for path in sorted((ROOT / "pipeline").rglob("*.py"))}
  graph, inside = {}, []
  for module, path in files.items():
    graph[module] = set()
    for name, func, line in pipeline_imports(path, set(files)):
      lazy_ok = path.name == "__main__.py" or (module, func) in PACKAGE_LAZY
      if func is not None and not lazy_ok:
        inside.append(f"{path.relative_to(ROOT)}:{line} {func}(): {name}")
      if name in files and name not in (module, "pipeline"):
        graph[module].add(name)
  assert not inside, inside
  assert "pipeline.order.shuffle" in graph["pipeline.order.blocks"]  # the graph sees the imports
  GRAPH.update(graph)
  circles, done = [], set()

  def visit(module: str, path: list[str]) -> None:
    for other in sorted(graph[module]):
      if other in path:
        circles.append(" -> ".join(path[path.index(other) :] + [other]))
      elif other not in done:
        visit(other, path + [other])
    done.add(module)

  for module in sorted(graph):
    if module not in done:
      visit(module, [module])
  assert not circles, circles


def test_converting_a_folder_loads_neither_grain_nor_jax_nor_beam(tmp_path):
  rng = np.random.default_rng(0)
  for label in ("cat", "dog"):
    (tmp_path / "src" / label).mkdir(parents=True)
    for i in range(3):
      pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
      Image.fromarray(pixels).save(tmp_path / "src" / label / f"{i}.jpg", quality=90)
  # Every process (the CLI's and its conversion workers') reports each import on stderr.
  env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "TQDM_DISABLE": "1"}
  convert = ["-m", "pipeline.convert", "images", tmp_path / "src", tmp_path / "out"]
  proc = run_command([sys.executable, *convert, "--workers", "2", "--no-progress"], env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert manifest["splits"]["train"]["num_records"] == 6
  imported = {
    line.split("|")[-1].strip().split(".")[0]
    for line in proc.stderr.splitlines()
    if line.startswith("import time:") and "|" in line
  }
  assert {"pipeline", "array_record"} <= imported  # the report covers the conversion
  engines = {"apache_beam", "dask", "distributed"}
  assert not imported & {"grain", "jax", "jaxlib", *engines}, imported & {"grain", "jax", *engines}


GRAPH: dict[str, set[str]] = {}  # module -> the pipeline modules it imports (filled above)

# The layers, top down (docs/ARCHITECTURE.md, "Folders and their rules"): a module imports its
# own folder (or, at the top, the face's other modules) and lower layers only. The settings
# (`spec`, then `options`) sit below the pp ops and the stages that read them.
LAYERS = (
  ("pipeline",),  # the face: dataset, planner, mixture, inputs, device, show
  ("pipeline.explain", "pipeline.mixing"),
  ("pipeline.stages",),
  ("pipeline.pp",),
  ("pipeline.spec",),
  ("pipeline.options", "pipeline.convert"),
  ("pipeline.image", "pipeline.order"),
  ("pipeline.catalog",),
  ("pipeline.storage",),
  ("pipeline.host",),
)


def unit(module: str) -> str:
  """The folder (or settings module) of the layer table that holds `module`."""
  prefixes = [p for row in LAYERS for p in row if module == p or module.startswith(p + ".")]
  return max(prefixes, key=len)


def layer(module: str) -> int:
  """`module`'s layer: 0 is the face, larger numbers lie lower."""
  return next(i for i, row in enumerate(LAYERS) if unit(module) in row)


# Folder rules: what each role folder may import from the rest of the library.
RULES = {
  "pipeline.order": lambda other: not other.startswith("pipeline.stages"),
  "pipeline.storage": lambda other: not other.startswith(("pipeline.stages", "pipeline.catalog")),
  "pipeline.host": lambda other: not other.startswith("pipeline.stages"),
  "pipeline.image": lambda other: (
    other.startswith("pipeline.image") or other == ("pipeline.catalog.records")
  ),
  "pipeline.explain": lambda other: (
    other.startswith(
      ("pipeline.explain", "pipeline.host", "pipeline.stages", "pipeline.order", "pipeline.image")
    )
    or other == "pipeline.spec"
  ),
}


def test_each_role_folder_imports_only_what_its_rule_allows():
  """`order/`, `storage/` and `host/` never import a stage, `storage/` nothing of the catalog (a
  shard's backend and pins are storage's; the catalog describes); `image/` imports only the record
  schema; `explain/` reads the host model, the stages' figures and the spec, never the face."""
  if not GRAPH:
    test_pipeline_modules_import_each_other_at_the_top_and_in_no_circle()
  assert {m.rpartition(".")[0] for m in GRAPH if m.count(".") == 2} >= set(RULES)
  broken = [
    f"{module} -> {other}"
    for module, imported in GRAPH.items()
    for folder, allowed in RULES.items()
    if module.startswith(folder + ".")
    for other in imported
    if not allowed(other)
  ]
  assert not broken, broken
  # the op registry and the op contract stand alone; the built-in ops do not need RandAugment
  assert GRAPH["pipeline.pp.registry"] == GRAPH["pipeline.pp.contract"] == set()
  for ops in ("ops", "image_ops", "batch_ops"):
    assert "pipeline.pp.randaugment" not in GRAPH[f"pipeline.pp.{ops}"]


def test_the_library_is_folders_of_at_most_ten_modules():
  """The face at the top (`pipeline/*.py`), each role in a folder, none over ten modules."""
  library = ROOT / "pipeline"
  folders = [library] + [p for p in library.iterdir() if (p / "__init__.py").exists()]
  sizes = {f.name: len(list(f.glob("*.py"))) - 1 for f in folders}  # without __init__.py
  assert len(folders) >= 8 and max(sizes.values()) <= 10, sizes


def test_old_module_paths_are_gone():
  """0.1.0 retired the paths from before the role folders (docs/ARCHITECTURE.md, "Moved")."""
  code = "import pipeline.order.sampling; import pipeline.sampling"
  proc = run_command([sys.executable, "-c", code])
  assert proc.stderr.strip().splitlines()[-1] == (
    "ModuleNotFoundError: No module named 'pipeline.sampling'"
  ), proc.stderr


def test_imports_go_down_the_layers_never_up_or_across():
  """No module imports a higher layer, nor another folder of its own layer: the layers hold no
  circle between folders."""
  if not GRAPH:
    test_pipeline_modules_import_each_other_at_the_top_and_in_no_circle()
  assert {unit(m) for m in GRAPH} == {p for row in LAYERS for p in row}  # every folder placed
  upward = [
    f"{module} (layer {layer(module)}) -> {other} (layer {layer(other)})"
    for module, imported in GRAPH.items()
    for other in imported
    if unit(other) != unit(module) and layer(other) <= layer(module)
  ]
  assert not upward, upward
