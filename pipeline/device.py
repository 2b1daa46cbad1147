"""Device feeding: lay host batches out across the devices ahead of the train step.

The "Load" of ETL. Each process hands in its share of the global batch as numpy arrays;
`device_prefetch` turns them into `jax.Array`s, `depth` batches ahead on a background
thread, inside the checkpointed iterator chain. Two layouts: "global" (the batch dimension
sharded over a mesh axis, for jit) and "pmap" (a leading axis of devices, for jax.pmap).
"""

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import grain
import jax
import jax.numpy as jnp
import numpy as np

from pipeline.host import lifecycle

MASK_KEY = "mask"
IMAGE_KEY = "image"
PMAP_AXIS = "devices"
# Mean and standard deviation per RGB channel, in pixel units (0..255).
NORMALIZATIONS = {
  "minus_one_one": ((127.5,) * 3, (127.5,) * 3),
  "zero_one": ((0.0,) * 3, (255.0,) * 3),
  "imagenet": ((0.485 * 255, 0.456 * 255, 0.406 * 255), (0.229 * 255, 0.224 * 255, 0.225 * 255)),
}
Normalize = bool | str | tuple | None


def normalization(normalize: Normalize) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
  """(mean, std) per channel in pixel units for a preset name, True ("minus_one_one") or a
  (mean, std) pair of numbers or per-channel sequences; None for False/None."""
  if normalize is None or normalize is False:
    return None
  if normalize is True:
    normalize = "minus_one_one"
  if isinstance(normalize, str):
    if normalize not in NORMALIZATIONS:
      raise ValueError(
        f"normalize must be one of {sorted(NORMALIZATIONS)} or (mean, std), got {normalize!r}"
      )
    return NORMALIZATIONS[normalize]
  if not isinstance(normalize, Sequence) or len(normalize) != 2:
    raise ValueError(f"normalize must be a preset name or a (mean, std) pair, got {normalize!r}")
  mean, std = (tuple(float(v) for v in np.atleast_1d(x)) for x in normalize)
  if min(std) <= 0:
    raise ValueError(f"normalize std must be > 0, got {std}")
  if max(mean + std) <= 1:
    raise ValueError(
      f"normalize (mean, std) are in pixel units (0..255), got {mean}, {std}: "
      "multiply values given for [0, 1] images by 255"
    )
  return mean, std


def normalize_images(
  x: jax.Array, dtype: Any = jnp.float32, normalize: Normalize = "minus_one_one"
) -> jax.Array:
  """(pixels - mean) / std in `dtype` on the device; default maps uint8 [0, 255] to [-1, 1].

  Jitted and elementwise, so the output keeps the input's sharding; the host moves uint8.
  `normalize` as `device_prefetch`'s; False only casts. Images that are already floats (an
  image op scaled them, e.g. a ported `value_range(-1, 1)`) are refused: normalizing them
  again would be silently wrong, and whether they hold pixels or scaled values is unknown.
  """
  if normalization(normalize) is not None and jnp.dtype(x.dtype).kind not in "iub":
    raise ValueError(
      f"normalize={normalize!r} maps pixel values (0..255) but the {IMAGE_KEY!r} entry is "
      f"already {jnp.dtype(x.dtype).name} (did an image op scale it?): drop normalize= "
      "(dtype= alone casts) or let the op return uint8 pixels"
    )
  return _normalize(x, jnp.dtype(dtype), _hashable(normalize))


@functools.partial(jax.jit, static_argnames=("dtype", "normalize"))
def _normalize(x: jax.Array, dtype: Any, normalize: Normalize) -> jax.Array:
  stats = normalization(normalize)
  if stats is None:
    return x.astype(dtype)
  mean, std = (np.asarray(s[:1] if len(set(s)) == 1 else s, np.float32) for s in stats)
  for s in (mean, std):
    if s.size > 1 and x.shape[-1] != s.size:
      raise ValueError(
        f"normalize has {s.size} per-channel values, images have "
        f"{x.shape[-1]} channels (shape {x.shape})"
      )
  return ((x.astype(jnp.float32) - mean) * (1 / std)).astype(dtype)


