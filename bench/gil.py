"""GIL-held CPU, measured directly: an LD_PRELOAD shim counting each thread's CPU while it
holds the GIL (bench/gilshim.c), and the loader measured with it.

    python -m bench.gil loader data/photos --threads 1,2 --seconds 5 --repeats 3
    python -m bench.gil loader data/photos --threads 8 --emulate-us 2000,400

The shim interposes `PyEval_SaveThread` / `PyEval_RestoreThread`, which extension modules
(numpy, cv2, pipeline._jpeg, array_record, ctypes) call through libpython's dynamic
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
`measure_loader(...)` runs the loader in a child with the shim, and `measure_loader(...,
py_spy=True)` a separate child sampled by `py-spy record --gil` as the cross-check.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import statistics
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


def cache_dir() -> pathlib.Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "pipeline-gil"


def ensure_built() -> pathlib.Path:
  """The shim's shared library, compiled once per source (keyed by its hash); raises
  ShimUnavailable without a C compiler or when the build fails."""
  code = SOURCE.read_bytes()
  lib = cache_dir() / f"gilshim-{hashlib.sha256(code).hexdigest()[:16]}.so"
  if lib.exists():
    return lib
  cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
  if not cc:
    raise ShimUnavailable("no C compiler (cc) to build the GIL shim (apt-get install gcc)")
  lib.parent.mkdir(parents=True, exist_ok=True)
  tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
  cmd = [cc, "-O2", "-Wall", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl"]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    first = next((x for x in proc.stderr.splitlines() if "error" in x), proc.stderr.strip())
    raise ShimUnavailable(f"building {SOURCE.name} failed: {first}")
  os.replace(tmp, lib)
  return lib


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


# ---------------------------------------------------------------- the loader, measured


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


def _py_spy() -> str | None:
  return shutil.which("py-spy", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def _child_run(spec: dict) -> dict:
  """In the measuring child: the loader's steady state (after `skip` batches) for `seconds`,
  with the shim's counters, or sampled by py-spy --gil."""
  from bench import emulate

  ds = emulate.make_dataset(
    spec["data_dir"],
    "train",
    batch_size=spec["batch_size"],
    image_size=spec["image_size"],
    shard_index=0,
    shard_count=1,
    performance=dict(num_threads=spec["threads"], num_workers=0, record_cache_mb=0.0),
    emulate_us=spec.get("emulate_us"),
  )
  it = iter(ds)
  for _ in range(spec["skip"]):
    next(it)
  spy = PySpy(spec["py_spy"], spec["seconds"]) if spec.get("py_spy") else None
  counter = Counter() if loaded() else None
  cpu0, wall0 = time.process_time(), time.perf_counter()
  images = 0
  while spy.running() if spy else time.perf_counter() - wall0 < spec["seconds"]:
    images += len(next(it)["image"])
  wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
  result = {"images": images, "wall_s": wall, "cpu_s": cpu, "img_s": images / wall}
  if counter is not None:
    r = counter.read()
    result.update(held_s=r.held_s, acquisitions=r.acquisitions)
  if spy is not None:
    stacks = spy.stacks()
    result.update(
      spy_samples=sum(n for _, n in stacks),
      spy_ticks=SPY_HZ * spy.seconds,
      spy_stacks=stacks,
      spy_share=spy.share(stacks),
    )
  it.close()
  return result


def _child(spec: dict, shim: bool) -> dict:
  return measure.child("bench.gil", spec, preload_env() if shim else None)


