"""A storage rig: a directory served with a fixed latency per read and no page cache.

    python -m bench.rig data/photos /tmp/slow-photos --latency-ms 20    # Ctrl-C unmounts
    python -m bench.rig data/photos /tmp/slow-photos --latency-ms 20 --requests-per-s 250

Object storage (a GCS bucket through gcsfuse, `gs://`) answers each read after 5-100 ms and
a local page cache hides nothing from it. `latencyfs` (bench/latencyfs.c, FUSE) is a
read-only passthrough that answers every read request of a file no sooner than the latency
after it arrived, never from the page cache (direct_io: every epoch pays again, no kernel
readahead), on up to 1024 threads so concurrent reads wait concurrently. A bucket also
rations requests: `requests_per_s` starts requests no closer than 1/requests_per_s apart
(the rest queue), `mb_per_s` lets their bytes out at that rate. It counts read requests,
bytes, reads in flight (now and at most) and reads that waited for a cap: `Mount.stats()`,
or `cat MOUNTPOINT/.rig-stats`; reading `.rig-reset` zeroes the counters. Reading `.rig-stall`
makes every read and open wait until `.rig-resume` is read (`Mount.stall()`): a mount that
stops answering (a request interrupted by its process's exit ends, as in gcsfuse);
`.rig-stall-stats` stalls the stats that reach it too (`Mount.stall(stats=True)`; the kernel
keeps names and attributes `attr_timeout_s`, 60 s; 0: every stat reaches the rig).

`ensure_built()` compiles it once into ~/.cache/pipeline-rig (keyed by the source's hash),
installing fuse3 and libfuse3-dev with apt-get first when they are missing and we are root;
`mount()` mounts it for a `with` block and always unmounts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from bench import measure

SOURCE = pathlib.Path(__file__).with_name("latencyfs.c")
APT_PACKAGES = ("fuse3", "libfuse3-dev", "pkg-config")


class RigUnavailable(RuntimeError):
  """The rig cannot run on this machine; the message says why in one line."""


def _have_fuse3() -> bool:
  if not shutil.which("fusermount3") or not shutil.which("pkg-config"):
    return False
  return subprocess.run(["pkg-config", "--exists", "fuse3"], check=False).returncode == 0


def _install_fuse3() -> None:
  if os.geteuid() != 0 or not shutil.which("apt-get"):
    raise RigUnavailable(
      "the storage rig needs FUSE 3: install fuse3, libfuse3-dev and pkg-config "
      "(Debian/Ubuntu: sudo apt-get install -y fuse3 libfuse3-dev pkg-config)"
    )
  env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
  for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
      last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
      raise RigUnavailable(f"`{' '.join(cmd)}` failed: {last[0]}")


def ensure_built() -> pathlib.Path:
  """The latencyfs binary, compiled (and FUSE 3 installed) if needed; raises RigUnavailable."""
  if not os.path.exists("/dev/fuse"):
    raise RigUnavailable("no /dev/fuse on this machine: the storage rig needs FUSE")
  if not _have_fuse3():
    # One install at a time (test processes under pytest-xdist call this at once): the
    # others wait for the lock, then find FUSE installed.
    with open(os.path.join(tempfile.gettempdir(), "pipeline-rig-apt.lock"), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if not _have_fuse3():
        _install_fuse3()
      if not _have_fuse3():
        raise RigUnavailable("fuse3 and libfuse3-dev were installed but pkg-config finds no fuse3")
  flags = subprocess.run(
    ["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True, check=True
  ).stdout.split()
  return measure.compiled(SOURCE, "latencyfs-HASH", flags, RigUnavailable)


@dataclasses.dataclass
class Mount:
  """A mounted rig: `path` serves the source directory with `latency_ms` per read."""

  path: pathlib.Path
  source: pathlib.Path
  latency_ms: float
  requests_per_s: float = 0.0
  mb_per_s: float = 0.0
  attr_timeout_s: float = 60.0

  def stats(self) -> dict:
    """reads, bytes, in_flight, max_in_flight, opens (data files only), capped and slowed
    (reads that waited for the request cap, the bandwidth cap), and the settings."""
    return json.loads((self.path / ".rig-stats").read_text())

  def reset(self) -> dict:
    """Zeroes the counters; returns them as they were."""
    return json.loads((self.path / ".rig-reset").read_text())

  @contextlib.contextmanager
  def stall(self, stats: bool = False) -> Iterator[None]:
    """Reads and opens of data files (and their stats the kernel's cache does not answer,
    with `stats`) wait (blocked in their syscall) until the `with` block ends, or the kernel
    interrupts them (their process exits). A stalled stat holds every lookup in its folder:
    only for processes that end within the block."""
    (self.path / (".rig-stall-stats" if stats else ".rig-stall")).read_text()
    try:
      yield
    finally:
      (self.path / ".rig-resume").read_text()


def _mounted(path: pathlib.Path) -> bool:
  real = os.path.realpath(path)
  with open("/proc/mounts") as f:
    return any(line.split()[1] == real for line in f)


def _unmount(path: pathlib.Path, proc: subprocess.Popen) -> None:
  if proc.poll() is None or _mounted(path):
    res = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, check=False)
    if res.returncode and _mounted(path):  # still busy: detach now, free when unused
      subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, check=False)
  try:
    proc.wait(timeout=10)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()


@contextlib.contextmanager
def mount(
  source_dir: str | os.PathLike,
  latency_ms: float,
  mountpoint: str | os.PathLike | None = None,
  threads: int = 1024,
  requests_per_s: float = 0.0,
  mb_per_s: float = 0.0,
  attr_timeout_s: float = 60.0,
) -> Iterator[Mount]:
  """Serves `source_dir` read-only at `mountpoint` (default: a fresh temporary folder,
  removed afterwards) with `latency_ms` per read request, at most `requests_per_s` requests
  and `mb_per_s` MB a second (0: no cap), names and attributes kept by the kernel
  `attr_timeout_s`, for the `with` block. The filesystem also unmounts itself if this
  process dies."""
  source = pathlib.Path(source_dir).resolve()
  if not source.is_dir():
    raise FileNotFoundError(f"rig source {source_dir} is not a directory")
  for name, value in (
    ("latency_ms", latency_ms),
    ("requests_per_s", requests_per_s),
    ("mb_per_s", mb_per_s),
    ("attr_timeout_s", attr_timeout_s),
  ):
    if value < 0:
      raise ValueError(f"{name} must be >= 0, got {value}")
  binary = ensure_built()
  made = mountpoint is None
  path = pathlib.Path(mountpoint or tempfile.mkdtemp(prefix="pipeline-rig-")).resolve()
  path.mkdir(parents=True, exist_ok=True)
  if _mounted(path):
    raise RigUnavailable(f"{path} is already a mount point")
  log = tempfile.TemporaryFile(mode="w+")
  proc = subprocess.Popen(
    [
      *(str(binary), str(source), str(path), "-f", "-o"),
      f"latency_ms={latency_ms},threads={threads},requests_per_s={requests_per_s},"
      f"mb_per_s={mb_per_s},attr_timeout_s={attr_timeout_s}",
    ],
    stdin=subprocess.DEVNULL,
    stdout=log,
    stderr=log,
  )
  try:
    deadline = time.monotonic() + 10
    while not _mounted(path):
      if proc.poll() is not None or time.monotonic() > deadline:
        log.seek(0)
        lines = log.read().strip().splitlines() or ["no output"]
        raise RigUnavailable(f"latencyfs could not mount {path}: {lines[-1]}")
      time.sleep(0.01)
    yield Mount(
      path, source, float(latency_ms), float(requests_per_s), float(mb_per_s), attr_timeout_s
    )
  finally:
    _unmount(path, proc)
    log.close()
    if made:
      with contextlib.suppress(OSError):
        path.rmdir()


def main(argv: list[str]) -> None:
  p = measure.Parser(
    prog="python -m bench.rig",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("source", help="the directory to serve, e.g. a converted dataset")
  p.add_argument("mountpoint", help="where to mount it (created if missing)")
  p.add_argument("--latency-ms", type=float, default=20.0, help="per read request (default 20)")
  p.add_argument("--threads", type=int, default=1024, help="most reads served at once")
  p.add_argument("--requests-per-s", type=float, default=0, help="request cap (0: none)")
  p.add_argument("--mb-per-s", type=float, default=0, help="bandwidth cap (0: none)")
  args = p.parse_args(argv)
  caps = (args.requests_per_s, args.mb_per_s)
  with mount(args.source, args.latency_ms, args.mountpoint, args.threads, *caps) as m:
    limits = [f"at most {m.requests_per_s:g} requests/s" if m.requests_per_s else "no request cap"]
    limits.append(f"at most {m.mb_per_s:g} MB/s" if m.mb_per_s else "no bandwidth cap")
    print(
      f"{m.source} -> {m.path}: {m.latency_ms:g} ms per read, {' and '.join(limits)}, no page "
      f"cache; counters: cat {m.path}/.rig-stats; Ctrl-C unmounts",
      flush=True,
    )

    def stop(*_):
      raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # also when started in the background (SIGINT ignored)
    try:
      while True:
        time.sleep(3600)
    except KeyboardInterrupt:
      pass
    print(json.dumps(m.stats()), flush=True)


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
