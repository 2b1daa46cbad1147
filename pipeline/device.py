"""Device feeding: lay host batches out across a device mesh ahead of the train step.

The "Load" of ETL. Each process hands in its share of the global batch as numpy arrays;
`device_prefetch` turns them into global `jax.Array`s sharded on the batch dimension,
`depth` batches ahead on a background thread, inside the checkpointed iterator chain.
"""

import functools
from collections.abc import Mapping
from typing import Any, Literal

import grain
import jax
import jax.numpy as jnp
import numpy as np

from pipeline import lifecycle

MASK_KEY = "mask"
IMAGE_KEY = "image"


@functools.partial(jax.jit, static_argnames="dtype")
def normalize_images(x: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
  """Maps uint8 pixels [0, 255] to `dtype` in [-1, 1] on the device.

  Jitted and elementwise, so the output keeps the input's sharding; the host moves uint8.
  """
  return (x.astype(jnp.float32) * (2.0 / 255.0) - 1.0).astype(dtype)


def device_prefetch(
    dataset: grain.IterDataset,
    mesh: jax.sharding.Mesh,
    *,
    data_axis: str = "data",
    depth: int = 2,
    remainder: Literal["pad", "drop"] = "pad",
    normalize: bool = False,
    batch_size: int | None = None,
) -> grain.IterDataset:
  """Returns `dataset` with its batches as global arrays sharded over `mesh`.

  Elements of `dataset` are dicts of numpy arrays holding this process's rows of the
  global batch (global batch = per-process batch * processes whose devices split the
  data axis). Outputs are dicts of `jax.Array`s with `PartitionSpec(data_axis)` on
  dim 0, replicated over the other mesh axes. A background thread keeps `depth`
  batches on the devices (0: transfer on the calling thread); the iterator's state is
  that of the last batch returned, so `set_state` resumes at the next unseen batch.

  A batch with fewer rows than the full per-process batch (`batch_size`, by default
  the first batch's) is zero-padded with a `MASK_KEY` entry (1 real, 0 padding; added
  to every batch, or extended if present) when `remainder="pad"`, dropped when
  `"drop"`. "drop" needs every process to see the same partial batches (equal
  slices); "pad" never leaves one process waiting for another. With `normalize`,
  `IMAGE_KEY` becomes float32 in [-1, 1] on the device (see `normalize_images`).
  """
  if data_axis not in mesh.axis_names:
    raise ValueError(f"Mesh axes {mesh.axis_names} have no data axis {data_axis!r}; "
                     "pass data_axis= one of them.")
  if remainder not in ("pad", "drop"):
    raise ValueError(f"remainder must be 'pad' or 'drop', got {remainder!r}.")
  if depth < 0:
    raise ValueError(f"depth must be >= 0, got {depth}.")
  put = DevicePutIterDataset(dataset, mesh, data_axis=data_axis, remainder=remainder,
                             normalize=normalize, batch_size=batch_size)
  return lifecycle.ClosedAtExit(
      grain.experimental.ThreadPrefetchIterDataset(put, prefetch_buffer_size=depth))


class DevicePutIterDataset(grain.IterDataset):
  """Pads or drops partial batches and transfers each one to the mesh (synchronously)."""

  def __init__(self, parent: grain.IterDataset, mesh: jax.sharding.Mesh, *,
               data_axis: str, remainder: str, normalize: bool, batch_size: int | None):
    super().__init__(parent)
    self._layout = _Layout(mesh, data_axis)
    self._remainder = remainder
    self._normalize = normalize
    self._batch_size = batch_size
    if batch_size is not None:
      self._layout.check(batch_size)

  def __str__(self) -> str:
    return f"DevicePutIterDataset(remainder={self._remainder}, normalize={self._normalize})"

  def __iter__(self) -> grain.DatasetIterator:
    return _DevicePutIterator(self._parent.__iter__(), self._layout, self._remainder,
                              self._normalize, self._batch_size)


class _Layout:
  """Where this process's rows go: the sharding and the global batch they belong to."""

  def __init__(self, mesh: jax.sharding.Mesh, data_axis: str):
    axis = mesh.axis_names.index(data_axis)
    here = jax.process_index()
    rows = {i[axis] for i, d in np.ndenumerate(mesh.devices) if d.process_index == here}
    if not rows:
      raise ValueError(f"Process {here} owns no device of the mesh {dict(mesh.shape)}.")
    self.sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(data_axis))
    self.data_axis = data_axis
    self.data_size = mesh.shape[data_axis]
    self.local_shards = len(rows)

  def global_rows(self, local_rows: int) -> int:
    return local_rows * self.data_size // self.local_shards

  def check(self, local_rows: int) -> None:
    """Raises if the per-process batch cannot be split evenly over the data axis."""
    if local_rows % self.local_shards:
      processes = self.data_size // self.local_shards
      raise ValueError(
          f"Per-process batch of {local_rows} rows does not divide over the "
          f"{self.local_shards} data shards on this process's devices (mesh axis "
          f"{self.data_axis!r} of size {self.data_size} over {processes} process(es)): "
          f"make the global batch ({local_rows * processes}) a multiple of "
          f"{self.data_size}, i.e. the per-process batch a multiple of {self.local_shards}.")


