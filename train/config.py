"""What a recipe means once its overrides are applied.

A recipe (`configs/*.py`) names its data as `config.input`: exactly `pipeline.make_dataset`'s
keywords (the trainer adds `batch_size`, this process's share, and `train`), with
`config.eval_input` overriding some of them for evaluation. Fields derived from others
(the learning rate, step counts given in epochs) are resolved here, after the command
line's overrides, from the final batch size and the dataset's size; the input's batch ops
are checked to make batches the train and eval steps take (`check_batches`).
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import typing
from collections.abc import Mapping

import ml_collections
import numpy as np
from ml_collections import config_dict

import pipeline
from pipeline.pp import ops
from pipeline.stages.plan import process_batch_size
from train import UsageError

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
SET_BY_TRAINER = ("batch_size", "train")
OPTIONS = {
  "augment": pipeline.Augment,
  "decoding": pipeline.Decoding,
  "performance": pipeline.Performance,
}


def find(name_or_path: str) -> pathlib.Path:
  """A recipe by path (absolute, or relative to this folder) or by name in the repo's configs/."""
  path = pathlib.Path(name_or_path).expanduser()
  for candidate in (path, CONFIGS / path, CONFIGS / f"{name_or_path}.py"):
    if candidate.is_file():
      return candidate.resolve()
  names = sorted(p.stem for p in CONFIGS.glob("*.py") if not p.stem.startswith("_"))
  raise UsageError(f"no config {name_or_path!r}: not a file, nor one of {names} in {CONFIGS}")


def options(cls, **values) -> ml_collections.ConfigDict:
  """Every field of `pipeline.Augment` or `pipeline.Performance`, `values` replacing the
  defaults, so that any of them can be overridden (`--config.input.augment.flip=False`).
  Fields that are None become typed placeholders (`--config.input.performance.num_workers=2`).
  """
  hints = typing.get_type_hints(cls)
  fields = dataclasses.asdict(cls(**values))  # checks names and values now
  for name, value in fields.items():
    if value is None:
      (kind,) = [t for t in typing.get_args(hints[name]) if t is not type(None)]
      fields[name] = config_dict.placeholder(kind)
  return ml_collections.ConfigDict(fields)


def _keywords() -> dict[str, tuple[object, type]]:
  """make_dataset's keywords but those the trainer sets: (default, type of a placeholder)."""
  out = {}
  for name, param in inspect.signature(pipeline.make_dataset).parameters.items():
    if name not in SET_BY_TRAINER:
      kinds = typing.get_args(param.annotation) or (param.annotation,)
      kind = next((k for k in (int, bool, str, dict) if k in kinds), None)
      if kind is None:  # a Mapping (a dict here), or a class of the library (records.Keys)
        kind = dict if Mapping in kinds else next(k for k in kinds if k is not type(None))
      out[name] = (param.default, kind)
  return out


def input_config(**values) -> ml_collections.ConfigDict:
  """`config.input`: every `pipeline.make_dataset` keyword (but those the trainer sets),
  `values` replacing the defaults, so that any can be overridden (`--config.input.pp=...`).
  augment and performance hold every field (`options`); a keyword whose default is None or
  empty, and seed (`config.seed` by default), is a typed placeholder, passed only when set."""
  keywords = _keywords()
  unknown = sorted(set(values) - set(keywords))
  if unknown:
    raise TypeError(f"{unknown[0]} is not a pipeline.make_dataset keyword the config sets")
  fields = {}
  for name, (default, kind) in keywords.items():
    value = values.get(name, default)
    if name in OPTIONS and not isinstance(value, ml_collections.ConfigDict):
      value = options(OPTIONS[name], **(value or {}))
    elif name not in values and (name == "seed" or default in (None, (), inspect.Parameter.empty)):
      value = config_dict.placeholder(kind)
    fields[name] = value
  return ml_collections.ConfigDict(fields)


