"""A process whose storage stopped answering leaves at exit without waiting for its reads.

A read blocked in its syscall on a stalled mount (or a request to a stalled bucket) cannot be
interrupted: an orderly exit would join the threads waiting in it (thread pools, worker
processes) until storage answers, and C++ destructors abort (rc 134) under those still
running. Once a read got no answer in time, `mark` arranges that the interpreter's exit, if
reads are still in progress then (`reading`), ends the process at once (`leave`): output
flushed, its worker processes killed, its shared memory unlinked; exit code 1 after an
uncaught exception, else 0 (a `SystemExit`'s own code is gone by then: a caller that exits
with one after a stall calls `leave` itself). A worker process
that reported the stall to the main process so leaves too, as the main process waits for it.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - registers its exit hook (joins) before ours
import contextlib
import multiprocessing
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Callable, Iterator

_marked = threading.Event()
_cleanups: list[Callable[[], None]] = []  # `on_leave`
_lock = threading.Lock()
_reading = 0  # reads in progress in this process (`reading`)
WORKERS_S = 10.0  # the longest to wait for killed worker processes (one in a read goes at once)


def mark() -> None:
  """Says a read of this process got no answer in time; the first call arranges the exit."""
  if not _marked.is_set():
    _marked.set()
    try:  # runs before the joins of threading's shutdown (in reverse order of registration)
      threading._register_atexit(_at_exit)
    except RuntimeError:  # the interpreter is already exiting
      pass


@contextlib.contextmanager
def reading() -> Iterator[None]:
  """Counts a read of storage in progress for the `with` block: the exit leaves without
  waiting only while some, blocked, remain."""
  global _reading
  with _lock:
    _reading += 1
  try:
    yield
  finally:
    with _lock:
      _reading -= 1


def happened() -> bool:
  """Whether a read of this process got no answer in time."""
  return _marked.is_set()


def _at_exit() -> None:
  if _reading:  # else nothing would hold the exit: it goes on as usual, exit code and all
    leave(1 if getattr(sys, "last_value", None) is not None else 0)


def on_leave(cleanup: Callable[[], None]) -> None:
  """`cleanup()` runs as `leave` ends the process, after its workers are gone (the modules that
  keep shared memory register theirs: `pipeline.stages.handoff`, `pipeline.storage.blockstore`)."""
  _cleanups.append(cleanup)


def leave(code: int) -> None:
  """Ends the process with `code` now, without joining its threads: output flushed, its
  worker processes killed, the shared memory of its batches and blocks unlinked."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
      pass
  children = multiprocessing.active_children()
  for child in children:
    child.kill()  # a read of theirs in a stalled FUSE request is interrupted as they die
  for child in children:
    child.join(WORKERS_S / len(children))
  # what multiprocessing does at exit, its children gone: unlinks its semaphores (else the
  # resource tracker warns of them); threads reading its queues, closed now, end silently
  threading.excepthook = lambda args: None
  multiprocessing.util._exit_function()
  for cleanup in _cleanups:
    cleanup()
  os._exit(code)
