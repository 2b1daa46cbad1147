"""Entry point `python -m pipeline.bench COMMAND ...`: benchmarks live in the repo's `bench/`."""

from pipeline._tools import run

if __name__ == "__main__":
  run("bench.__main__")
