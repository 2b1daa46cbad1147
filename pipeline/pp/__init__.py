"""The one preprocessing language: big_vision's pp strings, run as written.

    make_dataset(..., pp="decode_jpeg_and_inception_crop(224)|flip_lr|value_range(-1, 1)"
                         "|onehot(10, key='label', key_result='labels')|keep('image', 'labels')")

A pp string is big_vision's: `name(literal args)` joined by "|", each name one op of
`pipeline.pp.registry` (`registry.names()` lists them; `registry.register` adds yours).
Arguments are Python literals (nothing is evaluated), or `num_classes` / `image_size`
unquoted: the dataset's values, which also fill an op's parameters of those names that the
string leaves out (as big_vision's `kwargs_extra`). Its head (decode, crop, resize, flip) is
not run op by op: it becomes settings of the fused native head, which decodes only the crop
window (what big_vision's `decode_jpeg_and_inception_crop` does with
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
`onehot`, `keep`, `mixup`, `permuted_mixup`, your registered ones). `mixup` is big_vision's
(`get_mixup(rng, p)`: a = max(a, 1 - a), partner = the next row rolled; ops.BigVisionMixup).
`make_dataset(ops=..., batch_ops=...)` take the same language without a head (`build`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence

from pipeline.pp import registry
from pipeline.pp.contract import MASK_KEY

METHODS = {"bilinear": "bilinear", "bicubic": "bicubic"}


@dataclasses.dataclass(frozen=True)
class Call:
  """One op of a pp string: its name, literal arguments and text."""

  name: str
  args: tuple
  kwargs: dict
  text: str


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What a pp string asks for: the head's settings and the ops after it."""

  train: bool  # the head: inception crop (True) or resize_small|central_crop (False)
  image_size: int
  augment: dict  # pipeline.Augment fields
  image_ops: tuple = ()
  batch_ops: tuple = ()


def parse(pp: str, context: Mapping | None = None) -> list[Call]:
  """The calls of `pp`, in order; empty slots ("||", big_vision's switched-off ops) skipped.
  A bare name among `context`'s keys (num_classes, image_size) is its value."""
  context = {k: v for k, v in (context or {}).items() if v is not None}
  return [_parse(t.strip(), context) for t in pp.split("|") if t.strip()]


def make(call: Call, context: Mapping | None = None) -> Callable:
  """The op `call` names, built by its registered factory; `context` fills the factory's
  parameters of those names that the call left out. Errors are one line naming the op."""
  op = registry.lookup(call.name)
  if op.factory is None:
    raise ValueError(f"op {call.text!r} is a head op: only a whole pp string's head runs it")
  context = {k: v for k, v in (context or {}).items() if v is not None}
  kwargs = dict(call.kwargs)
  if call.name == "onehot":
    depth = call.args[0] if call.args else kwargs.get("depth")
    if "num_classes" in context and depth != context["num_classes"]:
      raise ValueError(
        f"op {call.text!r} one-hot encodes {depth} classes, but the dataset has "
        f"{context['num_classes']}: write onehot({context['num_classes']}, ...) or "
        "onehot(num_classes, ...)"
      )
    kwargs.pop("multi", None)  # big_vision's multi-label switch: our labels are one int
  try:
    params = inspect.signature(op.factory).parameters
  except (TypeError, ValueError):
    params = {}
  for key, value in context.items():
    if key in params and key not in kwargs:
      kwargs[key] = value
  try:
    return op.factory(*call.args, **kwargs)
  except TypeError as e:
    raise ValueError(f"op {call.text!r}: {e}") from None


def build(spec: str | Callable | Sequence | None, kind: str, **context) -> tuple:
  """`make_dataset`'s `ops=` (kind "image") or `batch_ops=` (kind "batch"): a pp string
  without a head, an op callable, or a sequence of such strings and callables (kept as they
  are). `context` (num_classes, image_size) is the dataset's, as in a whole pp string."""
  if kind not in ("image", "batch"):
    raise ValueError(f"kind must be 'image' or 'batch', got {kind!r}")
  if spec is None:
    return ()
  items = [spec] if isinstance(spec, str) or callable(spec) else list(spec)
  built = []
  for item in items:
    if callable(item):
      built.append(item)
    elif isinstance(item, str):
      for call in parse(item, context):
        registered = registry.lookup(call.name).kind
        if registered != kind:
          where = {"image": "ops=", "batch": "batch_ops=", "head": "augment= or a pp= string"}
          raise ValueError(
            f"op {call.text!r} is a {registered} op, not a{'n' * (kind == 'image')} {kind} "
            f"op: name it in {where[registered]}"
          )
        built.append(make(call, context))
    else:
      raise TypeError(f"{kind} ops are callables or pp strings, got {type(item).__name__} {item!r}")
  return tuple(built)


