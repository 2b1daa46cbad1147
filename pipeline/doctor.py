"""Entry point `python -m pipeline.doctor DATA_DIR ...`: the doctor lives in the repo's `bench/`."""

from pipeline._tools import run

if __name__ == "__main__":
  run("bench.doctor")