def eval_input_config(**values) -> ml_collections.ConfigDict:
  """`config.eval_input`: what evaluation changes of `config.input`; every make_dataset
  keyword it does not name is a placeholder (unset: as in config.input)."""
  fields = {name: config_dict.placeholder(kind) for name, (_, kind) in _keywords().items()}
  return ml_collections.ConfigDict({**fields, **values})


def dataset_kwargs(config: ml_collections.ConfigDict, evaluation: bool = False) -> dict:
  """`config.input` (updated by `config.eval_input` for evaluation) as `make_dataset`
  keywords, seeded by `config.seed` unless the input names its own seed; keywords left
  unset (None) are not passed."""
  kwargs = {k: v for k, v in config.input.to_dict().items() if v is not None}
  if evaluation:
    for key, value in config.get("eval_input", {}).items():
      if isinstance(value, ml_collections.ConfigDict):
        value = value.to_dict()
      if isinstance(value, Mapping) and key in OPTIONS:
        value = {**kwargs.get(key, {}), **value}
      if value is not None:
        kwargs[key] = value
    if not isinstance(kwargs.get("data_dir"), Mapping):  # a mixture's eval reads one source
      kwargs.pop("weights", None)
      kwargs.pop("labels", None)
    if "pp" in kwargs and config.get("eval_input", {}).get("pp") is None:
      raise UsageError(
        "config.input.pp is set but config.eval_input.pp is not: a pp string holds the train "
        "or the eval head, so give evaluation its own (e.g. "
        "'decode|resize_small(256)|central_crop(224)|...')"
      )
  where = "config.eval_input" if evaluation else "config.input"
  for key in SET_BY_TRAINER:
    if key in kwargs:
      raise UsageError(
        f"{where}.{key} is set by the trainer (batch_size from the global "
        "config.batch_size, train for the train/eval split); remove it"
      )
  known = inspect.signature(pipeline.make_dataset).parameters
  unknown = sorted(set(kwargs) - set(known))
  if unknown:
    raise UsageError(
      f"{where}.{unknown[0]} is not a pipeline.make_dataset keyword; "
      f"known: {sorted(set(known) - set(SET_BY_TRAINER))}"
    )
  return {"seed": config.seed, **kwargs}


MAX_WARMUP = 0.25  # of the run's steps; more is warned about


@dataclasses.dataclass(frozen=True)
class Plan:
  """The numbers a run uses, resolved from the final config and the dataset's size."""

  batch_size: int  # global, over all processes
  local_batch_size: int  # this process's
  train_examples: int
  learning_rate: float  # peak: learning_rate_per_256 * batch_size / 256
  num_steps: int
  warmup_steps: int
  eval_every: int
  checkpoint_every: int

  @property
  def epochs(self) -> float:
    return self.num_steps * self.batch_size / self.train_examples

  def describe(self) -> str:
    return (
      f"{self.num_steps} steps of {self.batch_size} ({self.epochs:.1f} epochs of "
      f"{self.train_examples} examples), lr {self.learning_rate:.3g}, warmup "
      f"{self.warmup_steps} steps, eval every {self.eval_every}, checkpoint every "
      f"{self.checkpoint_every}"
    )

  def notes(self) -> str:
    """Lines on what the numbers imply that a short run makes easy to miss: an eval or
    checkpoint interval past the run (then only at its end), warmup past 25% of it."""
    lines = []
    past = [
      f"{what} (every {every})"
      for what, every in (("eval", self.eval_every), ("checkpoint", self.checkpoint_every))
      if every >= self.num_steps
    ]
    if past:
      lines.append(
        f"note: the run's {self.num_steps} steps end before its first {' and '.join(past)}: "
        f"it {'evaluates and saves' if len(past) == 2 else 'does so'} at its end only"
      )
    if self.warmup_steps > MAX_WARMUP * self.num_steps:
      lines.append(
        f"warning: warmup takes {self.warmup_steps} of the run's {self.num_steps} steps "
        f"({self.warmup_steps / self.num_steps:.0%}), so the learning rate peaks late: set "
        f"config.warmup_steps (or warmup_epochs) to at most {int(MAX_WARMUP * self.num_steps)}"
      )
    return "".join(f"{line}\n" for line in lines)


