"""This host: how many workers and threads it runs (`parallelism.py`), setups refused
before anything starts (`guards.py`), iterators and workers ended at exit (`lifecycle.py`),
which extra installs a module (`extras.py`)."""
