"""Runs a tool of the repository's `bench/` folder, or says in one line where to run it from."""

import importlib
import sys


def run(module: str) -> None:
  try:
    tool = importlib.import_module(module)
  except ModuleNotFoundError as e:
    if e.name not in ("bench", module):
      from pipeline import extras

      what = "python -m pipeline." + ("bench" if module == "bench.__main__" else module[6:])
      default = f"{what} needs {e.name!r}: pip install -e '.[bench]' in the checkout"
      sys.exit(f"error: {extras.hint(e.name, what) or default}")
    sys.exit(
      f"error: {module.split('.')[0]}/ is a folder of the repository, not of the installed "
      "package: run this from a checkout (git clone ...; cd grain-pipeline)"
    )
  if module.endswith("__main__"):
    tool.main()
  else:
    importlib.import_module("bench.measure").run_cli(tool.main, sys.argv[1:])