def length_field(config: ml_collections.ConfigDict) -> str:
  """The field that sets the run's length: num_steps when given, else num_epochs."""
  return "config.num_steps" if config.num_steps is not None else "config.num_epochs"


def steps(config: ml_collections.ConfigDict, name: str, steps_per_epoch: float) -> int:
  """`config.{name}_steps` when set, else `config.{name}_epochs` in steps of the final batch."""
  if config[f"{name}_steps"] is not None:
    return config[f"{name}_steps"]
  return round(config[f"{name}_epochs"] * steps_per_epoch)


def local_batch_size(config: ml_collections.ConfigDict, processes: int, data_devices: int) -> int:
  """This process's share of the global `config.batch_size`, which must split evenly over the
  processes (`pipeline.stages.plan.process_batch_size`) and the devices on the data axis."""
  try:
    local = process_batch_size(config.batch_size, processes, name="config.batch_size")
  except ValueError as e:
    raise UsageError(str(e)) from None
  if config.batch_size % data_devices:
    raise UsageError(
      f"config.batch_size={config.batch_size} does not divide over the {data_devices} devices "
      "on the data axis"
    )
  return local


def resolve(
  config: ml_collections.ConfigDict, train_examples: int, processes: int, data_devices: int
) -> Plan:
  """The plan for `config` on a split of `train_examples` (a batch larger than the split is
  refused when the data opens: `pipeline.host.guards.check_batch_fits`)."""
  local_batch = local_batch_size(config, processes, data_devices)
  batch = config.batch_size
  per_epoch = train_examples / batch
  plan = Plan(
    batch_size=batch,
    local_batch_size=local_batch,
    train_examples=train_examples,
    learning_rate=config.learning_rate_per_256 * batch / 256,
    num_steps=steps(config, "num", per_epoch),
    warmup_steps=steps(config, "warmup", per_epoch),
    eval_every=steps(config, "eval_every", per_epoch),
    checkpoint_every=steps(config, "checkpoint_every", per_epoch),
  )
  for field in ("num_steps", "eval_every", "checkpoint_every"):
    if getattr(plan, field) < 1:
      raise UsageError(f"{field} resolves to {getattr(plan, field)} steps; it must be >= 1")
  if plan.warmup_steps < 0:
    raise UsageError(f"warmup resolves to {plan.warmup_steps} steps; it must be >= 0")
  if config.get("synthetic_steps", 1) < 1:  # the no-input baseline the input wait is measured by
    raise UsageError(f"config.synthetic_steps must be >= 1, got {config.synthetic_steps}")
  return plan


def check_batches(data: pipeline.Input, where: str, named: str) -> None:
  """Refuses, in one line naming `where`, batch ops that make batches the steps cannot take:
  images scaled to floats (the steps normalize uint8 pixels on the device), or no integer
  "label" (the loss and the eval need it)."""
  labels = np.arange(2, dtype=np.int32) % data.num_classes
  batch = {"image": np.zeros((2, 8, 8, 3), np.uint8), "label": labels}
  try:
    batch = ops.apply_batch(data.batch_ops, batch, ops.batch_rng(0, 0))
  except (ValueError, TypeError, KeyError) as e:
    raise UsageError(f"{where}: {e}") from e
  image, label = batch.get("image"), batch.get("label")
  if image is not None and image.dtype.kind not in "iu":
    raise UsageError(
      f"{where}.{named} makes {image.dtype} images; the train and eval steps take uint8 pixels "
      "and normalize them to [-1, 1] on the device: drop the op that scales them (value_range)"
    )
  if image is None or label is None or label.ndim != 1 or label.dtype.kind not in "iu":
    made = "no 'label'" if label is None else f"'label' of {label.dtype}{list(label.shape)}"
    made = "no 'image'" if image is None else made
    raise UsageError(
      f"{where}.{named} makes {made} (it keeps {sorted(batch)}); the steps take uint8 pixels "
      "in 'image' and the integer class in 'label': keep them (onehot(..., "
      "key_result='labels') adds its one-hot beside 'label')"
    )
