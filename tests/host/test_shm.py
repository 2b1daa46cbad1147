"""Shared memory for the worker hand-off (pipeline/host/shm.py): a block dropped unsent goes back
to its ring, and a sweep removes the blocks of a process that is gone, never a live one's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pipeline.host import shm
from tests.conftest import REPO


def test_a_block_dropped_unsent_goes_back_to_the_ring():
  writer = shm.Writer.new()
  image = writer.empty((4, 160, 160, 3), np.uint8)
  block = writer.ring().find(image)
  del image
  assert block.words[0] == shm.FREE


# A process that makes a ring block, prints its path, and waits (alive) or exits at once
# without cleaning up (a crash).
HOLDER = """
import os, sys
from pipeline.host import shm
writer = shm.Writer.new()
image = writer.empty((1 << 20,), "uint8")
print(writer.ring().blocks[0].path, flush=True)
if sys.argv[1] == "crash":
  os._exit(0)
sys.stdin.read()
"""


def _holder(mode: str) -> tuple[subprocess.Popen, str]:
  proc = subprocess.Popen(
    [sys.executable, "-c", HOLDER, mode],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": str(REPO)},
  )
  return proc, proc.stdout.readline().strip()


def test_blocks_of_a_crashed_process_are_swept():
  proc, path = _holder("crash")
  proc.wait(timeout=60)
  assert os.path.exists(path)
  assert shm.sweep_crashed() >= 1
  assert not os.path.exists(path)


def _unshare_pid() -> list[str]:
  """The command prefix that runs a process in a new PID namespace, or skips (fails in CI)."""
  ok = os.geteuid() == 0 and shutil.which("unshare")
  if ok:
    ok = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0
  if not ok:
    if os.environ.get("CI") == "true":
      pytest.fail("CI=true but cannot make a PID namespace (needs root and unshare)")
    pytest.skip("needs root and util-linux unshare to make a PID namespace")
  return ["unshare", "--pid", "--fork"]


def test_a_sweep_from_another_pid_namespace_leaves_live_blocks_alone():
  """A process in another container sharing /dev/shm sees none of our process ids."""
  proc, path = _holder("live")
  try:
    sweeper = "from pipeline.host import shm; shm.Writer.new(); shm.sweep_crashed()"
    subprocess.run(
      [*_unshare_pid(), sys.executable, "-c", sweeper],
      check=True,
      cwd=REPO,
      env={**os.environ, "PYTHONPATH": str(REPO)},
      timeout=60,
    )
    assert os.path.exists(path)  # its worker lives: the block is not the sweeper's to take
  finally:
    proc.kill()
    proc.wait()
  assert shm.sweep_crashed() >= 1 and not os.path.exists(path)  # now it is gone
