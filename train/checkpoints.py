"""Checkpoints you can trust.

Each checkpoint holds the model and optimizer state, every process's data-iterator state,
and the sha256 of both (an Orbax JSON item). A checkpoint that fails to restore (a
truncated file) or does not match its checksums (flipped bytes) is moved aside and the
previous one is used. One saved on another process count resumes: the model resharded, the
data at the global position process 0 saved (`pipeline.order.elastic`). A good one whose data this
run cannot continue (another shard list, order or global batch) is refused in one line
naming the flags that would, and kept. One trainer per workdir (a lock file); a failed save
says why in one line.
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

from pipeline.stages.stream import StateError
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


UNFINISHED = ".orbax-checkpoint-tmp"  # in the name of a save Orbax has not finished


class Checkpoints:
  """An Orbax CheckpointManager over WORKDIR/checkpoints that checks what it restores."""

  def __init__(self, workdir: epath.Path, keep: int):
    self.workdir = workdir
    self.directory = workdir / "checkpoints"
    if self.directory.exists() and not self.directory.is_dir():  # else: train, then fail to save
      raise UsageError(f"{self.directory} is not a folder: move it aside to keep checkpoints")
    self.saved_on = jax.process_count()  # processes that saved the restored checkpoint
    unfinished = sorted(p.name for p in self.directory.glob(f"*{UNFINISHED}*"))
    if unfinished and jax.process_index() == 0:
      print(
        f"warning: removing {', '.join(unfinished)} from {self.directory}: a save cut short "
        "(never restorable)",
        file=sys.stderr,
        flush=True,
      )
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, cleanup_tmp_directories=bool(unfinished)
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)

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
    sums = self.manager.restore(step, args=ocp.args.Composite(checksums=ocp.args.JsonRestore()))
    sums = sums.checksums
    if sums.get("step", step) != step:  # checkpoints saved before "step" was recorded lack it
      raise ValueError(f"it was saved as step {sums['step']}, not {step} (copied or renamed?)")
    self.saved_on = len(sums["data_sha256"])
    items = {"state": ocp.args.StandardRestore(abstract)}
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    if checksum(restored.state) != sums["state_sha256"]:
      raise ValueError("the model state does not match its checksum")
    self._restore_data(step, sums, data)
    return restored.state

  def _restore_data(self, step: int, sums: dict, data) -> None:
    """Sets `data` to the iterator state this process saved (process 0's, when saved on
    another process count: a global position every process continues from,
    `pipeline.order.elastic`), checked against its checksum; a good state this run cannot continue
    (another shard list, order or global batch) is a one-line refusal."""
    index = jax.process_index() if self.saved_on == jax.process_count() else 0
    name = f"process_{index}-of-{self.saved_on}.json"  # as grain's checkpoint handler names it
    text = (self.directory / str(step) / "data" / name).read_text()
    if hashlib.sha256(text.encode()).hexdigest() != sums["data_sha256"][index]:
      raise ValueError(f"the data-iterator state {name} does not match its checksum")
    try:
      data.set_state(json.loads(text))
    except StateError as e:
      raise UsageError(self._cannot_continue(step, e)) from e

  def _cannot_continue(self, step: int, error: StateError) -> str:
    """Why this run cannot continue checkpoint `step`'s data, with the flags that would."""
    hosts = jax.process_count()
    moved = f" was saved by {self.saved_on} process(es) and" if self.saved_on != hosts else ""
    on = f" on {hosts}" if moved else ""
    fix = error.fix  # the library's, in keywords: as flags
    if error.passes:
      fix = "pass " + " and ".join(f"--config.input.{k}={v}" for k, v in error.passes.items())
    if error.global_batch is not None:
      fix += f" (--config.batch_size={error.global_batch})"
    why = f"{error.what}: {fix}" if fix else error.what
    return (
      f"checkpoint {step} in {self.directory}{moved} is good, but this run{on} cannot "
      f"continue its data: {why}"
    )

  def restore(self, state, data) -> tuple[int, Any]:
    """(step, state) of the newest checkpoint that restores and matches its checksums, with
    `data` set to its iterator state; (0, state) when there is no checkpoint. A checkpoint
    saved on another process count continues at its global data position (`saved_on`).
    Newer ones that fail are moved to WORKDIR/unrestorable/ with a warning."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    failed = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        restored, why = self._restore(step, abstract, data), None
      except UsageError:  # the checkpoint is good; this run cannot continue it
        raise
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

  def resumed(self, step: int) -> str:
    """The line that says where a run resumed (and on how many hosts, when it changed)."""
    hosts = jax.process_count()
    on = f"{hosts} host" + ("s" if hosts > 1 else "")
    moved = f" on {on} (saved on {self.saved_on})" if self.saved_on != hosts else ""
    return f"resumed from step {step}{moved} ({self.directory})"

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


def already_done(workdir: epath.Path, num_steps: int) -> dict | None:
  """The summary of a run that finished at least `num_steps` steps, if any."""
  path = workdir / "summary.json"
  if not path.exists():
    return None
  try:
    summary = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UsageError(f"{path} is not a summary this trainer wrote ({e}): move it aside") from None
  if not isinstance(summary, dict) or not isinstance(summary.get("steps"), int):
    raise UsageError(f"{path} is not a summary this trainer wrote (no step count): move it aside")
  return summary if summary["steps"] >= num_steps else None


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
