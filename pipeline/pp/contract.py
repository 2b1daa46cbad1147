"""The op contract: what an image op and a batch op are, the generators they get, and how
the ops stage runs them (`apply`, `apply_batch`); the shipped ops are in `image_ops` and
`batch_ops`, and `pipeline.pp.ops` (`pipeline.ops`) names all of it.

The head (crop-aware decode, crop, resize, flip) stays fused and fast; ops run after it:

    image op  (image: np.ndarray, rng: np.random.Generator) -> np.ndarray     one HWC image
              (image, rng, example) -> np.ndarray    the same, also seeing its example
    batch op  (batch: dict[str, np.ndarray], rng) -> dict[str, np.ndarray]    one host batch

An image op whose signature takes a third parameter (or one named `example`; detected once,
when the ops are built) also gets a read-only mapping {"label": int, feature: value, ...}
of its record's label and the features `make_dataset(features=...)` asked for.

A batch op returns the batch it wants: it may add, replace or drop entries (big_vision's
`keep`), but it must keep every row, and the "mask" entry, when the batch has one (eval
streams, padded), must survive: it is the pipeline's record of which rows are padding,
not the record's data, so `keep(...)` keeps it without being asked (big_vision adds its
`_mask` after the pp ops for the same reason). Train batches have no mask.

Each call gets a Generator that depends only on (seed, epoch, example index) or (seed, batch
index), so what an op draws does not depend on threads, worker processes or where a run
resumed. It is the op's for the call: the ops stage re-keys one Generator per thread for the
next example, so an op must not keep it for later. Ops travel to worker processes by
pickle: module-level functions and classes (or cloudpickle-able closures). Ops registered
in `pipeline.pp.registry` (the shipped ones and `randaug`, and yours) are named in pp
strings, `pipeline.pp`'s language: "color_jitter(0.4, 0.4, 0.4)|my_op" (docs/API.md).
"""

from __future__ import annotations

import inspect
import operator
import threading
import types
from collections.abc import Callable, Mapping, Sequence

import numpy as np

ImageOp = Callable[[np.ndarray, np.random.Generator], np.ndarray]
BatchOp = Callable[[dict, np.random.Generator], dict]

MASK_KEY = "mask"
_MASK = "it marks the padding rows of eval batches: write your result under another name"
# Philox key tags: image ops and batch ops draw from streams no other part of the pipeline
# uses (the built-in head has its own generator), whatever the seed.
_EXAMPLE_STREAM, _BATCH_STREAM = 0x696D616765, 0x6261746368


class OpError(ValueError):
  """An op broke the op contract (wrong return type, shape, rows, lost mask); names the op."""


def _philox(stream: int, seed: int, counter: tuple[int, int]) -> np.random.Generator:
  seed = operator.index(seed)
  if not 0 <= seed < 2**64:
    raise ValueError(f"seed must be in [0, 2**64), got {seed}")
  hi, lo = (operator.index(c) for c in counter)
  if hi < 0 or lo < 0:
    raise ValueError(f"epoch and indices must be >= 0, got {counter}")
  # Philox increments the first counter word per draw; the last two name the stream.
  return np.random.Generator(np.random.Philox(key=(stream << 64) | seed, counter=[0, 0, hi, lo]))


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
  """The image ops' generator for record `index` in `epoch`: a pure function of the three."""
  return _philox(_EXAMPLE_STREAM, seed, (epoch, index))


_local = threading.local()


def reused_example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
  """`example_rng(seed, epoch, index)`'s exact stream from this thread's one Generator,
  re-keyed (~1 µs instead of ~8 µs for a new one). Valid until this thread's next call: for
  the pipeline's own loop, where an op runs to completion before the next example."""
  seed = operator.index(seed)
  if not 0 <= seed < 2**64 or epoch < 0 or index < 0:
    return example_rng(seed, epoch, index)  # the checks' errors
  held = getattr(_local, "rng", None)
  if held is None:
    bits = np.random.Philox(key=0)
    held = _local.rng = (np.random.Generator(bits), bits, bits.state)
  generator, bits, state = held
  key = (_EXAMPLE_STREAM << 64) | seed
  state["state"]["key"] = np.array([key & (2**64 - 1), key >> 64], np.uint64)
  state["state"]["counter"] = np.array([0, 0, epoch, index], np.uint64)
  state["buffer_pos"], state["has_uint32"], state["uinteger"] = 4, 0, 0
  bits.state = state
  return generator


