"""What each Grain worker process does first (`mp_prefetch`'s worker_init_fn).

- Ctrl-C is the main process's to handle (the trainer saves a checkpoint); workers that also
  received it would die with tracebacks mid-save.
- Freed memory is kept for reuse (glibc `mallopt`): a worker allocates ~100 KB per record it
  reads and frees it a batch later, and glibc's default returns such memory to the kernel
  and faults it in again, page by page, while array_record copies the next records into
  Python bytes holding the GIL. Measured with the GIL shim (bench/gil.py) reading batches of
  128 photos: 21-23 us of GIL-held CPU per record by default, 9 us with memory kept; the
  worker's RSS stays at its high-water mark instead. Worker processes are the library's own,
  so this is set there only, never in your process.
"""

from __future__ import annotations

import ctypes
import platform
import signal

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
KEEP_FREED = 1 << 30  # bytes of free heap top kept before trimming (i.e. always kept)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the reused heap


def init(worker_index: int, worker_count: int) -> None:
  """A worker's start: SIGINT ignored, freed memory kept."""
  del worker_index, worker_count
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  keep_freed_memory()


def keep_freed_memory() -> bool:
  """glibc: keep freed memory in the heap for reuse; False where libc is not glibc."""
  if platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(None)
  return bool(
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED) and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
  )