def measure_loader(
  data_dir: str,
  threads: int,
  seconds: float = 5.0,
  *,
  py_spy: bool = False,
  emulate_us: tuple[float, float] | None = None,
  batch_size: int = 128,
  image_size: int = 224,
  skip: int = 2,
) -> dict:
  """One run of `make_dataset` (no workers, no record cache) in a fresh child, steady state
  after `skip` batches for `seconds`: img/s and CPU us per image, and either the shim's
  GIL-held us per image (`gil_us`, the default) or, with `py_spy`, py-spy --gil's share of
  samples x wall per image (`gil_us_pyspy`, the child runs without the shim) plus its
  stacks (`spy_stacks`: [(frames, samples)], for `top_holders`)."""
  spec = dict(
    data_dir=str(data_dir),
    threads=threads,
    seconds=seconds,
    batch_size=batch_size,
    image_size=image_size,
    skip=skip,
    emulate_us=list(emulate_us) if emulate_us else None,
  )
  if py_spy:
    spec["py_spy"] = _py_spy()
    if not spec["py_spy"]:
      raise ShimUnavailable("py-spy is not installed (pip install py-spy)")
  r = _child(spec, shim=not py_spy)
  n = r["images"]
  out = {
    "threads": threads,
    "emulate_us": emulate_us,
    "img_s": round(r["img_s"], 1),
    "cpu_us": round(r["cpu_s"] / n * 1e6, 1),
  }
  if "held_s" in r:
    out["gil_us"] = round(r["held_s"] / n * 1e6, 1)
    out["acquisitions_per_img"] = round(r["acquisitions"] / n, 2)
  if "spy_share" in r:
    out["gil_us_pyspy"] = round(r["spy_share"] * r["wall_s"] / n * 1e6, 1)
    out["spy_stacks"] = r["spy_stacks"]
  return out


def top_holders(stacks: list, n: int = 10, inclusive: bool = False) -> list[tuple[str, float]]:
  """The `n` Python functions most often on top of a GIL-holding stack in py-spy's raw
  samples (`inclusive`: anywhere on it), with their share of the GIL-holding samples."""
  counts: collections.Counter = collections.Counter()
  total = 0
  for frames, samples in stacks:
    names = frames.split(";")[1:]  # the first is the thread
    total += samples
    if not names:
      continue
    for name in set(names) if inclusive else names[-1:]:
      counts[name] += samples
  return [(name, round(c / max(total, 1), 4)) for name, c in counts.most_common(n)]


def _summary(values: list[float]) -> str:
  return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(prog="python -m bench.gil", description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("loader", help="GIL-held CPU per image of make_dataset, shim and py-spy")
  p.add_argument("data_dir")
  p.add_argument("--threads", default="1,2", help="comma-separated decode thread counts")
  p.add_argument("--seconds", type=float, default=5.0)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--emulate-us", default=None, help="D,R: decode emulation (bench.emulate)")
  p.add_argument("--no-py-spy", action="store_true", help="the shim alone")
  p.add_argument("--top", type=int, default=10, help="top GIL holders (py-spy) to list")
  p.add_argument("--json", default=None, help="write every run here")
  args = parser.parse_args(argv)
  threads = [int(t) for t in args.threads.split(",")]
  emulate_us = tuple(float(x) for x in args.emulate_us.split(",")) if args.emulate_us else None
  spy = not args.no_py_spy and _py_spy() is not None
  runs: dict[int, list[dict]] = {t: [] for t in threads}
  for _ in range(args.repeats):  # interleaved: each repeat runs every configuration
    for t in threads:
      kw = dict(emulate_us=emulate_us, seconds=args.seconds)
      shim = measure_loader(args.data_dir, t, **kw)
      if spy:
        spied = measure_loader(args.data_dir, t, py_spy=True, **kw)
        shim.update(
          gil_us_pyspy=spied["gil_us_pyspy"],
          img_s_pyspy=spied["img_s"],
          cpu_us_pyspy=spied["cpu_us"],
          spy_stacks=spied["spy_stacks"],
        )
      runs[t].append(shim)
      print(json.dumps({k: v for k, v in shim.items() if k != "spy_stacks"}), file=sys.stderr)
  print(f"median (min-max) of {args.repeats}; emulate_us={emulate_us}")
  print("| threads | img/s | CPU us/img | GIL us/img (shim) | GIL us/img (py-spy) |")
  print("|---|---|---|---|---|")
  for t, rs in runs.items():
    spy_col = _summary([r["gil_us_pyspy"] for r in rs]) if spy else "-"
    cols = [_summary([r[k] for r in rs]) for k in ("img_s", "cpu_us", "gil_us")]
    print(f"| {t} | {' | '.join(cols)} | {spy_col} |")
  if spy:
    for t, rs in runs.items():
      stacks = [s for r in rs for s in r["spy_stacks"]]
      for inclusive in (False, True):
        print(f"\ntop GIL holders at {t} threads ({'inclusive' if inclusive else 'self'}):")
        for name, share in top_holders(stacks, args.top, inclusive):
          print(f"  {share:6.1%}  {name}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "--child":
    print(json.dumps(_child_run(json.loads(sys.argv[2]))))
  else:
    from bench import measure

    measure.run_cli(main, sys.argv[1:])
