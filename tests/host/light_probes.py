"""Ops and converter tasks that report, from the worker process running them, whether JAX is
there (tests/host/test_light.py); a module of its own, so a worker imports nothing else."""

import os
import sys

import numpy as np


def jaxlib_mapped() -> bool:
  with open("/proc/self/maps") as f:
    return "jaxlib" in f.read()


def jax_op(batch: dict, rng) -> dict:
  """A batch op that needs JAX."""
  import jax  # noqa: F401

  batch["jax_imported"] = np.full(len(batch["label"]), "jax" in sys.modules)
  return batch


def probe_task(task: int) -> tuple[int, bool, bool]:
  """A converter worker's task: its pid, whether JAX is imported, whether jaxlib is mapped."""
  return os.getpid(), "jax" in sys.modules, jaxlib_mapped()
