"""How we measure a loader: first-batch latency, steady-state images/s, peak RSS; and what
every benchmark shares: the machine line, the command line's common flags, JSON output,
one-line failures, measuring children, worker processes' CPU, the C helpers' builds, the
share of a dataset's pages in the page cache.

Throughput counts only batches after the first (steady state); the first batch's latency
(from creating the iterator) is its own number. Peak RSS is sampled for this process and
its children (worker processes), so a loader with workers pays for them.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psutil

from pipeline.host import memory

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
  ctypes.c_void_p,
  ctypes.c_size_t,
  ctypes.c_int,
  ctypes.c_int,
  ctypes.c_int,
  ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


@dataclasses.dataclass
class Result:
  name: str
  images_per_sec: float
  first_batch_s: float
  peak_rss_mb: float
  images: int
  seconds: float
  # this process's CPU (all its threads; worker processes not counted) to the first batch
  first_batch_cpu_s: float = 0.0

  def row(self) -> str:
    return (
      f"{self.name:28s} {self.images_per_sec:9.0f} img/s   first batch "
      f"{self.first_batch_s:6.2f} s   peak RSS {self.peak_rss_mb:7.0f} MB"
    )


SAMPLER = "bench-rss-sampler"  # its thread's name: its CPU is the bench's, not the loader's


class RssSampler:
  """Peak RSS of this process tree: the kernel's exact peak for this process, plus its
  worker processes sampled every `interval` seconds (rarely: sampling holds the GIL, and
  a frequent sampler slowed the loaders it measured by up to 30%; at 0.5 s it still took
  1.4-2.9% of a 2-core pipeline run's CPU, reading each thread's children). `pss`: the
  tree's PSS instead (`tree_pss`), pages shared between its processes counted once."""

  def __init__(self, interval: float = 0.5, pss: bool = False):
    self.interval, self.peak, self.pss = interval, 0, pss
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name=SAMPLER)

  def _sample(self) -> int:
    if self.pss:
      return tree_pss()
    return memory.tree_rss()

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, self._sample())
      self._stop.wait(self.interval)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, self._sample())


def tree_pss() -> int:
  """Bytes of PSS of this process and its children (shared memory split among its users)."""
  total = 0
  for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
    try:
      total += p.memory_full_info().pss
    except psutil.Error:  # a child that exited meanwhile
      continue
  return total


def run(
  name: str,
  make_iterator: Callable[[], Iterator],
  batch_size: int,
  num_images: int,
  timed: Callable[[bool], None] | None = None,
) -> Result:
  """Times `num_images` images (after the first batch) from a fresh iterator. `timed(True)`
  is called when the timed part starts, `timed(False)` when it ends (e.g. to read counters)."""
  with RssSampler() as rss:
    start, start_cpu = time.perf_counter(), time.process_time()
    it = make_iterator()
    next(it)
    first_cpu = time.process_time() - start_cpu
    if timed:
      timed(True)
    first = time.perf_counter()
    seen = 0
    while seen < num_images:
      next(it)
      seen += batch_size
    end = time.perf_counter()
    if timed:
      timed(False)
    close = getattr(it, "close", None)
    if close:
      close()
  rate = seen / (end - first)
  return Result(name, rate, first - start, rss.peak / 2**20, seen, end - first, first_cpu)


def workers() -> list[psutil.Process]:
  """Grain's worker processes: this process's spawned children (not multiprocessing's
  resource tracker, nor a FUSE server it started)."""
  out = []
  for child in psutil.Process().children(recursive=True):
    try:
      if "spawn_main" in " ".join(child.cmdline()):
        out.append(child)
    except psutil.Error:  # a child that exited meanwhile
      continue
  return out


def cpu_s(procs: list[psutil.Process]) -> float:
  """CPU seconds of other processes (in clock ticks: precise over seconds, not over ms)."""
  total = 0.0
  for p in procs:
    try:
      t = p.cpu_times()
      total += t.user + t.system
    except psutil.Error:
      continue
  return total


def machine() -> str:
  """A line naming the machine, printed beside every figure."""
  return (
    f"{platform.node()}: {psutil.cpu_count()} CPUs "
    f"({len(psutil.Process().cpu_affinity())} usable), "
    f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
    f"{platform.processor() or platform.machine()}"
  )


def write_json(path, payload) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=2)


