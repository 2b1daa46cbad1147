"""Faults of the processes and resources around a pipeline, reproduced for real: the main
process SIGKILLed under its workers, a container's small /dev/shm, too little memory to open
a split. Each ends in a clear line or a clean exit within a bounded time, never a hang, a
SIGBUS or orphaned workers."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pipeline.host import shm
from tests.conftest import REPO, run_command

ENV = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}

WORKERS = """
import sys
import pipeline

def main():
  ds = pipeline.make_dataset(sys.argv[1], batch_size=8, image_size=64, shard_index=0,
                             shard_count=1, performance=dict(num_workers=2, num_threads=1))
  it = iter(ds)
  next(it)
  print("ready", flush=True)
  sys.stdin.read()  # alive until killed

if __name__ == "__main__":
  main()
"""


def _gone(process: psutil.Process) -> bool:
  try:
    return process.status() == psutil.STATUS_ZOMBIE  # dead, waiting for init to reap it
  except psutil.NoSuchProcess:
    return True


def _start_workers(digits_dir, tmp_path, stderr) -> subprocess.Popen:
  """The WORKERS script (2 worker processes) started and ready to be stopped."""
  script = tmp_path / "main.py"
  script.write_text(WORKERS)
  main = subprocess.Popen(
    [sys.executable, str(script), str(digits_dir)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=stderr,
    text=True,
    cwd=tmp_path,
    env=ENV,
  )
  if main.stdout.readline() != "ready\n":
    main.kill()
    pytest.fail(f"the script did not start: exit {main.wait()}")
  return main


def _left_behind(children: list[psutil.Process], blocks: set[str]) -> tuple[list[int], list[str]]:
  """The `children` still alive after 10 s (killed, so none is left to the next test) and the
  ring blocks new since `blocks` that no live process holds."""
  deadline = time.monotonic() + 10
  while not all(map(_gone, children)) and time.monotonic() < deadline:
    time.sleep(0.1)
  alive = [c.pid for c in children if not _gone(c)]
  for pid in alive:
    os.kill(pid, 9)
  new = set(glob.glob(f"{shm.SHM_DIR}/{shm.PREFIX}-*")) - blocks
  return alive, [path for path in new if shm._orphaned(path)]  # not another test run's, held


def test_workers_die_with_a_sigkilled_main_process(digits_dir, tmp_path):
  blocks = set(glob.glob(f"{shm.SHM_DIR}/{shm.PREFIX}-*"))
  main = _start_workers(digits_dir, tmp_path, subprocess.DEVNULL)
  try:
    children = psutil.Process(main.pid).children(recursive=True)
    workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(workers) == 2, [c.cmdline() for c in children]
  finally:
    main.kill()
    main.wait()
  alive, left = _left_behind(children, blocks)
  assert not alive, "worker processes outlived their SIGKILLed main process"
  assert not left  # the workers unlinked their ring blocks on the way out


def test_a_plain_sigterm_exits_cleanly_with_no_leaked_semaphores(digits_dir, tmp_path):
  """Grain's worker queues hold named semaphores; killed by SIGTERM's default action, the
  main process left them to multiprocessing's resource tracker, which warned of 50 leaked."""
  blocks = set(glob.glob(f"{shm.SHM_DIR}/{shm.PREFIX}-*"))
  main = _start_workers(digits_dir, tmp_path, subprocess.PIPE)
  try:
    children = psutil.Process(main.pid).children(recursive=True)
    main.send_signal(signal.SIGTERM)
    _, err = main.communicate(timeout=60)  # the resource tracker's warning comes before EOF
  finally:
    main.kill()
  assert main.returncode == 128 + signal.SIGTERM, err
  assert "leaked semaphore" not in err and "Traceback" not in err, err
  alive, left = _left_behind(children, blocks)
  assert not alive, "worker processes outlived their SIGTERMed main process"
  assert not left


SMALL_SHM = """
import sys
import pipeline

def main():
  ds = pipeline.make_dataset(sys.argv[1], batch_size=16, image_size=128, shard_index=0,
                             shard_count=1, performance=dict(num_workers=2, num_threads=1))
  it = iter(ds)
  for _ in range(40):
    next(it)
  print("40 batches", flush=True)

if __name__ == "__main__":
  main()
"""


def _private_mounts() -> list[str]:
  """The command prefix that runs a process in a private mount namespace, or skips (fails in
  CI, where the runner is root with util-linux)."""
  ok = os.geteuid() == 0 and shutil.which("unshare")
  if ok:
    ok = subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0
  if not ok:
    if os.environ.get("CI") == "true":
      pytest.fail("CI=true but cannot make a mount namespace (needs root and unshare)")
    pytest.skip("needs root and util-linux unshare to mount a small /dev/shm privately")
  return ["unshare", "--mount"]


def test_a_dev_shm_too_small_for_the_workers_falls_back_to_threads_in_one_line(
  digits_dir, tmp_path
):
  """Docker's default /dev/shm is 64 MiB; here 8 MiB, for 2 workers whose rings need ~12."""
  script = tmp_path / "small_shm.py"
  script.write_text(SMALL_SHM)
  shell = (
    f"mount -t tmpfs -o size=8m tmpfs {shm.SHM_DIR} && exec {sys.executable} {script} {digits_dir}"
  )
  p = run_command([*_private_mounts(), "sh", "-c", shell], cwd=tmp_path, env=ENV, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.strip() == "40 batches"
  (line,) = [x for x in p.stderr.splitlines() if "/dev/shm" in x]
  assert line.startswith("pipeline: no worker processes, ") and "--shm-size" in line, line


LIMITED = """
import resource, sys
import pipeline, pipeline.dataset

def virtual() -> int:
  with open("/proc/self/status") as f:
    return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:"))

limit = virtual() + 300 * 2**20  # what this process has, the library loaded, and 300 MiB more
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
ds = pipeline.make_dataset(sys.argv[1], batch_size=8, image_size=64, shard_index=0,
                           shard_count=1)
next(iter(ds))
"""


def test_too_little_memory_to_open_a_split_is_one_line_not_a_hang(digits_dir):
  p = run_command([sys.executable, "-c", LIMITED, digits_dir], env=ENV, timeout=60)  # a hang fails
  assert p.returncode == 1
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith(
    f"pipeline.host.guards.AddressSpaceError: out of memory to open split 'train' of {digits_dir}: "
  ), p.stderr[-2000:]
  assert "ulimit -v" in last
