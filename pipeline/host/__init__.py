"""This host: how many workers and threads it runs (`parallelism.py`), its memory
(`memory.py`, `pool.py`) and shared memory (`shm.py`), setups refused before anything starts
(`guards.py`), iterators and workers ended at exit (`lifecycle.py`), which extra installs a
module (`extras.py`)."""
