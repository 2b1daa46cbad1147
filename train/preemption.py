"""Preemption and Ctrl-C: the loop stops after a step, saves a checkpoint and exits
128 + the signal, on every process at the same step (`Stop`)."""

from __future__ import annotations

import os
import signal

import jax
from jax.experimental import multihost_utils


class Stop:
  """SIGTERM (TPU VM preemption) and SIGINT (Ctrl-C) stop the loop after a step: it saves a
  checkpoint and exits 128 + the signal (143, 130). With several processes, JAX's preemption
  service takes SIGTERM on any of them and picks the step they all save at (Ctrl-C becomes
  such a notice). A second Ctrl-C quits at once, without saving."""

  def __init__(self):
    self.signum = None
    self.multi = jax.process_count() > 1
    signals = (signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT)
    self._previous = {s: signal.signal(s, self._handle) for s in signals}

  def _handle(self, signum, frame):
    del frame
    if self.signum == signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = signum
    if self.multi:  # to JAX's preemption notifier, which tells the other processes
      os.kill(os.getpid(), signal.SIGTERM)

  def after(self, step: int) -> bool:
    """Whether to save and stop after `step`: the same step on every process."""
    if not self.multi:
      return self.signum is not None
    if not multihost_utils.reached_preemption_sync_point(step):
      return False
    self.signum = self.signum or signal.SIGTERM
    return True

  def say(self, step: int) -> str:
    if not self.multi:
      name = signal.Signals(self.signum).name
      return f"{name}: saved checkpoint at step {step}; re-run the command to resume"
    return (
      f"preemption notice (SIGTERM or Ctrl-C on a process): saved checkpoint at step {step} "
      f"on all {jax.process_count()} processes; re-run the same command on every host to resume"
    )

  def restore(self) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
