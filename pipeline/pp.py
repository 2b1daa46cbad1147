"""big_vision pp strings, run as written: the head ops compile into the fused head.

    make_dataset(..., pp="decode_jpeg_and_inception_crop(224)|flip_lr|value_range(-1, 1)"
                         "|onehot(10, key='label', key_result='labels')|keep('image', 'labels')")

A pp string is big_vision's: `name(literal args)` joined by "|". Its head (decode, crop,
resize, flip) is not run op by op: it becomes settings of the fused native head, which
decodes only the crop window (what big_vision's `decode_jpeg_and_inception_crop` does with
`tf.image.decode_and_crop_jpeg`):

    decode_jpeg_and_inception_crop(size, area_min=5, area_max=100, ratio_min=0.75,
        ratio_max=1.33, method="bilinear")   train head: crop="tf", area_range=(area_min/100,
                                              area_max/100), aspect_range, image_size=size
    decode|inception_crop(size, ...)         the same
    decode|resize_small(S)|central_crop(C)   eval head: image_size=C, crop_fraction=C/S,
                                              eval_order="resize_then_crop"
    flip_lr                                  flip=True (a train head without it: flip=False)

`method` may be "bilinear" or "bicubic" (the head's resize filters; OpenCV's, area averaging
when shrinking more than 2x, which stands in for TF's `antialias`, ignored here);
resize_small's method is the head's too.

The rest run after the head, in order: image ops (`randaug`, `color_jitter`, your registered
ones) on each uint8 image, then batch ops on the whole batch, vectorized (`value_range`,
`onehot`, `keep`, `mixup`, your registered ones). `mixup` here is big_vision's
(`get_mixup(rng, p)`: a = max(a, 1 - a), partner = the next row rolled; ops.BigVisionMixup),
not `batch_ops="mixup(alpha)"`'s. An argument may name `num_classes` or `image_size`
(unquoted): the dataset's value.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable

from pipeline import ops as ops_lib

HEAD_OPS = (
  "decode",
  "decode_jpeg_and_inception_crop",
  "inception_crop",
  "resize_small",
  "central_crop",
  "flip_lr",
)
PP_ONLY = {"mixup": ops_lib.BigVisionMixup}  # names that mean big_vision's op in a pp string
METHODS = {"bilinear": "bilinear", "bicubic": "bicubic"}


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What a pp string asks for: the head's settings and the ops after it."""

  train: bool  # the head: inception crop (True) or resize_small|central_crop (False)
  image_size: int
  augment: dict  # pipeline.Augment fields
  image_ops: tuple = ()
  batch_ops: tuple = ()


def names() -> list[str]:
  """Every name a pp string may use."""
  return sorted({*HEAD_OPS, *PP_ONLY, *ops_lib._REGISTRY["image"], *ops_lib._REGISTRY["batch"]})


def compile(pp: str, *, num_classes: int, image_size: int | None = None) -> Compiled:
  """The head settings and ops of `pp` (see the module docstring); errors name the op."""
  if not isinstance(pp, str) or not pp.strip():
    raise ValueError(f"pp must be a non-empty string of ops joined by '|', got {pp!r}")
  context = {"num_classes": num_classes, "image_size": image_size}
  head: list[tuple[str, tuple, dict, str]] = []
  image_ops: list[Callable] = []
  batch_ops: list[Callable] = []
  last = ""  # the text of the last op after the head
  for text in (t.strip() for t in pp.split("|")):
    if not text:
      continue  # big_vision's configs leave "||" where an optional op is off
    name, args, kwargs = _parse(text, context)
    if name in HEAD_OPS:
      if image_ops or batch_ops:
        raise ValueError(
          f"pp: head op {text!r} comes after {last!r}; the decode, crop, resize "
          f"and flip ops ({', '.join(HEAD_OPS)}) run fused, before every other op"
        )
      head.append((name, args, kwargs, text))
      continue
    op = _build(name, args, kwargs, text, num_classes)
    if (getattr(op, "key_result", None) or getattr(op, "key", None)) == ops_lib.MASK_KEY:
      raise ValueError(
        f"pp: op {text!r} writes the {ops_lib.MASK_KEY!r} entry, which marks the padding rows "
        "of eval batches: give its result another name (key_result=...)"
      )
    if name not in PP_ONLY and name in ops_lib._REGISTRY["image"]:
      if batch_ops:
        raise ValueError(
          f"pp: image op {text!r} comes after batch op {last!r}; "
          "per-image ops run before the batch ops (e.g. randaug before value_range)"
        )
      image_ops.append(op)
    else:
      batch_ops.append(op)
    last = text
  train, size, augment = _head(head, pp)
  return Compiled(train, size, augment, tuple(image_ops), tuple(batch_ops))


def _parse(text: str, context: dict) -> tuple[str, tuple, dict]:
  """ "name" or "name(literal, key=literal)"; a bare num_classes / image_size is the dataset's."""
  try:
    expr = ast.parse(text, mode="eval").body
  except SyntaxError:
    expr = None
  if isinstance(expr, ast.Name):
    return expr.id, (), {}
  if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
    try:
      value = lambda node: _value(node, context)
      args = tuple(value(a) for a in expr.args)
      kwargs = {k.arg: value(k.value) for k in expr.keywords if k.arg is not None}
      if len(kwargs) == len(expr.keywords):
        return expr.func.id, args, kwargs
    except ValueError:
      pass
  raise ValueError(
    f"pp: cannot read op {text!r}: write name or name(literal, key=literal) "
    f"(literals, or num_classes / image_size)"
  )


