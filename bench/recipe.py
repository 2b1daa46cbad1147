"""The doctor's settings from a run's recipe: a config's `input` block (`make_dataset`'s
keywords) with the trainer's `--config.FIELD=VALUE` overrides, as `python -m train` reads it."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import pathlib
import sys

import grain
import ml_collections

from bench import emulate
from pipeline import dataset
from train import config as train_config


class UsageError(ValueError):
  """A mistake in the command line or the config: one line, exit 2."""


@dataclasses.dataclass
class Settings:
  """What the doctor runs: `make_dataset`'s keywords (a config's `input` block) and the
  batch size of this process."""

  data_dir: str
  split: str = "train"
  batch_size: int = 128
  image_size: int = 224
  seed: int = 0
  augment: dict = dataclasses.field(default_factory=dict)  # pipeline.Augment fields
  performance: dict = dataclasses.field(default_factory=dict)  # pipeline.Performance fields
  decoding: dict = dataclasses.field(default_factory=dict)  # pipeline.Decoding fields
  other: dict = dataclasses.field(default_factory=dict)  # any other make_dataset keyword
  recipe: str | None = None  # the config file they came from (None: the doctor's defaults)

  def keywords(self) -> dict:
    """`make_dataset`'s arguments for these settings (one process, train)."""
    return dict(
      data_dir=self.data_dir,
      split=self.split,
      batch_size=self.batch_size,
      train=True,
      seed=self.seed,
      image_size=self.image_size,
      shard_index=0,
      shard_count=1,
      augment=self.augment,
      performance=self.performance,
      decoding=self.decoding,
      **self.other,
    )

  def spec(self) -> dataset.Spec:
    """`make_dataset`'s checked spec of these settings (ValueError names a bad field)."""
    return dataset.Spec.of(**self.keywords())

  def stages(self) -> dataset.Stages:
    """The stages `make_dataset` joins for these settings (`dataset.chain` joins them)."""
    return dataset.build(self.spec())

  def dataset(self, emulate_us: tuple[float, float] | None = None) -> grain.IterDataset:
    """The dataset these settings make (decode and resize emulated with `emulate_us`)."""
    return emulate.make_dataset(**self.keywords(), emulate_us=emulate_us)


def find_config(name_or_path: str) -> str:
  """A recipe's path, as the trainer finds it: a file, or a name in the repo's configs/."""
  try:
    return os.fspath(train_config.find(name_or_path))
  except ValueError as e:
    raise UsageError(f"no config file {name_or_path} ({e})") from None


def load_config(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file; one inside a package imports as that package."""
  if not pathlib.Path(path).is_file():
    raise UsageError(f"no config file {path}")
  name, root = module_name(path)
  if name:
    if root not in sys.path:
      sys.path.insert(0, root)
    return importlib.import_module(name).get_config()
  spec = importlib.util.spec_from_file_location("doctor_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def module_name(path: str) -> tuple[str | None, str]:
  """('configs.x', root) for ROOT/configs/x.py when configs/ is a package, else (None, '')."""
  p = pathlib.Path(path).resolve()
  parts, d = [p.stem], p.parent
  while (d / "__init__.py").exists():
    parts.insert(0, d.name)
    d = d.parent
  return (".".join(parts), os.fspath(d)) if len(parts) > 1 else (None, "")


def _plain(value):
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  return tuple(value) if isinstance(value, list) else value


def override(config: ml_collections.ConfigDict, flags: list[str]) -> None:
  """Applies the trainer's `--config.FIELD=VALUE` overrides to `config` (values as Python
  literals, else strings; each field keeps its type)."""
  for flag in flags:
    key, sep, text = flag.removeprefix("--config.").partition("=")
    if not flag.startswith("--config.") or not sep:
      raise UsageError(f"unrecognized argument {flag}: overrides are --config.FIELD=VALUE")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = {"true": True, "false": False}.get(text.lower(), text)
    *parents, leaf = key.split(".")
    node = config
    try:
      for name in parents:
        node = node[name]
      if leaf not in node:
        raise KeyError(leaf)
      node[leaf] = value
    except (KeyError, AttributeError):
      raise UsageError(f"unknown config field {key} (in --config.{key}={text})") from None
    except TypeError as e:
      raise UsageError(f"--config.{key}={text}: {' '.join(str(e).split())}") from None


def settings_from_config(config, path: str = "the config") -> Settings:
  """Settings from a config's `input` block (make_dataset's keywords), its global
  batch_size (one process) and seed (unless the input names its own)."""
  if "input" not in config:
    raise UsageError(
      f"{path} has no `input` block (pipeline.make_dataset's keywords, as in configs/default.py)"
    )
  kwargs = {k: v for k, v in _plain(config.input).items() if v is not None}  # None: unset
  fields = {f.name for f in dataclasses.fields(Settings)} - {"batch_size", "other"}
  known = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
  known.setdefault("seed", config.get("seed", 0))
  known["augment"] = known.get("augment") or {}
  known["performance"] = known.get("performance") or {}
  known["decoding"] = known.get("decoding") or {}
  return Settings(batch_size=config.get("batch_size", 128), other=kwargs, recipe=path, **known)
