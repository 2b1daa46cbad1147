"""Light worker processes: started like `spawn`'s (or `forkserver`'s), but JAX never loads.

Grain imports JAX whenever it is installed (its tree and profiler modules), and a spawned
child imports the main script again, which usually imports JAX too: ~140 MB (JAX_MB) of jax
and jaxlib in every worker, doing nothing (on an accelerator host, a backend that can take
device memory: google/grain#1199). A light process blocks `jax` and `jaxlib` before it
unpickles what it runs, and does not import the main script again: its work travels by
pickle (Grain pickles its datasets with cloudpickle, functions of the main script included;
the converters' are the library's). Importing JAX there fails in one line naming
`performance.worker_jax`, which starts workers as Grain does. Grain's sharding by JAX process
then means shard 0 of 1: the pipeline passes its shards explicitly (`process_shard`).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import multiprocessing.context
import multiprocessing.popen_forkserver
import multiprocessing.popen_spawn_posix
import multiprocessing.spawn
import sys
import threading

BLOCKED = ("jax", "jaxlib")
# What importing JAX adds to a worker's RSS: 244-248 MB against 108-110 (light), 2 workers on
# 8-image batches of 32 px under a script that imports JAX (2026-11-28, docs/HISTORY.md).
JAX_MB = 140
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")  # spawn's re-import of __main__


class JaxBlockedError(ModuleNotFoundError):
  """Code in a light worker process imported JAX."""


class _Blocker(importlib.abc.MetaPathFinder):
  """Refuses the modules of BLOCKED (first on sys.meta_path): Grain then runs without JAX,
  as it does where JAX is not installed."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname.partition(".")[0] in BLOCKED:
      raise JaxBlockedError(
        f"{fullname} is not imported in pipeline worker processes (each stays ~{JAX_MB} MB "
        "lighter): an op that needs JAX runs in them with performance.worker_jax=True",
        name=fullname,
      )
    return None


def _not_grains_profiler_warning(record: logging.LogRecord) -> bool:
  """Drops Grain's warning that its JAX profiler did not load because JAX is blocked."""
  return not (record.args and isinstance(record.args[0], JaxBlockedError))


def block_jax() -> None:
  """From now on, importing JAX in this process raises `JaxBlockedError`."""
  if not any(isinstance(finder, _Blocker) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Blocker())
    logging.getLogger("absl").addFilter(_not_grains_profiler_warning)


class _Block:
  """Unpickled first in a light child, after its sys.path is set: blocks JAX there."""

  def __reduce__(self):
    return block_jax, ()


def _rebuild(blocked, cls, state):
  del blocked  # unpickled (JAX blocked) before `state`, which imports what the process runs
  process = cls.__new__(cls)
  process.__dict__.update(state)
  return process


_launching = threading.local()


def _preparation_data(name, stdlib=multiprocessing.spawn.get_preparation_data):
  """spawn's data for a new child; without the main script when this thread starts a light one."""
  data = stdlib(name)
  if getattr(_launching, "light", False):
    for key in _MAIN_KEYS:
      data.pop(key, None)
  return data


@contextlib.contextmanager
def _launching_light():
  """While this thread starts a light process: spawn's data for it leaves out the main script
  (`_preparation_data` stands in for spawn's own function, the same for everyone else)."""
  multiprocessing.spawn.get_preparation_data = _preparation_data
  _launching.light = True
  try:
    yield
  finally:
    _launching.light = False


class _SpawnPopen(multiprocessing.popen_spawn_posix.Popen):
  def _launch(self, process_obj):
    with _launching_light():
      super()._launch(process_obj)


class _ForkServerPopen(multiprocessing.popen_forkserver.Popen):
  def _launch(self, process_obj):
    with _launching_light():
      super()._launch(process_obj)


class _Light:
  """A process whose pickle blocks JAX in the child before what it runs is unpickled."""

  def __reduce__(self):
    return _rebuild, (_Block(), type(self), self.__dict__)


class SpawnProcess(_Light, multiprocessing.context.SpawnProcess):
  @staticmethod
  def _Popen(process_obj):
    return _SpawnPopen(process_obj)


class ForkServerProcess(_Light, multiprocessing.context.ForkServerProcess):
  @staticmethod
  def _Popen(process_obj):
    return _ForkServerPopen(process_obj)


class SpawnContext(multiprocessing.context.SpawnContext):
  Process = SpawnProcess


class ForkServerContext(multiprocessing.context.ForkServerContext):
  Process = ForkServerProcess


def context(method: str) -> multiprocessing.context.BaseContext:
  """A multiprocessing context ("spawn" or "forkserver") whose processes are light."""
  return {"spawn": SpawnContext, "forkserver": ForkServerContext}[method]()
