"""The converters keep one shape (issue 49): no function in `pipeline/convert/` over 60 lines
or 7 parameters, one `write_shard(job, plan)` signature, and no class built on another
module's private class."""

import ast
import pathlib

CONVERT = pathlib.Path(__file__).resolve().parents[2] / "pipeline" / "convert"
MAX_LINES, MAX_PARAMETERS = 60, 7


def _functions(folder: pathlib.Path):
  """(file, function node) of every function and method in the folder's modules."""
  for path in sorted(folder.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield path, node


def _parameters(node: ast.FunctionDef) -> list[str]:
  a = node.args
  names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
  return names + [f"*{p.arg}" for p in (a.vararg, a.kwarg) if p is not None]


def oversized(folder: pathlib.Path) -> list[str]:
  """Each function over MAX_LINES lines (its def to its last line) or MAX_PARAMETERS
  parameters (self, *args and **kwargs count), named with its file and line."""
  found = []
  for path, node in _functions(folder):
    lines, count = node.end_lineno - node.lineno + 1, len(_parameters(node))
    where = f"{path.name}:{node.lineno} {node.name}()"
    if lines > MAX_LINES:
      found.append(f"{where}: {lines} lines (at most {MAX_LINES})")
    if count > MAX_PARAMETERS:
      found.append(f"{where}: {count} parameters (at most {MAX_PARAMETERS})")
  return found


def test_no_converter_function_is_over_60_lines_or_7_parameters():
  assert sum(1 for _ in _functions(CONVERT)) > 100  # the walk sees the converters
  assert oversized(CONVERT) == []


def test_the_check_names_a_long_function_and_a_long_signature(tmp_path):
  body = "\n".join(f"  x{i} = {i}" for i in range(60))
  (tmp_path / "grown.py").write_text(
    f"def long():\n{body}\n\n\ndef wide(a, b, c, d, e, f, *g, h, **i):\n  pass\n"
  )
  assert oversized(tmp_path) == [
    "grown.py:1 long(): 61 lines (at most 60)",
    "grown.py:64 wide(): 9 parameters (at most 7)",
  ]


def test_every_target_writes_a_shard_with_the_same_signature():
  signatures = {
    f"{path.name}:{node.lineno}": _parameters(node)
    for path, node in _functions(CONVERT)
    if node.name == "write_shard"
  }
  assert signatures and set(map(tuple, signatures.values())) == {("self", "job", "plan")}, (
    signatures
  )


def test_no_class_is_built_on_another_modules_private_class():
  private = [
    f"{path.name}:{node.lineno} {node.name}({ast.unparse(base)})"
    for path in sorted(CONVERT.glob("*.py"))
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.ClassDef)
    for base in node.bases
    if isinstance(base, ast.Attribute) and base.attr.startswith("_")
  ]
  assert private == []
