"""Iterators closed at interpreter exit, so users never see Grain's shutdown noise; worker
processes that start light (no JAX: `pipeline.host.light`), ignore Ctrl-C and end with the
process that started them, which a plain SIGTERM ends through that same exit.

Grain iterators still alive when Python exits print errors from `__del__` (their modules
are already torn down; grain #1031) and leak shared-memory warnings. Datasets returned by
this library register each iterator they create and close the live ones at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import weakref

import grain
from absl import flags
from grain._src.python.dataset.transformations import process_prefetch

from pipeline.host import light, shm

_LIVE: weakref.WeakSet = weakref.WeakSet()


class ClosedAtExit(grain.IterDataset):
  """Passes `parent` through; its iterators are closed at interpreter exit if still open."""

  def __init__(self, parent: grain.IterDataset):
    super().__init__(parent)

  def __iter__(self) -> grain.DatasetIterator:
    it = self._parent.__iter__()
    _LIVE.add(it)
    return it

  def __str__(self) -> str:
    return "ClosedAtExit"


def iterators(it) -> list:
  """The iterator and every Grain iterator it holds (its parents), outermost first."""
  seen, todo = [], [it]
  while todo:
    node = todo.pop()
    if any(node is s for s in seen):
      continue
    seen.append(node)
    for value in vars(node).values():
      values = value if isinstance(value, (list, tuple)) else [value]
      todo += [v for v in values if isinstance(v, grain.DatasetIterator)]
  return seen


def _noop() -> None:
  pass


@atexit.register
def _close_live_iterators() -> None:
  """Outermost first: an outer prefetch thread blocked in a closed inner iterator's
  `next()` would wait forever, and its `close()` with it (exit hung 1 time in 4)."""
  live = sorted(list(_LIVE), key=lambda it: len(iterators(it)), reverse=True)
  for it in live:
    try:
      it.close()
    except Exception:  # noqa: BLE001 - best effort at shutdown
      pass
  for it in live:
    for node in iterators(it):  # their __del__ would close again, after modules are gone
      node.close = _noop


def exit_on_sigterm() -> None:
  """With worker processes: a plain SIGTERM exits as `sys.exit(143)` does, so the iterators
  close and Grain's semaphores are unlinked (killed outright, the resource tracker warns of
  them leaked). Only where nothing (Python or C, such as JAX's preemption notifier) handles
  SIGTERM yet; a second SIGTERM kills at once."""
  if threading.current_thread() is not threading.main_thread():
    return
  if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL or not _default_in_c(signal.SIGTERM):
    return
  signal.signal(signal.SIGTERM, _exit)


def _default_in_c(signum: int) -> bool:
  """Whether the process's own handler of `signum` is SIG_DFL (`sigaction` sees handlers that
  C code installed, which `signal.getsignal` does not)."""
  action = ctypes.create_string_buffer(512)  # a struct sigaction, its handler first
  if ctypes.CDLL(None).sigaction(signum, None, action) != 0:
    return False
  return ctypes.c_void_p.from_buffer(action).value is None


def _exit(signum: int, frame) -> None:
  del frame
  signal.signal(signum, signal.SIG_DFL)
  raise SystemExit(128 + signum)


def die_with_parent() -> None:
  """In a worker process: exit (its shared memory unlinked) as soon as the process that
  started it is gone, even by SIGKILL; else a worker outlives it for good. Watches the
  pipe multiprocessing leaves to the parent (it closes when the parent dies, whichever
  thread started the worker: a parent-death signal would fire when that thread ends)."""
  parent = multiprocessing.parent_process()
  if parent is None:
    return
  # A worker ending another way (its queue broken by the parent's death) exits through
  # multiprocessing, which runs its finalizers but not atexit: unlink the ring there too.
  multiprocessing.util.Finalize(None, shm.close_rings, exitpriority=100)

  def watch():
    parent.join()
    shm.close_rings()
    os._exit(1)

  threading.Thread(target=watch, name="pipeline-parent-watch", daemon=True).start()


def worker_init(worker_index: int, worker_count: int) -> None:
  """Grain's `worker_init_fn`: Ctrl-C is the main process's to handle (the trainer saves a
  checkpoint); workers that also received it would die with tracebacks mid-save. Workers end
  with the main process."""
  del worker_index, worker_count
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  die_with_parent()


class _LightStart(grain.IterDataset):
  """A worker of `mp_prefetch` (Grain's `ProcessPrefetchIterDataset`), started light."""

  def __iter__(self) -> grain.DatasetIterator:
    it = self._parent.__iter__()
    it._process_ctx = light.context("spawn")  # its process starts on first use, after this
    return it

  def __str__(self) -> str:
    return "LightStart"


def start_light(ds: grain.IterDataset) -> None:
  """Makes the worker processes of `ds` (what `mp_prefetch` returned) start light
  (`pipeline.host.light`: JAX never loads in them). tests/host/test_light.py checks that
  this Grain's `mp_prefetch` is still one interleave of a `ProcessPrefetchIterDataset` each."""
  todo = [ds]
  while todo:
    node = todo.pop()
    shards = getattr(node, "_datasets", None)  # InterleaveIterDataset's, one per worker
    if isinstance(shards, list):
      for i, shard in enumerate(shards):
        if isinstance(shard, process_prefetch.ProcessPrefetchIterDataset):
          shards[i] = _LightStart(shard)
      return
    todo += node.parents


def ensure_absl_flags_parsed() -> None:
  """Before starting workers: Grain workers read absl flags; unparsed flags crash them
  (grain #1355)."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
