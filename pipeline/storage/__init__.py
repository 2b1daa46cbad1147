"""Getting record bytes: `source.py` opens a split's shards, `ranges.py` reads a block in
one request, `cache.py` keeps what was read, `budget.py` rations requests, `remote.py`
checks a bucket. Imports no stage."""
