"""A block whose read failed in one worker process is not read again by those waiting for it
(`pipeline.storage.blockstore`): they raise its error, in one line; a later take reads it
again. Real processes share the store: the claimant is a spawned process, the waiter this one."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from pipeline.storage import blockstore, remote
from pipeline.storage.blockstore import BlockStore

ERROR = "cannot read /mnt/ds/train.array_record-00000-of-00001: it answered 503 five times"


def claim_then_fail(token: str, claimed, go) -> None:
  """A worker process: claims block (0, 0), then its read fails once `go` is set."""

  def read():
    claimed.set()
    go.wait(60)
    raise remote.RemoteStorageError(ERROR)

  try:
    BlockStore(token, 2**20).take((0, 0), [0], read)
  except remote.RemoteStorageError:
    pass


def waiting_on_a_lock(pid: int) -> bool:
  """Whether a thread of process `pid` waits for a flock (/proc/locks: "->" lines)."""
  with open("/proc/locks") as f:
    return any("->" in line and "FLOCK" in line and f" {pid} " in line for line in f)


def test_a_failed_read_is_raised_by_its_waiters_and_read_again_later():
  store = BlockStore.new(2**20)
  ctx = multiprocessing.get_context("spawn")
  claimed, go = ctx.Event(), ctx.Event()
  claimant = ctx.Process(target=claim_then_fail, args=(store.token, claimed, go))
  claimant.start()
  assert claimed.wait(60)
  reads, raised = [], []

  def wait_for_it():
    try:
      BlockStore(store.token, 2**20).take((0, 0), [0], lambda: reads.append(1) or [b"x"])
    except (OSError, remote.RemoteStorageError) as e:
      raised.append(e)

  waiter = threading.Thread(target=wait_for_it)
  waiter.start()
  for _ in range(600):  # until it waits for the claimant's lock (a hang detector, not a timing)
    if waiting_on_a_lock(os.getpid()):
      break
    time.sleep(0.1)
  else:
    pytest.fail("the waiter never waited for the claimant's lock")
  go.set()
  waiter.join(60)
  claimant.join(60)
  assert reads == [] and len(raised) == 1
  assert isinstance(raised[0], remote.RemoteStorageError) and str(raised[0]) == ERROR
  assert store.take((0, 0), [0], lambda: reads.append(1) or [b"x"]) == [b"x"]
  assert reads == [1]  # a later take reads it again
  blockstore.remove(store.token)
