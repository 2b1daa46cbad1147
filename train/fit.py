"""Will a run fit in memory? Checked before compiling, so a batch too large for the host
costs a second and one line, not a long compile and an out-of-memory error.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import pipeline
from train import UsageError


def _intermediate_bytes(jaxpr) -> int:
  """Bytes of every value a jaxpr computes, nested calls included."""
  total = 0
  for eqn in jaxpr.eqns:
    inner = [
      getattr(p, "jaxpr", p)
      for p in eqn.params.values()
      if hasattr(p, "jaxpr") or isinstance(p, jax.extend.core.Jaxpr)
    ]
    if inner:
      total += sum(_intermediate_bytes(j) for j in inner)
      continue
    total += sum(
      math.prod(v.aval.shape) * v.aval.dtype.itemsize
      for v in eqn.outvars
      if hasattr(v.aval, "shape")
    )
  return total


def activation_bytes_per_example(model: nnx.Module, image_size: int, dtype) -> int:
  """Rough memory a train step holds per example: half the bytes of all intermediates of a
  forward pass on one image (0.7-1.5x XLA's temporary buffers for MobileNets on CPU).
  `model` may be abstract (`nnx.eval_shape`); nothing is compiled."""
  graphdef, state = nnx.split(model)

  def forward(state, images):
    model = nnx.merge(graphdef, state)
    model.train()
    return model(pipeline.normalize_images(images, jnp.dtype(dtype)))

  one = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.uint8)
  return _intermediate_bytes(jax.jit(forward).trace(state, one).jaxpr.jaxpr) // 2


def available_bytes() -> tuple[int, str]:
  """Memory a step may use on one device and what it is: an accelerator's own, else the
  host's (which all local CPU devices share)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), "per device"
  with open("/proc/meminfo") as f:
    info = dict(line.split(":", 1) for line in f)
  return int(info["MemAvailable"].split()[0]) * 1024, "on this host"


def check(model: nnx.Module, image_size: int, dtype, local_batch: int, data_devices: int) -> None:
  """Refuses, in one line, a batch whose activations would not fit."""
  per_example = activation_bytes_per_example(model, image_size, dtype)
  free, where = available_bytes()
  shared = where == "on this host"
  examples = local_batch if shared else max(1, local_batch * jax.process_count() // data_devices)
  need = per_example * examples
  if need > free:
    fits = max(1, free // per_example)
    raise UsageError(
      f"config does not fit: {examples} examples of {image_size}x{image_size} "
      f"{'per process' if shared else 'per device'} need ~{need / 2**30:.0f} GiB of "
      f"activations ({per_example / 2**20:.0f} MiB each), {free / 2**30:.0f} GiB free "
      f"{where}; lower config.batch_size (about {fits}{' per device' if not shared else ''} "
      f"fit) or add devices"
    )
