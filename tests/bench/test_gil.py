"""bench.gil: the LD_PRELOAD shim counting GIL-held CPU, checked in real child processes
(CPU shares only, no wall-clock assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bench import gil, measure
from tests.conftest import build_or_skip

CHILD_HEAD = """
import json, os, threading, time
from bench import gil

def pure_python(n):
  x = 0
  for i in range(n):
    x += i * i
  return x

def wait_exited(thread):  # join() returns before the pthread ends and adds its last interval
  for _ in range(1000):
    if not os.path.exists(f"/proc/self/task/{thread.native_id}"):
      return
    time.sleep(0.002)
"""


@pytest.fixture(scope="module")
def shim_env():
  build_or_skip("GIL shim", gil.ensure_built, gil.ShimUnavailable)
  env = gil.preload_env()
  env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
  return env


def run_child(env: dict, body: str) -> dict:
  code = CHILD_HEAD + textwrap.dedent(body)
  proc = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    env=env,
    cwd=measure.ROOT,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pure_python_holds_the_gil(shim_env):
  got = run_child(
    shim_env,
    """
    c = gil.Counter()
    pure_python(2_000_000)  # on the main thread: the reading's own ctypes call counts it
    t = threading.Thread(target=pure_python, args=(2_000_000,))
    t.start()
    t.join()
    wait_exited(t)
    r = c.read()
    print(json.dumps(dict(held=r.held_s, cpu=r.cpu_s)))
    """,
  )
  assert got["cpu"] > 0
  assert got["held"] >= 0.9 * got["cpu"], got
  assert got["held"] <= 1.05 * got["cpu"] + 0.005, got


def test_released_work_is_not_held(shim_env):
  got = run_child(
    shim_env,
    """
    import numpy as np
    a = np.random.default_rng(0).random((700, 700))
    def work():
      for _ in range(6):
        a @ a  # BLAS: numpy releases the GIL around it
    threads = [threading.Thread(target=work) for _ in range(2)]
    c = gil.Counter()
    for t in threads:
      t.start()
    for t in threads:
      t.join()
      wait_exited(t)
    r = c.read()
    print(json.dumps(dict(held=r.held_s, cpu=r.cpu_s, acq=r.acquisitions)))
    """,
  )
  assert got["cpu"] > 0
  assert got["held"] <= 0.2 * got["cpu"], got
  assert got["acq"] >= 12, got  # each matmul re-takes the GIL through the shim


def test_counters_are_monotonic(shim_env):
  got = run_child(
    shim_env,
    """
    import numpy as np
    a = np.ones((200, 200))
    seen = []
    for _ in range(20):
      a @ a
      pure_python(20_000)
      seen.append((gil.held_s(), gil.acquisitions()))
    print(json.dumps(dict(seen=seen, loaded=gil.loaded())))
    """,
  )
  held, acq = zip(*got["seen"])
  assert got["loaded"]
  assert acq[0] > 0
  assert all(b > a for a, b in zip(held, held[1:])), held
  assert all(b > a for a, b in zip(acq, acq[1:])), acq


def test_unloaded_process_says_so():
  code = "from bench import gil; print(gil.loaded()); gil.held_s()"
  env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
  proc = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=measure.ROOT
  )
  assert proc.stdout.strip() == "False"
  assert "not loaded in this process" in proc.stderr