class _DevicePutIterator(grain.DatasetIterator):
  """Iterator of `DevicePutIterDataset`; its state is its parent's."""

  def __init__(self, parent: grain.DatasetIterator, layout: _Layout, remainder: str,
               normalize: bool, batch_size: int | None):
    super().__init__(parent)
    self._layout = layout
    self._remainder = remainder
    self._normalize = normalize
    self._full = batch_size

  def __next__(self) -> dict[str, jax.Array]:
    while True:
      batch = _as_arrays(next(self._parent))
      rows = _leading_dim(batch)
      if self._full is None:
        self._layout.check(rows)
        self._full = rows
      if rows > self._full:
        raise ValueError(f"Got a batch of {rows} rows after batches of {self._full}; pass "
                         "batch_size= the full per-process batch to device_prefetch.")
      if rows == self._full or self._remainder == "pad":
        break
    if self._remainder == "pad":
      batch = _pad(batch, self._full)
    shapes = {k: (self._layout.global_rows(self._full),) + v.shape[1:]
              for k, v in batch.items()}
    out = jax.make_array_from_process_local_data(self._layout.sharding, batch, shapes)
    if self._normalize:
      if IMAGE_KEY not in out:
        raise KeyError(f"normalize=True needs an {IMAGE_KEY!r} key; got {sorted(out)}.")
      out[IMAGE_KEY] = normalize_images(out[IMAGE_KEY])
    return out

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state)

  def __str__(self) -> str:
    return f"DevicePutDatasetIterator(remainder={self._remainder})"


def _as_arrays(batch: Any) -> dict[str, np.ndarray]:
  if not isinstance(batch, Mapping):
    raise TypeError(f"device_prefetch expects dict batches, got {type(batch).__name__}.")
  return {k: np.asarray(v) for k, v in batch.items()}


def _leading_dim(batch: dict[str, np.ndarray]) -> int:
  sizes = {k: v.shape[0] if v.ndim else None for k, v in batch.items()}
  if len(set(sizes.values())) != 1 or None in sizes.values():
    raise ValueError(f"Batch entries disagree on the batch dimension: {sizes}.")
  return next(iter(sizes.values()))


def _pad(batch: dict[str, np.ndarray], full: int) -> dict[str, np.ndarray]:
  """Zero-pads every entry to `full` rows and marks the real rows in `MASK_KEY`."""
  rows = _leading_dim(batch)
  batch = dict(batch)
  mask = batch.get(MASK_KEY, np.ones(rows, bool))
  batch[MASK_KEY] = mask
  if rows == full:
    return batch
  padded = {}
  for k, v in batch.items():
    p = np.zeros((full,) + v.shape[1:], v.dtype)
    p[:rows] = v
    padded[k] = p
  return padded
