"""Extra record features in the batch: `features={"id": "image/id", "box": Feature(...)}`.

Each entry names a batch key and the `tf.train.Example` feature it comes from. int64 and
float features become numeric arrays (jax-ready); bytes features become numpy object arrays
of Python `bytes`, exactly as stored (trailing NUL bytes included: numpy's fixed-width "S"
dtype would strip them), which `device_prefetch` keeps on the host. A feature is
fixed-shape, or variable-length up to `max_length` items: then zero-padded, with the item
count in "<name>_length" (int32), as tf.io.VarLenFeature + to_dense would give.

The loader calls `parse_specs` once, then per batch `allocate` and per record `fill`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.catalog.records import RecordError, example_class

if TYPE_CHECKING:
  from tensorflow_datasets.proto import tf_example_pb2

BYTES = "bytes"
RESERVED = ("image", "label", "mask")
_LISTS = {
  "i": "int64_list",
  "u": "int64_list",
  "b": "int64_list",
  "f": "float_list",
  "S": "bytes_list",
  "O": "bytes_list",
}
_DEFAULT_DTYPES = {"int64_list": "int32", "float_list": "float32", "bytes_list": BYTES}


@dataclasses.dataclass(frozen=True)
class Feature:
  """One extra feature: record `key` -> a batch entry of `dtype` and per-example `shape`.

  dtype: a numpy integer, bool or float dtype name, or "bytes"; None takes the record's own
    type (int64 -> int32, float -> float32, bytes) and value count, from a sample record.
  shape: the shape of one item (() a scalar). max_length: variable-length, up to this many
    items ([max_length, *shape], zero-padded, count in "<name>_length"); a record without
    the key has none. max_bytes: the longest bytes value allowed (longer is an error,
    never cut); bytes arrive exactly as stored, in an object array (b"" when padded).
    default: a fixed-shape feature's value when a record lacks the key (None: the record is
    an error).
  """

  key: str
  dtype: str | None = None
  shape: tuple[int, ...] = ()
  max_length: int | None = None
  max_bytes: int = 128
  default: Any = None

  @property
  def numpy_dtype(self) -> np.dtype:
    return np.dtype(object) if self.dtype == BYTES else np.dtype(self.dtype)

  @property
  def item_size(self) -> int:
    return math.prod(self.shape)

  @property
  def example_shape(self) -> tuple[int, ...]:
    return self.shape if self.max_length is None else (self.max_length, *self.shape)


def length_key(name: str) -> str:
  return f"{name}_length"


def parse_specs(mapping: Mapping | None, sample: bytes | None = None) -> dict[str, Feature]:
  """Batch key -> `Feature` from a mapping whose values are record keys, `Feature`s or dicts
  of Feature fields (configs). `sample` (a record of the split) resolves dtype=None."""
  if mapping is None:
    return {}
  if not isinstance(mapping, Mapping) and not hasattr(mapping, "to_dict"):
    raise ValueError(
      f"features must map batch keys to record keys or Features, got {type(mapping).__name__}"
    )
  mapping = dict(mapping.to_dict() if hasattr(mapping, "to_dict") else mapping)
  specs = {name: _spec(name, value, sample) for name, value in mapping.items()}
  taken = set(RESERVED)
  for name, spec in specs.items():
    keys = [name] + ([length_key(name)] if spec.max_length is not None else [])
    for key in keys:
      if key in taken:
        raise ValueError(
          f"feature {name!r}: batch key {key!r} is already taken "
          f"(reserved: {list(RESERVED)}); choose another name"
        )
      taken.add(key)
  return specs


def _spec(name, value, sample: bytes | None) -> Feature:
  if not isinstance(name, str) or not name:
    raise ValueError(f"feature names are non-empty strings, got {name!r}")
  if isinstance(value, str):
    spec = Feature(value)
  elif isinstance(value, Feature):
    spec = value
  elif isinstance(value, Mapping) or hasattr(value, "to_dict"):
    fields = dict(value.to_dict() if hasattr(value, "to_dict") else value)
    known = {f.name for f in dataclasses.fields(Feature)}
    if set(fields) - known:
      raise ValueError(
        f"feature {name!r}: unknown field(s) {sorted(set(fields) - known)}; known: {sorted(known)}"
      )
    if "shape" in fields:
      fields["shape"] = tuple(fields["shape"])
    spec = Feature(**fields)
  else:
    raise ValueError(
      f"feature {name!r}: expected a record key, a pipeline.Feature or a dict "
      f"of its fields, got {type(value).__name__}"
    )
  if spec.dtype is None:
    spec = _resolve(name, spec, sample)
  _check(name, spec)
  return spec


def _resolve(name: str, spec: Feature, sample: bytes | None) -> Feature:
  """Takes dtype (and, for a scalar-shaped fixed spec, the value count) from `sample`."""
  if sample is None:
    raise ValueError(
      f"feature {name!r}: give its dtype, e.g. pipeline.Feature("
      f"{spec.key!r}, dtype='int32'), or a sample record to read it from"
    )
  feature = _feature_map(sample)
  kind = feature[spec.key].WhichOneof("kind") if spec.key in feature else None
  count = len(getattr(feature[spec.key], kind).value) if kind else 0
  if not count:
    raise ValueError(
      f"feature {name!r}: key {spec.key!r} has no values in the sample record "
      f"(it has {sorted(feature)}); give its dtype"
    )
  shape = spec.shape
  if spec.max_length is None and shape == () and count != 1:
    shape = (count,)
  return dataclasses.replace(spec, dtype=_DEFAULT_DTYPES[kind], shape=shape)


def _check(name: str, spec: Feature) -> None:
  where = f"feature {name!r} ({spec.key!r})"
  if not isinstance(spec.key, str) or not spec.key:
    raise ValueError(f"feature {name!r}: key must be a non-empty string, got {spec.key!r}")
  try:
    dtype = spec.numpy_dtype
  except TypeError:
    raise ValueError(f"{where}: unknown dtype {spec.dtype!r}") from None
  if spec.dtype != BYTES and (dtype.kind not in "iubf" or dtype.hasobject):
    raise ValueError(
      f"{where}: dtype must be an integer, bool or float dtype or 'bytes', got {spec.dtype!r}"
    )
  if not all(isinstance(d, int) and d > 0 for d in spec.shape):
    raise ValueError(f"{where}: shape must be a tuple of positive ints, got {spec.shape!r}")
  if spec.max_length is not None and not (isinstance(spec.max_length, int) and spec.max_length > 0):
    raise ValueError(f"{where}: max_length must be a positive int, got {spec.max_length!r}")
  if not isinstance(spec.max_bytes, int) or spec.max_bytes < 1:
    raise ValueError(f"{where}: max_bytes must be a positive int, got {spec.max_bytes!r}")
  if spec.default is not None:
    if spec.max_length is not None:
      raise ValueError(
        f"{where}: a variable-length feature has no default (a record without it has zero items)"
      )
    try:
      _convert(spec, [spec.default] * spec.item_size)
    except RecordError as e:
      raise ValueError(f"{where}: default {spec.default!r} does not fit: {e}") from None


def allocate(specs: Mapping[str, Feature], n: int) -> dict[str, np.ndarray]:
  """Zeroed batch arrays for `n` examples (plus "<name>_length" for variable-length ones);
  bytes features hold b"" until filled."""
  arrays = {}
  for name, spec in specs.items():
    arrays[name] = np.zeros((n, *spec.example_shape), spec.numpy_dtype)
    if spec.dtype == BYTES:
      arrays[name].fill(b"")
    if spec.max_length is not None:
      arrays[length_key(name)] = np.zeros((n,), np.int32)
  return arrays


def fill(
  specs: Mapping[str, Feature],
  record: bytes | tf_example_pb2.Example,
  arrays: Mapping[str, np.ndarray],
  slot: int,
) -> None:
  """Writes one record's features into row `slot` of `arrays` (from `allocate`).

  `record` is serialized or an already parsed Example (parse once, fill and read the image).
  Raises `RecordError` naming the key of a missing, mistyped or oversized feature.
  """
  feature = record.features.feature if isinstance(record, example_class()) else _feature_map(record)
  for name, spec in specs.items():
    values = _values(spec, feature)
    if spec.max_length is None:
      if values is None:
        if spec.default is None:
          raise RecordError(
            f"missing feature {spec.key!r} (batch key {name!r}; has: {sorted(feature)})"
          )
        values = [spec.default] * spec.item_size
      if len(values) != spec.item_size:
        raise RecordError(
          f"feature {spec.key!r} has {len(values)} values, expected "
          f"{spec.item_size} (shape {spec.shape}); for a variable count "
          "give max_length="
        )
      converted = _convert(spec, values)
      # [0]: an object array would store a 0-d array as the element itself.
      arrays[name][slot] = converted[0] if spec.shape == () else converted.reshape(spec.shape)
      continue
    values = values or []
    items, extra = divmod(len(values), spec.item_size)
    if extra:
      raise RecordError(
        f"feature {spec.key!r} has {len(values)} values, not a multiple of "
        f"its item shape {spec.shape}"
      )
    if items > spec.max_length:
      raise RecordError(
        f"feature {spec.key!r} has {items} items, more than its max_length {spec.max_length}"
      )
    row = arrays[name][slot]
    row[:items] = _convert(spec, values).reshape((items, *spec.shape))
    row[items:] = b"" if spec.dtype == BYTES else 0
    arrays[length_key(name)][slot] = items


def _feature_map(record: bytes):
  try:
    return example_class().FromString(record).features.feature
  except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
    raise RecordError(f"not a tf.train.Example ({type(e).__name__}: {e})") from None


def _values(spec: Feature, feature) -> list | None:
  """The record's values for `spec`, or None when it lacks the key or holds an empty list
  (of any type: writers cannot always tell an empty list's type)."""
  if spec.key not in feature:
    return None
  kind = feature[spec.key].WhichOneof("kind")
  if kind is None or not getattr(feature[spec.key], kind).value:
    return None
  expected = _LISTS[spec.numpy_dtype.kind]
  if kind != expected:
    raise RecordError(
      f"feature {spec.key!r} is a {kind}, expected a {expected} for dtype {spec.dtype}"
    )
  return list(getattr(feature[spec.key], kind).value)


def _convert(spec: Feature, values: list) -> np.ndarray:
  """`values` as the spec's dtype; integers out of the dtype's range and bytes longer than
  max_bytes are errors, never silently wrapped or cut."""
  dtype = spec.numpy_dtype
  if spec.dtype == BYTES:
    if any(not isinstance(v, bytes) for v in values):
      raise RecordError(f"feature {spec.key!r}: bytes values expected")
    longest = max((len(v) for v in values), default=0)
    if longest > spec.max_bytes:
      raise RecordError(
        f"feature {spec.key!r} holds a value of {longest} bytes, more than "
        f"its max_bytes {spec.max_bytes}"
      )
    array = np.empty(len(values), object)  # exact bytes: "S" arrays drop trailing NULs
    array[:] = values
    return array
  if dtype.kind in "iub":
    array = np.array(values, np.int64)
    if dtype.kind == "b":
      if array.size and not np.isin(array, (0, 1)).all():
        raise RecordError(f"feature {spec.key!r}: bool values must be 0 or 1")
    elif array.size:
      info = np.iinfo(dtype)
      if array.min() < info.min or array.max() > info.max:
        raise RecordError(
          f"feature {spec.key!r} value {int(array.min())}..{int(array.max())}"
          f" does not fit {spec.dtype}; give a wider dtype"
        )
    return array.astype(dtype)
  try:
    return np.array(values, np.float64).astype(dtype)
  except (TypeError, ValueError):
    raise RecordError(f"feature {spec.key!r}: numeric values expected") from None
