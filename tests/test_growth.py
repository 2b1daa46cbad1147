"""The growth budgets (docs/ARCHITECTURE.md, "Growth, round by round"), so that no round
breaks one unseen: the tools beside the library (`bench/`) at most 45% of the library's lines,
the trainer's `train/train.py` at most 380 lines, the doctor (`bench/doctor.py`) 600, the
workers' hand-off stage (`pipeline/stages/handoff.py`) 200, no function in `pipeline/convert/`
over 60 lines or 7 parameters. (At most ten modules a library folder:
`tests/test_imports.py::test_the_library_is_folders_of_at_most_ten_modules`.)"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH_SHARE = 0.45  # bench/'s lines over pipeline/'s (convert/ included)
TRAIN_LINES = 380  # train/train.py
FILE_LINES = {"bench/doctor.py": 600, "pipeline/stages/handoff.py": 200}
CONVERT_LINES, CONVERT_PARAMETERS = 60, 7  # a function in pipeline/convert/, self included


def lines(folder: pathlib.Path) -> int:
  """Lines of the Python files under `folder`, as `cat FILES | wc -l` counts them."""
  return sum(path.read_bytes().count(b"\n") for path in sorted(folder.rglob("*.py")))


def test_the_tools_beside_the_library_stay_within_45_percent_of_its_lines():
  bench, library = lines(ROOT / "bench"), lines(ROOT / "pipeline")
  assert library > 10_000 and bench > 1_000  # the count sees both folders
  assert bench <= BENCH_SHARE * library, (
    f"bench/ is {bench:,} lines, {bench / library:.1%} of pipeline/'s {library:,} (budget "
    f"{BENCH_SHARE:.0%}): move what the library should own into it, or retire a finished study"
  )


def test_the_trainers_loop_stays_within_380_lines():
  train = (ROOT / "train" / "train.py").read_bytes().count(b"\n")
  assert train <= TRAIN_LINES, (
    f"train/train.py is {train} lines (budget {TRAIN_LINES}): move what is not the loop "
    "into train/'s other modules or into the library"
  )


def test_the_doctor_and_the_hand_off_stage_stay_within_their_lines():
  over = {}
  for name, budget in FILE_LINES.items():
    count = (ROOT / name).read_bytes().count(b"\n")
    assert count > budget // 4, (name, count)  # the file the budget names is there, whole
    if count > budget:
      over[name] = f"{count} lines (budget {budget})"
  assert not over, f"{over}: move what is not the file's one role into its own module"


def oversized(source: str) -> list[str]:
  """The functions of `source` over CONVERT_LINES lines (def to last line) or
  CONVERT_PARAMETERS parameters, as 'name: N lines, M parameters'."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      a = node.args
      params = len(a.posonlyargs + a.args + a.kwonlyargs) + (a.vararg is not None)
      params += a.kwarg is not None
      length = node.end_lineno - node.lineno + 1
      if length > CONVERT_LINES or params > CONVERT_PARAMETERS:
        found.append(f"{node.name}: {length} lines, {params} parameters")
  return found


def test_no_converter_function_is_over_60_lines_or_7_parameters():
  files = sorted((ROOT / "pipeline" / "convert").glob("*.py"))
  functions = sum(
    isinstance(n, ast.FunctionDef) for f in files for n in ast.walk(ast.parse(f.read_text()))
  )
  assert len(files) >= 5 and functions > 100  # the scan sees the converters
  long = "def f(a):\n" + "  a += 1\n" * CONVERT_LINES
  assert oversized(long) == [f"f: {CONVERT_LINES + 1} lines, 1 parameters"]
  assert oversized("def g(a, b, c, d, *e, f, g, **h): pass") == ["g: 1 lines, 8 parameters"]
  found = {f.name: oversized(f.read_text()) for f in files}
  assert not any(found.values()), (
    f"{ {k: v for k, v in found.items() if v} }: split the function, or pass the Job "
    "(`pipeline.convert.shards.Job`) instead of its fields"
  )