def device_prefetch(
  dataset: grain.IterDataset,
  mesh: jax.sharding.Mesh | None = None,
  *,
  data_axis: str = "data",
  depth: int = 2,
  remainder: Literal["pad", "drop"] = "pad",
  normalize: Normalize = False,
  dtype: Any = None,
  batch_size: int | None = None,
  layout: Literal["global", "pmap"] = "global",
) -> grain.IterDataset:
  """Returns `dataset` with its batches as `jax.Array`s laid out over the devices.

  Elements of `dataset` are dicts of numpy arrays holding this process's rows of the
  global batch (global batch = per-process batch * processes whose devices split the
  data axis). `layout="global"`: arrays of the global batch with `PartitionSpec(data_axis)`
  on dim 0 of `mesh` (default: every device on one "data" axis), replicated over its other
  axes; an Explicit-axis mesh gives explicitly sharded arrays (fine under jit; for pmap use
  the "pmap" layout). `layout="pmap"`: arrays shaped [devices, rows per device, ...] over
  `jax.devices()`, as `jax.pmap` takes them (no mesh). Entries jax cannot hold (bytes,
  strings, objects: e.g. a bytes feature) stay numpy arrays of this process's rows.

  A background thread keeps `depth` batches on the devices (0: transfer on the calling
  thread); the iterator's state is that of the last batch returned, so `set_state`
  resumes at the next unseen batch. A batch with fewer rows than the full per-process
  batch (`batch_size`, by default the first batch's) is zero-padded with a `MASK_KEY`
  entry (1 real, 0 padding; added to every batch, or extended if present) when
  `remainder="pad"`, dropped when `"drop"`. "drop" needs every process to see the same
  partial batches (equal slices); "pad" never leaves one process waiting for another.

  `normalize` (a preset of `NORMALIZATIONS`, True for "minus_one_one", or (mean, std) in
  pixel units) maps `IMAGE_KEY` to `dtype` (default float32) on the device; `dtype` alone
  casts it.
  """
  if remainder not in ("pad", "drop"):
    raise ValueError(f"remainder must be 'pad' or 'drop', got {remainder!r}.")
  if depth < 0:
    raise ValueError(f"depth must be >= 0, got {depth}.")
  normalization(normalize)
  dtype = jnp.dtype(dtype) if dtype is not None else None
  put = DevicePutIterDataset(
    dataset,
    make_layout(mesh, data_axis, layout),
    remainder=remainder,
    normalize=normalize,
    dtype=dtype,
    batch_size=batch_size,
  )
  return lifecycle.ClosedAtExit(
    grain.experimental.ThreadPrefetchIterDataset(put, prefetch_buffer_size=depth)
  )


def make_layout(
  mesh: jax.sharding.Mesh | None, data_axis: str = "data", layout: str = "global"
) -> "_Layout | _PmapLayout":
  """Where this process's rows go, for `device_prefetch`'s `mesh`, `data_axis`, `layout`."""
  if layout == "pmap":
    if mesh is not None:
      raise ValueError(
        "layout='pmap' lays batches over jax.devices() as jax.pmap does and "
        "takes no mesh; pass mesh=None (or layout='global' for jit on a mesh)."
      )
    return _PmapLayout()
  if layout != "global":
    raise ValueError(f"layout must be 'global' or 'pmap', got {layout!r}.")
  if mesh is None:
    mesh = jax.make_mesh(
      (jax.device_count(),), (data_axis,), axis_types=(jax.sharding.AxisType.Auto,)
    )
  if data_axis not in mesh.axis_names:
    raise ValueError(
      f"Mesh axes {mesh.axis_names} have no data axis {data_axis!r}; pass data_axis= one of them."
    )
  return _Layout(mesh, data_axis)


class DevicePutIterDataset(grain.IterDataset):
  """Pads or drops partial batches and transfers each one to the devices (synchronously)."""

  def __init__(
    self,
    parent: grain.IterDataset,
    layout: "_Layout | _PmapLayout",
    *,
    remainder: str,
    normalize: Normalize,
    dtype: Any,
    batch_size: int | None,
  ):
    super().__init__(parent)
    self._layout = layout
    self._remainder = remainder
    self._image = (normalize, dtype)
    self._batch_size = batch_size
    if batch_size is not None:
      self._layout.check(batch_size)

  def __str__(self) -> str:
    return f"DevicePutIterDataset(remainder={self._remainder}, image={self._image})"

  def __iter__(self) -> grain.DatasetIterator:
    return _DevicePutIterator(
      self._parent.__iter__(), self._layout, self._remainder, self._image, self._batch_size
    )


