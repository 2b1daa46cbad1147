"""The growth budgets (docs/ARCHITECTURE.md, "Growth, round by round"), so that no round
breaks one unseen: the tools beside the library (`bench/`) at most 45% of the library's lines,
the trainer's `train/train.py` at most 380 lines. (At most ten modules a library folder:
`tests/test_imports.py::test_the_library_is_folders_of_at_most_ten_modules`.)"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH_SHARE = 0.45  # bench/'s lines over pipeline/'s (convert/ included)
TRAIN_LINES = 380  # train/train.py


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
