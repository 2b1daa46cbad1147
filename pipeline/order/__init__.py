"""Which records each batch holds: pure functions of (seed, epoch, position). `shuffle.py`'s
keyed permutation, `sampling.py`'s global shuffle dealt to the processes, `blocks.py`'s
order for buckets, `elastic.py`'s position that any process count continues, `mixture.py`'s
schedule of several sources. Imports no stage."""