def compile(pp: str, *, num_classes: int, image_size: int | None = None) -> Compiled:
  """The head settings and ops of `pp` (see the module docstring); errors name the op."""
  if not isinstance(pp, str) or not pp.strip():
    raise ValueError(f"pp must be a non-empty string of ops joined by '|', got {pp!r}")
  context = {"num_classes": num_classes, "image_size": image_size}
  head: list[Call] = []
  image_ops: list[Callable] = []
  batch_ops: list[Callable] = []
  last = ""  # the text of the last op after the head
  train_only = []  # the ops registered as training-only
  for call in parse(pp, context):
    registered = registry.lookup(call.name)
    kind = registered.kind
    if registered.train_only:
      train_only.append(call.text)
    if kind == "head":
      if image_ops or batch_ops:
        raise ValueError(
          f"pp: head op {call.text!r} comes after {last!r}; the decode, crop, resize "
          f"and flip ops ({', '.join(registry.HEAD)}) run fused, before every other op"
        )
      head.append(call)
      continue
    op = make(call, context)
    if (getattr(op, "key_result", None) or getattr(op, "key", None)) == MASK_KEY:
      raise ValueError(
        f"pp: op {call.text!r} writes the {MASK_KEY!r} entry, which marks the padding "
        "rows of eval batches: give its result another name (key_result=...)"
      )
    if kind == "image":
      if batch_ops:
        raise ValueError(
          f"pp: image op {call.text!r} comes after batch op {last!r}; "
          "per-image ops run before the batch ops (e.g. randaug before value_range)"
        )
      image_ops.append(op)
    else:
      batch_ops.append(op)
    last = call.text
  train, size, augment = _head(head, pp)
  if train_only and not train:
    raise ValueError(
      f"pp {pp!r} runs {train_only[0]!r}, registered for training batches only, after an eval "
      "head (big_vision mixes training batches only): drop it from the eval pp"
    )
  return Compiled(train, size, augment, tuple(image_ops), tuple(batch_ops))


def image_size(pp: str) -> int | None:
  """The side of the square images `pp`'s head makes; None where the head writes it as
  `image_size`, which the dataset's `image_size=` then fills. Errors name the op."""
  written = object()  # `image_size` as written, the dataset's to fill
  calls = parse(pp, {"image_size": written, "num_classes": 0})
  head = [c for c in calls if registry.lookup(c.name).kind == "head"]
  if any(v is written for c in head for v in (*c.args, *c.kwargs.values())):
    return None
  return _head(head, pp)[1]


def _parse(text: str, context: dict) -> Call:
  """ "name" or "name(literal, key=literal)"; a bare context name is its value."""
  try:
    expr = ast.parse(text, mode="eval").body
  except SyntaxError:
    expr = None
  if isinstance(expr, ast.Name):
    return Call(expr.id, (), {}, text)
  if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
    try:
      value = lambda node: _value(node, context)
      args = tuple(value(a) for a in expr.args)
      kwargs = {k.arg: value(k.value) for k in expr.keywords if k.arg is not None}
      if len(kwargs) == len(expr.keywords):
        return Call(expr.func.id, args, kwargs, text)
    except ValueError:
      pass
  raise ValueError(
    f"cannot read op {text!r}: write name or name(literal, key=literal) "
    f"(literals, or num_classes / image_size)"
  )


def _value(node, context: dict):
  if isinstance(node, ast.Name) and node.id in context:
    return context[node.id]
  return ast.literal_eval(node)


def _head(head: list[Call], pp: str) -> tuple[bool, int, dict]:
  """The head ops, in order, as (train, image_size, Augment settings)."""
  seen = [h.name for h in head]
  if not seen or seen[0] not in ("decode", "decode_jpeg_and_inception_crop"):
    raise ValueError(
      f"pp {pp!r} does not start with a decode: begin with "
      "decode_jpeg_and_inception_crop(size) (train) or decode|resize_small(S)|central_crop(C)"
      " (eval); the pipeline's head decodes, crops and resizes fused"
    )
  if seen.count("flip_lr") > 1 or ("flip_lr" in seen and seen[-1] != "flip_lr"):
    raise ValueError(f"pp {pp!r}: flip_lr comes once, after the crop")
  flip = "flip_lr" in seen
  rest = [h for h in head if h.name != "flip_lr"]
  kinds = [h.name for h in rest]
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


def _call(call: Call, signature: Callable):
  try:
    return signature(*call.args, **call.kwargs)
  except TypeError as e:
    raise ValueError(f"pp: op {call.text!r}: {e}") from None


def _inception(call: Call, flip: bool) -> tuple[bool, int, dict]:
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

  size, area_min, area_max, ratio_min, ratio_max, method, _ = _call(call, signature)
  text = call.text
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


def _eval(resize: Call, crop_call: Call) -> tuple[bool, int, dict]:
  small, method, _ = _call(
    resize, lambda smaller_size, method="area", antialias=False: (smaller_size, method, 0)
  )
  (crop,) = _call(crop_call, lambda crop_size=None: (crop_size,))
  if isinstance(crop, (tuple, list)):
    if len(crop) != 2 or crop[0] != crop[1]:
      raise ValueError(f"pp: {crop_call.text!r}: the crop must be square, got {crop}")
    crop = crop[0]
  if not isinstance(small, int) or not isinstance(crop, int) or not 0 < crop <= small:
    raise ValueError(
      f"pp: {resize.text!r}|{crop_call.text!r}: need ints with 0 < crop <= smaller side"
    )
  return (
    False,
    crop,
    {"crop_fraction": crop / small, "eval_order": "resize_then_crop", "flip": False},
  )
