"""Getting record bytes: `source.py` opens a split's shards, `ranges.py` reads a block in
one request, `cache.py` keeps what was read, `budget.py` rations requests, `backend.py`
says how a kind of storage is reached (local, a FUSE mount, `gcs.py` for gs://) and pins the
shards, `remote.py` gives its reads deadlines and retries. Imports no stage and no catalog."""
