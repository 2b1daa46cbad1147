"""Tools beside the library: benchmarks, the doctor, timelines (`python -m pipeline.bench --help`).

They run from a checkout of the repository (extra `bench`); `import pipeline` never loads them.
"""