class Parser(argparse.ArgumentParser):
  """A tool's command line whose usage errors are one line (argparse prints the usage first)."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive(kind: type) -> Callable[[str], Any]:
  """An argparse type: a `kind` number above 0."""

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not value > 0:
      raise argparse.ArgumentTypeError(f"takes a positive {kind.__name__}: {text!r}")
    return value

  return parse


DATA_DIR = "a converted dataset (manifest.json + shards)"
FLAGS = {  # the flags the tools share; a tool may give another default
  "split": dict(default="train", help="the split to read (default: train)"),
  "batch_size": dict(
    type=positive(int), default=128, help="images per batch (default: %(default)s)"
  ),
  "image_size": dict(
    type=positive(int), default=224, help="output side in pixels (default: %(default)s)"
  ),
  "seconds": dict(type=positive(float), default=3.0, help="steady-state seconds per run"),
  "threads": dict(type=int, default=None, help="threads (default: one per core)"),
  "repeats": dict(type=positive(int), default=2, help="runs per row; the best counts"),
  "rounds": dict(type=positive(int), default=3, help="interleaved rounds (default: %(default)s)"),
  "batches": dict(type=positive(int), default=20, help="batches per run (default: %(default)s)"),
  "epochs": dict(type=positive(float), default=3, help="images timed = epochs x split size"),
  "json": dict(help="write the figures to this file"),
}


def numbers(kind: type = int, least: float = 1) -> Callable[[str], list]:
  """An argparse type: comma-separated numbers of `kind`, none under `least`."""
  what = "positive integers" if (kind, least) == (int, 1) else f"numbers >= {least:g}"

  def parse(text: str) -> list:
    try:
      values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
      values = []
    if not values or min(values) < least:
      raise argparse.ArgumentTypeError(f"takes comma-separated {what}, e.g. 1,16: {text!r}")
    return values

  return parse


def parser(
  command: str, doc: str, *flags: str, data_dir: str | None = DATA_DIR, **defaults
) -> argparse.ArgumentParser:
  """A tool's command line: `python -m bench COMMAND` (a dotted COMMAND: `python -m
  COMMAND`), its docstring, a DATA_DIR argument (None: none) and the shared FLAGS named in
  `flags`, with `defaults` (by flag name) replacing theirs."""
  p = Parser(
    prog=f"python -m {command}" if "." in command else f"python -m bench {command}",
    description=doc,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  if data_dir:
    p.add_argument("data_dir", help=data_dir)
  for name in flags:
    keywords = {**FLAGS[name], **({"default": defaults[name]} if name in defaults else {})}
    p.add_argument("--" + name.replace("_", "-"), **keywords)
  return p


def flags(**values) -> list[str]:
  """`--name value` options for a tool's command line."""
  return [x for name, value in values.items() for x in (f"--{name.replace('_', '-')}", str(value))]


def finish(p: argparse.ArgumentParser, args, argv: list[str], result: dict) -> dict:
  """`result` with the machine and the command that measured it, written to --json when
  given."""
  result.update(machine=machine(), command=f"{p.prog} {' '.join(argv)}")
  if getattr(args, "json", None):
    write_json(args.json, result)
  return result


def run_cli(main: Callable[[list[str]], object], argv: list[str]) -> None:
  """Runs a tool's `main(argv)`. A failure prints one line: bad input or arguments (a missing
  dataset, a value refused) exit 2, as `python -m pipeline.convert`'s, anything else 1;
  `--verbose` (anywhere in argv) lets the traceback through instead."""
  if "--verbose" in argv:
    main([a for a in argv if a != "--verbose"])
    return
  try:
    main(argv)
  except (ValueError, KeyError, OSError) as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
  except Exception as e:  # noqa: BLE001 - any failure: one line, the traceback on request
    sys.exit(f"error: {type(e).__name__}: {e} (--verbose shows the traceback)")


ROOT = pathlib.Path(__file__).resolve().parent.parent


def child(module: str, spec: dict, env: dict | None = None) -> dict:
  """The JSON a fresh `python -m MODULE --child SPEC` prints last (this repository on its
  path); a failed child is a RuntimeError with its last line."""
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  proc = subprocess.run(
    [sys.executable, "-m", module, "--child", json.dumps(spec)],
    capture_output=True,
    text=True,
    check=False,
    env=env,
    cwd=ROOT,
  )
  if proc.returncode:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"a measuring process failed (exit {proc.returncode}): {tail[0]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def compiled(
  source: pathlib.Path, name: str, flags: list[str], error: type[Exception]
) -> pathlib.Path:
  """`source` (C) built with `flags` into the user's cache, once per content (`name`-HASH);
  `error` in one line without a C compiler or when the build fails."""
  code = source.read_bytes()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  out = (
    pathlib.Path(base)
    / "pipeline-bench"
    / name.replace("HASH", hashlib.sha256(code).hexdigest()[:16])
  )
  if out.exists():
    return out
  cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
  if not cc:
    raise error(f"no C compiler (cc) to build {source.name} (apt-get install gcc)")
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
  proc = subprocess.run(
    [cc, "-O2", "-Wall", "-o", str(tmp), str(source), *flags],
    capture_output=True,
    text=True,
    check=False,
  )
  if proc.returncode:
    first = next((x for x in proc.stderr.splitlines() if "error" in x), proc.stderr.strip())
    raise error(f"building {source.name} failed: {first}")
  os.replace(tmp, out)
  return out


def cached_share(paths: Sequence[str]) -> float:
  """Share of the files' pages now in the page cache (mincore(2); does not read them)."""
  cached = total = 0
  for path in paths:
    size = os.path.getsize(path)
    if not size:
      continue
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
      addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
      if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap failed on {path}")
      try:
        vec = ctypes.create_string_buffer(pages)
        if _libc.mincore(addr, size, vec):
          raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
        cached += sum(b & 1 for b in vec.raw)
      finally:
        _libc.munmap(addr, size)
    total += pages
  return cached / total if total else 1.0
