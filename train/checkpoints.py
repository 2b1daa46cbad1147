"""Checkpoints you can trust.

Each checkpoint holds the model and optimizer state, every process's data-iterator state,
and the sha256 of both (an Orbax JSON item). A checkpoint that fails to restore (a
truncated file) or does not match its checksums (flipped bytes) is moved aside and the
previous one is used. One trainer per workdir (a lock file); a failed save says why in
one line.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import sys
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from train import TrainError, UsageError


def checksum(state) -> str:
  """sha256 of every leaf's bytes, in a fixed order: equal states give equal sums."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_leaves_with_path(nnx.state(state))
  for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
    h.update(jax.tree_util.keystr(path).encode())
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    h.update(np.asarray(jax.device_get(leaf)).tobytes())
  return h.hexdigest()


def data_checksum(iterator) -> str:
  """sha256 of an iterator's state as Grain's checkpoint handler writes it."""
  return hashlib.sha256(json.dumps(iterator.get_state(), indent=4).encode()).hexdigest()


def _all_processes(digest: str) -> list[str]:
  gathered = multihost_utils.process_allgather(np.frombuffer(bytes.fromhex(digest), np.uint8))
  return [bytes(row).hex() for row in np.asarray(gathered).reshape(jax.process_count(), -1)]


def _agree(ok: bool) -> bool:
  return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def one_line(error: BaseException, limit: int = 300) -> str:
  """The most telling message of an exception chain, on one line: an OSError's if any
  or TensorStore's errno (disk full, permissions), else the root cause's message."""
  chain, e = [], error
  while e is not None and e not in chain:
    chain.append(e)
    e = e.__cause__ or e.__context__
  os_errors = [e for e in chain if isinstance(e, OSError) and e.strerror]
  code = re.search(r"os_error_code='(\d+)'", str(chain[-1]))  # TensorStore's
  if os_errors:
    e = os_errors[-1]
    text = e.strerror + (f": {e.filename}" if e.filename else "")
  elif code:
    text = f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
  else:
    text = f"{type(chain[-1]).__name__}: {chain[-1]}"
  text = " ".join(text.split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


class Checkpoints:
  """An Orbax CheckpointManager over WORKDIR/checkpoints that checks what it restores."""

  def __init__(self, workdir: epath.Path, keep: int):
    self.workdir = workdir
    self.directory = workdir / "checkpoints"
    if self.directory.exists() and not self.directory.is_dir():  # else: train, then fail to save
      raise UsageError(f"{self.directory} is not a folder: move it aside to keep checkpoints")
    self.manager = ocp.CheckpointManager(
      self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data) -> None:
    sums = {
      "state_sha256": checksum(state),
      "data_sha256": _all_processes(data_checksum(data)),  # one per process
      "step": step,  # a copy under another step's name is not that step's checkpoint
    }
    try:
      self.manager.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=grain.checkpoint.CheckpointSave(data),
          checksums=ocp.args.JsonSave(sums),
        ),
        force=True,
      )
      self.manager.wait_until_finished()
    except Exception as e:
      raise TrainError(f"saving checkpoint {step} to {self.directory} failed: {one_line(e)}") from e

  def _restore(self, step: int, abstract, data):
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=grain.checkpoint.CheckpointRestore(data),
        checksums=ocp.args.JsonRestore(),
      ),
    )
    sums = restored.checksums
    if sums.get("step", step) != step:  # checkpoints saved before "step" was recorded lack it
      raise ValueError(f"it was saved as step {sums['step']}, not {step} (copied or renamed?)")
    if checksum(restored.state) != sums["state_sha256"]:
      raise ValueError("the model state does not match its checksum")
    if data_checksum(data) != sums["data_sha256"][jax.process_index()]:
      raise ValueError("the data-iterator state does not match its checksum")
    return restored.state

  def restore(self, state, data) -> tuple[int, Any]:
    """(step, state) of the newest checkpoint that restores and matches its checksums, with
    `data` set to its iterator state; (0, state) when there is no checkpoint. Newer ones
    that fail are moved to WORKDIR/unrestorable/ with a warning."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    self._check_process_count()
    failed = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        restored, why = self._restore(step, abstract, data), None
      except Exception as e:  # noqa: BLE001 - any failure to restore means: try the previous one
        restored, why = None, one_line(e)
      if not _agree(why is None):
        failed.append((step, why or "failed on another process"))
        continue
      self._set_aside(failed, step)
      return step, restored
    if failed:
      reasons = "; ".join(f"step {s}: {why}" for s, why in failed)
      raise TrainError(
        f"no checkpoint in {self.directory} restores ({reasons}); move the "
        "folder aside to start over"
      )
    return 0, state

  def _check_process_count(self) -> None:
    """Refuses, before anything is written, a checkpoint saved by another number of processes
    (each process's data-iterator state is its own): it is good, on that many processes."""
    step = self.latest_step()
    if step is None:
      return
    try:
      sums = self.manager.restore(step, args=ocp.args.Composite(checksums=ocp.args.JsonRestore()))
      saved = len(sums.checksums["data_sha256"])
    except Exception:  # noqa: BLE001 - unreadable: restore() reports it, step by step
      return
    if saved != jax.process_count():
      raise UsageError(
        f"checkpoint {step} in {self.directory} was saved by {saved} process(es), this run has "
        f"{jax.process_count()}; the checkpoint is good: resume it on {saved} process(es), or "
        "give another --workdir to start a new run (resuming on another count is not supported)"
      )

  def _set_aside(self, failed: list[tuple[int, str]], step: int) -> None:
    aside = self.workdir / "unrestorable"
    for bad, why in failed:
      dest = aside / str(bad)
      n = 1
      while dest.exists():
        dest, n = aside / f"{bad}.{n}", n + 1
      if jax.process_index() == 0:
        aside.mkdir(exist_ok=True)
        (self.directory / str(bad)).rename(dest)
        print(
          f"warning: checkpoint {self.directory / str(bad)} does not restore ({why}); "
          f"moved it to {dest}, resuming from step {step}",
          file=sys.stderr,
          flush=True,
        )
    if failed:
      multihost_utils.sync_global_devices("checkpoints set aside")
      self.manager.reload()

  def close(self) -> None:
    self.manager.close()


def saved_steps(workdir: epath.Path) -> list[int]:
  """The steps of the checkpoints in WORKDIR/checkpoints, ascending (finished saves only)."""
  folder = workdir / "checkpoints"
  if not folder.is_dir():
    return []
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def lock(workdir: epath.Path):
  """Holds WORKDIR/trainer.lock until the process ends (local disks; the chief process
  only); a second trainer on the same workdir is refused. Returns the open file."""
  if "://" in os.fspath(workdir) or jax.process_index() != 0:
    return None
  f = open(workdir / "trainer.lock", "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    holder = f.read().strip() or "unknown process"
    f.close()
    raise UsageError(
      f"{workdir} is in use by another trainer ({holder}); wait for it to "
      "finish or choose another --workdir"
    ) from None
  f.seek(0)
  f.truncate()
  f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
  f.flush()
  return f
