"""GIL-held CPU, measured directly: an LD_PRELOAD shim counting each thread's CPU while it
holds the GIL (bench/gilshim.c), and py-spy's `--gil` sampling as the second method. `python
-m bench scaling` measures the loader with both (its steps 4 and 6).

The shim interposes `PyEval_SaveThread` / `PyEval_RestoreThread`, which extension modules
(numpy, cv2, pipeline.image._jpeg, array_record, ctypes) call through libpython's dynamic
symbols: per thread, the CPU from each acquisition to the next release (CLOCK_THREAD_CPUTIME_ID)
adds to a global counter. A thread's first interval counts from its start (it took the GIL
inside the interpreter), and a thread that ends holding it adds its last interval at exit
(pthread_create is interposed too, to register each thread libpython starts: a pure-Python
thread is counted when its pthread ends, which is just after `join()` returns). Threads other
libraries start (BLAS, OpenCV pools) never count.

Limitations: calls inside libpython itself are not interposed (time.sleep, lock waits, the
core's file I/O, the eval loop's switches between threads): their CPU counts as held, which
errs high by little, since a blocked wait burns no CPU. A thread's CPU since its last
acquisition counts at its next release through an extension (or its exit), so a reading
misses what threads hold at that instant (small over seconds of a loader calling an
extension per image). The shim needs the extensions to call the PyEval functions
through the dynamic linker (Python linking libpython3.x.so, as here, or an executable
exporting them).

In the measured process: `held_s()`, `acquisitions()`, or `Counter()` for a window. From a
parent: `ensure_built()` then `preload_env(env)` for the child's environment.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from bench import measure

SOURCE = pathlib.Path(__file__).with_name("gilshim.c")
SPY_HZ = 100
BIN = pathlib.Path(sys.executable).parent


class ShimUnavailable(RuntimeError):
  """The GIL shim cannot be built or is not loaded; the message says why in one line."""


def ensure_built() -> pathlib.Path:
  """The shim's shared library, compiled once per source; raises ShimUnavailable without a
  C compiler or when the build fails."""
  return measure.compiled(SOURCE, "gilshim-HASH.so", ["-shared", "-fPIC", "-ldl"], ShimUnavailable)


def preload_env(env: dict | None = None) -> dict:
  """A copy of `env` (default: os.environ) preloading the shim (built if needed) and with
  this repository on PYTHONPATH."""
  env = dict(os.environ if env is None else env)
  env["LD_PRELOAD"] = " ".join(filter(None, [str(ensure_built()), env.get("LD_PRELOAD")]))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(measure.ROOT), env.get("PYTHONPATH")]))
  return env


_lib = None


def _shim():
  """The preloaded shim's functions (ctypes.CDLL: each call releases and re-takes the GIL
  through the shim, so the calling thread's held time is counted up to the call)."""
  global _lib
  if _lib is None:
    lib = ctypes.CDLL(None)
    if not hasattr(lib, "gilshim_loaded"):
      raise ShimUnavailable(
        "the GIL shim is not loaded in this process: run it with bench.gil.preload_env()"
      )
    lib.gilshim_held_ns.restype = ctypes.c_ulonglong
    lib.gilshim_acquisitions.restype = ctypes.c_ulonglong
    _lib = lib
  return _lib


def loaded() -> bool:
  """Whether this process runs with the shim preloaded."""
  return hasattr(ctypes.CDLL(None), "gilshim_loaded")


def held_s() -> float:
  """CPU seconds all threads of this process spent holding the GIL so far."""
  return _shim().gilshim_held_ns() / 1e9


def acquisitions() -> int:
  """GIL acquisitions through extension modules so far."""
  return int(_shim().gilshim_acquisitions())


@dataclasses.dataclass
class Reading:
  held_s: float  # CPU seconds holding the GIL, all threads
  cpu_s: float  # the process's CPU seconds, all threads
  wall_s: float
  acquisitions: int


class Counter:
  """A window: `Counter()` starts it, `.read()` gives the Reading since (any number of times)."""

  def __init__(self):
    self.start = self._now()

  @staticmethod
  def _now() -> Reading:
    lib = _shim()
    return Reading(
      lib.gilshim_held_ns() / 1e9,
      time.process_time(),
      time.perf_counter(),
      int(lib.gilshim_acquisitions()),
    )

  def read(self) -> Reading:
    now = self._now()
    return Reading(*(getattr(now, f) - getattr(self.start, f) for f in Reading.__annotations__))


# ---------------------------------------------------------------- the second method


class PySpy:
  """`py-spy record --gil` on this process for `seconds` (raw output: one stack per line,
  ending in its sample count), the second method beside the shim."""

  def __init__(self, py_spy: str, seconds: float):
    self.seconds = max(1, round(seconds))
    self.out = tempfile.NamedTemporaryFile(suffix=".txt", delete=False).name
    cmd = [py_spy, "record", "--gil", "--nonblocking", "-r", str(SPY_HZ)]
    cmd += ["-d", str(self.seconds), "-f", "raw", "-o", self.out, "-p", str(os.getpid())]
    self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

  def running(self) -> bool:
    return self.proc.poll() is None

  def stacks(self) -> list[tuple[str, int]]:
    """The sampled stacks holding the GIL and their counts; RuntimeError if py-spy failed."""
    _, err = self.proc.communicate()
    path = pathlib.Path(self.out)
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    if self.proc.returncode or not lines:
      raise RuntimeError(f"py-spy failed: {err.decode().strip()[-200:]}")
    return [(ln.rsplit(" ", 1)[0], int(ln.rsplit(" ", 1)[1])) for ln in lines if ln.strip()]

  def share(self, stacks: list[tuple[str, int]]) -> float:
    """py-spy's own wall: its samples over its ticks is the share of time a thread held it."""
    return min(sum(n for _, n in stacks) / (SPY_HZ * self.seconds), 1.0)