def _value(node, context: dict):
  if isinstance(node, ast.Name) and context.get(node.id) is not None:
    return context[node.id]
  return ast.literal_eval(node)


def _build(name: str, args: tuple, kwargs: dict, text: str, num_classes: int) -> Callable:
  factory = PP_ONLY.get(name) or ops_lib._REGISTRY["image"].get(name)
  factory = factory or ops_lib._REGISTRY["batch"].get(name)
  if factory is None:
    raise ValueError(f"pp: unknown op {name!r} in {text!r}; registered: {names()}")
  if name == "onehot":
    depth = args[0] if args else kwargs.get("depth")
    if depth != num_classes:
      raise ValueError(
        f"pp: {text!r} one-hot encodes {depth} classes, but the dataset has {num_classes}: "
        f"write onehot({num_classes}, ...) or onehot(num_classes, ...)"
      )
    kwargs.pop("multi", None)  # big_vision's multi-label switch: our labels are one int
  try:
    return factory(*args, **kwargs)
  except TypeError as e:
    raise ValueError(f"pp: op {text!r}: {e}") from None


def _head(head: list, pp: str) -> tuple[bool, int, dict]:
  """The head ops, in order, as (train, image_size, Augment settings)."""
  seen = [h[0] for h in head]
  if not seen or seen[0] not in ("decode", "decode_jpeg_and_inception_crop"):
    raise ValueError(
      f"pp {pp!r} does not start with a decode: begin with "
      "decode_jpeg_and_inception_crop(size) (train) or decode|resize_small(S)|central_crop(C)"
      " (eval); the pipeline's head decodes, crops and resizes fused"
    )
  if seen.count("flip_lr") > 1 or ("flip_lr" in seen and seen[-1] != "flip_lr"):
    raise ValueError(f"pp {pp!r}: flip_lr comes once, after the crop")
  flip = "flip_lr" in seen
  rest = [h for h in head if h[0] != "flip_lr"]
  kinds = [h[0] for h in rest]
  if kinds == ["decode_jpeg_and_inception_crop"]:
    return _inception(rest[0], flip)
  if kinds == ["decode", "inception_crop"]:
    return _inception(rest[1], flip)
  if kinds == ["decode", "resize_small", "central_crop"]:
    if flip:
      raise ValueError(f"pp {pp!r}: flip_lr after an eval crop is not supported (eval: no flip)")
    return _eval(rest[1], rest[2])
  raise ValueError(
    f"pp {pp!r}: the head {'|'.join(seen)} is not one the fused head runs; it runs "
    "decode_jpeg_and_inception_crop(size)[|flip_lr], decode|inception_crop(size)[|flip_lr] "
    "and decode|resize_small(S)|central_crop(C)"
  )


def _call(entry, signature: Callable):
  name, args, kwargs, text = entry
  try:
    return signature(*args, **kwargs)
  except TypeError as e:
    raise ValueError(f"pp: op {text!r}: {e}") from None


def _inception(entry, flip: bool) -> tuple[bool, int, dict]:
  def signature(
    size=None,
    area_min=5,
    area_max=100,
    ratio_min=0.75,
    ratio_max=1.33,
    method="bilinear",
    antialias=False,
  ):
    return size, area_min, area_max, ratio_min, ratio_max, method, antialias

  size, area_min, area_max, ratio_min, ratio_max, method, _ = _call(entry, signature)
  text = entry[3]
  if not isinstance(size, int) or size < 1:
    raise ValueError(f"pp: {text!r} needs the output size (a positive int): batches are square")
  if method not in METHODS:
    raise ValueError(f"pp: {text!r}: method must be one of {sorted(METHODS)}, got {method!r}")
  return (
    True,
    size,
    {
      "crop": "tf",
      "area_range": (area_min / 100, area_max / 100),
      "aspect_range": (ratio_min, ratio_max),
      "flip": flip,
      "interpolation": METHODS[method],
    },
  )


def _eval(resize_entry, crop_entry) -> tuple[bool, int, dict]:
  small, method, _ = _call(
    resize_entry, lambda smaller_size, method="area", antialias=False: (smaller_size, method, 0)
  )
  (crop,) = _call(crop_entry, lambda crop_size=None: (crop_size,))
  if isinstance(crop, (tuple, list)):
    if len(crop) != 2 or crop[0] != crop[1]:
      raise ValueError(f"pp: {crop_entry[3]!r}: the crop must be square, got {crop}")
    crop = crop[0]
  if not isinstance(small, int) or not isinstance(crop, int) or not 0 < crop <= small:
    raise ValueError(
      f"pp: {resize_entry[3]!r}|{crop_entry[3]!r}: need ints with 0 < crop <= smaller side"
    )
  return (
    False,
    crop,
    {"crop_fraction": crop / small, "eval_order": "resize_then_crop", "flip": False},
  )