def batch_rng(seed: int, batch_index: int) -> np.random.Generator:
  """The batch ops' generator for batch `batch_index` of a process's stream."""
  return _philox(_BATCH_STREAM, seed, (0, batch_index))


def _name(op) -> str:
  return getattr(op, "__name__", None) or type(op).__name__


def takes_example(op) -> bool:
  """Whether an image op asks for its example: a third positional parameter, or one named
  `example` (checked once, when the ops are built)."""
  try:
    params = list(inspect.signature(op).parameters.values())
  except (TypeError, ValueError):  # builtins and the like: the plain contract
    return False
  if any(p.name == "example" for p in params):
    return True
  positional = [
    p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
  ]
  return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def example_view(label: int, features: Mapping | None = None) -> Mapping:
  """The read-only mapping an example-taking image op gets."""
  return types.MappingProxyType({"label": int(label), **(features or {})})


def apply(
  image_ops: Sequence[ImageOp],
  image: np.ndarray,
  rng: np.random.Generator,
  example: Mapping | None = None,
  wants: Sequence[bool] | None = None,
) -> np.ndarray:
  """Runs `image_ops` in order on one image. They may change its shape and dtype, but the
  loader puts a batch's images in one array, so every image must come out alike. `wants`
  (from `takes_example`, per op; default: asked here) says which ops get `example`."""
  wants = [takes_example(op) for op in image_ops] if wants is None else wants
  for op, want in zip(image_ops, wants):
    if want:
      result = op(image, rng, example if example is not None else example_view(-1))
    else:
      result = op(image, rng)
    if not isinstance(result, np.ndarray):
      raise OpError(
        f"image op {_name(op)} returned {type(result).__name__}, not a numpy "
        "array (an op returns the new image)"
      )
    image = result
  return image


def apply_batch(
  batch_ops: Sequence[BatchOp], batch: Mapping[str, np.ndarray], rng: np.random.Generator
) -> dict[str, np.ndarray]:
  """Runs `batch_ops` in order on a host batch; each must keep the rows and, when the batch
  has one, the mask as it is (ops see it read-only). Any other entry may be dropped or added."""
  batch = dict(batch)
  rows = _rows(batch, "the batch")
  mask = batch.get(MASK_KEY)
  if mask is not None:
    batch[MASK_KEY] = seen = mask.view()
    seen.flags.writeable = False  # an op writing into it fails there, naming the op
  for op in batch_ops:
    try:
      result = op(batch, rng)
    except ValueError as e:
      if mask is not None and "read-only" in str(e):
        raise OpError(f"batch op {_name(op)} wrote into the {MASK_KEY!r} entry; {_MASK}") from e
      raise
    if not isinstance(result, Mapping):
      raise OpError(f"batch op {_name(op)} returned {type(result).__name__}, not a dict")
    result = dict(result)
    if mask is not None and MASK_KEY not in result:
      raise OpError(
        f"batch op {_name(op)} dropped the {MASK_KEY!r} entry; pass it through (it marks "
        "the padding rows of eval batches; any other entry may be dropped)"
      )
    if _rows(result, f"batch op {_name(op)}'s output") != rows:
      raise OpError(
        f"batch op {_name(op)} changed the batch from {rows} rows to "
        f"{_rows(result, '')}; ops must keep every row"
      )
    if mask is not None and result[MASK_KEY] is not seen:
      raise OpError(f"batch op {_name(op)} replaced the {MASK_KEY!r} entry; {_MASK}")
    batch = result
  if mask is not None:
    batch[MASK_KEY] = mask
  return batch


def _rows(batch: Mapping[str, np.ndarray], what: str) -> int:
  sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
  if len(set(sizes.values())) != 1 or None in sizes.values():
    raise OpError(f"entries of {what} disagree on the batch dimension: {sizes}")
  return next(iter(sizes.values()))
