"""The names a pp string may use: one op per name, the shipped ones and yours.

    @pipeline.pp.registry.register("my_blur", "image")
    def my_blur(radius=1):          # a factory: the string's arguments -> the op
      return lambda image, rng: cv2.blur(image, (2 * radius + 1,) * 2)

    make_dataset(..., pp="decode_jpeg_and_inception_crop(224)|my_blur(2)|value_range(-1, 1)")

An image op runs on each uint8 image after the fused head, a batch op on the whole batch
(`pipeline.pp.contract` has their contracts). Head ops (decode, crop, resize, flip) are
names too, but no factory: `pipeline.pp` compiles them into the fused head's settings. The
shipped ops register when `pipeline` is imported (`pp.image_ops`, `pp.batch_ops`,
`pp.randaugment`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

Kind = Literal["head", "image", "batch"]
HEAD = (
  "decode",
  "decode_jpeg_and_inception_crop",
  "inception_crop",
  "resize_small",
  "central_crop",
  "flip_lr",
)


@dataclasses.dataclass(frozen=True)
class Op:
  """A registered name: its kind, the factory that builds the op (None for head ops), and
  whether it belongs to training batches only (big_vision's mixup: refused after an eval head)."""

  name: str
  kind: Kind
  factory: Callable[..., Callable] | None
  train_only: bool = False


_OPS: dict[str, Op] = {name: Op(name, "head", None) for name in HEAD}


def register(
  name: str, kind: Literal["image", "batch"], *, replace: bool = False, train_only: bool = False
):
  """Decorator: `factory(*args, **kwargs)` builds the op a pp string names `name`; a
  `train_only` op is refused in a pp string with an eval head.

  Registering the same definition again (a re-run notebook cell, `importlib.reload`) is a
  no-op that keeps the newest object; a different definition under a taken name is refused
  unless `replace=True`. Head names are the fused head's and cannot be taken.
  """
  if kind not in ("image", "batch"):
    raise ValueError(f"kind must be 'image' or 'batch', got {kind!r}")
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"an op's name is a Python identifier, got {name!r}")
  if name in HEAD:
    raise ValueError(f"{name!r} is a head op (the fused decode/crop/resize/flip): choose another")

  def add(factory):
    taken = _OPS.get(name)
    if taken is not None and not replace and _definition(taken.factory) != _definition(factory):
      raise ValueError(
        f"a different {taken.kind} op is already registered as {name!r} "
        f"({_where(taken.factory)}); choose another name or pass register(..., replace=True)"
      )
    _OPS[name] = Op(name, kind, factory, train_only)
    return factory

  return add


def lookup(name: str) -> Op:
  """The op registered as `name`; an unknown name is one ValueError listing the names."""
  op = _OPS.get(name)
  if op is not None:
    return op
  raise ValueError(f"unknown op {name!r}; registered: {names()}")


def names() -> list[str]:
  """Every name a pp string may use, head ops included."""
  return sorted(_OPS)


def _where(factory) -> str:
  return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


def _definition(obj, depth: int = 0):
  """What makes two factories the same definition: module, name and code (for a class, the
  code of its methods), not object identity, so re-running the defining code matches."""
  if depth > 3:
    return None
  code = getattr(obj, "__code__", None)
  if code is not None:
    defaults = repr((getattr(obj, "__defaults__", None), getattr(obj, "__kwdefaults__", None)))
    return (_where(obj), _code(code), defaults)
  if isinstance(obj, type):
    members = sorted(
      (k, _definition(v, depth + 1))
      for k, v in vars(obj).items()
      if callable(v) or isinstance(v, (staticmethod, classmethod, property))
    )
    values = sorted(
      (k, repr(v))
      for k, v in vars(obj).items()
      if not k.startswith("__") and isinstance(v, (int, float, str, bytes, tuple, type(None)))
    )
    fields = sorted((k, str(v)) for k, v in getattr(obj, "__annotations__", {}).items())
    return (_where(obj), tuple(members), tuple(values), tuple(fields))
  inner = getattr(obj, "__func__", None) or getattr(obj, "fget", None)
  if inner is not None:
    return _definition(inner, depth + 1)
  return (_where(obj), id(obj))


def _code(code):
  consts = tuple(_code(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts)
  return (code.co_code, consts, code.co_names, code.co_varnames)