class _Layout:
  """The global layout: the batch dimension sharded over the mesh's data axis."""

  def __init__(self, mesh: jax.sharding.Mesh, data_axis: str):
    axis = mesh.axis_names.index(data_axis)
    here = jax.process_index()
    rows = sorted({i[axis] for i, d in np.ndenumerate(mesh.devices) if d.process_index == here})
    if not rows:
      raise ValueError(f"Process {here} owns no device of the mesh {dict(mesh.shape)}.")
    self.sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(data_axis))
    self.data_axis = data_axis
    self.data_size = mesh.shape[data_axis]
    self.local_shards = len(rows)
    self._rows = rows

  @property
  def shard(self) -> tuple[int, int]:
    """(shard_index, shard_count): this process's slice of the data, the processes that
    feed distinct rows (processes whose devices hold the same rows read the same data)."""
    first = self._rows[0]
    if self._rows != list(range(first, first + self.local_shards)) or first % self.local_shards:
      raise ValueError(
        f"Process {jax.process_index()} holds rows {self._rows} of the data "
        f"axis {self.data_axis!r}: not one aligned block; pass shard_index and "
        "shard_count yourself."
      )
    return first // self.local_shards, self.data_size // self.local_shards

  def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (local_shape[0] * self.data_size // self.local_shards,) + local_shape[1:]

  def local(self, x: np.ndarray) -> np.ndarray:
    return x

  def check(self, local_rows: int) -> None:
    """Raises if the per-process batch cannot be split evenly over the data axis."""
    if local_rows % self.local_shards:
      processes = self.data_size // self.local_shards
      raise ValueError(
        f"Per-process batch of {local_rows} rows does not divide over the "
        f"{self.local_shards} data shards on this process's devices (mesh axis "
        f"{self.data_axis!r} of size {self.data_size} over {processes} process(es)): "
        f"make the global batch ({local_rows * processes}) a multiple of "
        f"{self.data_size}, i.e. the per-process batch a multiple of {self.local_shards}."
      )


class _PmapLayout:
  """The pmap layout: [devices, rows per device, ...] over jax.devices(), pmap's order."""

  def __init__(self):
    devices = jax.devices()
    here = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if here != list(range(here[0], here[0] + len(here))):
      raise ValueError(
        "This process's devices are not one block of jax.devices(); the "
        "pmap layout needs them to be."
      )
    mesh = jax.sharding.Mesh(
      np.array(devices), (PMAP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,)
    )
    self.sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(PMAP_AXIS))
    self.local_shards = len(here)
    self.data_size = len(devices)
    self.shard = (jax.process_index(), jax.process_count())

  def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (self.data_size,) + local_shape[1:]

  def local(self, x: np.ndarray) -> np.ndarray:
    return x.reshape((self.local_shards, -1) + x.shape[1:])

  def check(self, local_rows: int) -> None:
    if local_rows % self.local_shards:
      raise ValueError(
        f"Per-process batch of {local_rows} rows does not divide over this process's "
        f"{self.local_shards} devices (layout 'pmap'): make it a multiple of "
        f"{self.local_shards}, the global batch a multiple of {self.data_size}."
      )


class _DevicePutIterator(grain.DatasetIterator):
  """Iterator of `DevicePutIterDataset`; its state is its parent's."""

  def __init__(
    self,
    parent: grain.DatasetIterator,
    layout: "_Layout | _PmapLayout",
    remainder: str,
    image: tuple[Normalize, Any],
    batch_size: int | None,
  ):
    super().__init__(parent)
    self._layout = layout
    self._remainder = remainder
    self._normalize, self._dtype = image
    self._full = batch_size

  def __next__(self) -> dict[str, jax.Array | np.ndarray]:
    while True:
      batch = _as_arrays(next(self._parent))
      rows = _leading_dim(batch)
      if self._full is None:
        self._layout.check(rows)
        self._full = rows
      if rows > self._full:
        raise ValueError(
          f"Got a batch of {rows} rows after batches of {self._full}; pass "
          "batch_size= the full per-process batch to device_prefetch."
        )
      if rows == self._full or self._remainder == "pad":
        break
    if self._remainder == "pad":
      batch = _pad(batch, self._full)
    batch = {k: self._layout.local(v) for k, v in batch.items()}
    host = {k: v for k, v in batch.items() if not _on_device(v)}
    device = {k: v for k, v in batch.items() if _on_device(v)}
    shapes = {k: self._layout.global_shape(v.shape) for k, v in device.items()}
    out = jax.make_array_from_process_local_data(self._layout.sharding, device, shapes)
    if self._normalize or self._dtype is not None:
      if IMAGE_KEY not in out:
        raise KeyError(f"normalize/dtype need an {IMAGE_KEY!r} key; got {sorted(out)}.")
      dtype = jnp.float32 if self._dtype is None else self._dtype
      out[IMAGE_KEY] = normalize_images(out[IMAGE_KEY], dtype, self._normalize)
    return {**out, **host}

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state)

  def __str__(self) -> str:
    return f"DevicePutDatasetIterator(remainder={self._remainder})"


def _hashable(normalize: Normalize) -> Normalize:
  """A static jit argument: lists become tuples."""
  if isinstance(normalize, (str, bool)) or normalize is None:
    return normalize
  return tuple(tuple(np.atleast_1d(x).tolist()) for x in normalize)


def _on_device(x: np.ndarray) -> bool:
  """Numbers and booleans go to the devices; bytes, strings and objects stay on the host."""
  return x.dtype.kind in "biufc"


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
  """Zero-pads every entry to `full` rows (an integer "label": -1, as make_dataset's padding) and
  marks the real rows in `MASK_KEY`."""
  rows = _leading_dim(batch)
  batch = dict(batch)
  mask = batch.get(MASK_KEY, np.ones(rows, bool))
  batch[MASK_KEY] = mask
  if rows == full:
    return batch
  padded = {}
  for k, v in batch.items():
    p = np.zeros((full,) + v.shape[1:], v.dtype)
    if v.dtype.hasobject:
      p.fill(b"")  # bytes features: padding rows hold empty values, not 0
    if k == "label" and v.dtype.kind == "i":
      p.fill(-1)
    p[:rows] = v
    padded[k] = p
  return padded
