"""Benchmarks: `python -m pipeline.bench COMMAND --help`."""
