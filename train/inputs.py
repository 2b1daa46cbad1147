"""The trainer's two streams: `pipeline.input` of `config.input` and `config.eval_input`, the
eval stream planned within what the train stream left of one memory budget."""

from __future__ import annotations

import functools
import re

import jax
import ml_collections

import pipeline
from pipeline.host import memory
from train import UsageError
from train import config as config_lib


def open_input(
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  evaluation: bool,
  after: memory.Split | None = None,
) -> pipeline.Input:
  """The train or eval stream (`pipeline.input` of `config.input` or `config.eval_input`);
  batches the steps cannot take are refused (`check_batches`). Unless eval sets its own
  `performance.memory_mb`, it plans within what the train stream's plan (`after`) left of the
  one budget (config.input's, or the default); if even its least does not fit in what is left
  of the default, within a budget of its own."""
  where = "config.eval_input" if evaluation else "config.input"
  kwargs = config_lib.dataset_kwargs(config, evaluation)
  if "pp" in kwargs and not re.search(r"\bimage_size\b", kwargs["pp"]):
    kwargs.pop("image_size", None)  # it only fills `image_size` where a pp string names it
  try:
    open_ = functools.partial(
      pipeline.input,
      kwargs.pop("data_dir"),
      kwargs.pop("split", "train"),
      global_batch_size=config.batch_size,
      mesh=mesh,
      train=not evaluation,
      depth=config.device_depth,
    )
    rest = after and _rest_of_one_budget(config, kwargs, after)
    try:
      data = open_(**(rest or kwargs))
    except ValueError as e:
      chosen = (config.input.get("performance") or {}).get("memory_mb") is not None
      if not (rest and str(e).startswith(memory.FLAG)) or chosen:
        raise  # a budget the user chose holds both streams, or says it cannot
      data = open_(**kwargs)
  except (ValueError, TypeError, OSError) as e:
    raise UsageError(f"{where}: {e}") from e
  except KeyError as e:
    raise UsageError(f"{where}: {e.args[0]}") from e
  config_lib.check_batches(data, where, "pp" if "pp" in kwargs else "batch_ops")
  return data


def _rest_of_one_budget(config, kwargs: dict, train: memory.Split) -> dict | None:
  """`kwargs` with `performance.memory_mb` set to what the train stream's plan left of its
  budget; None where config.eval_input sets its own."""
  if (config.get("eval_input", {}).get("performance") or {}).get("memory_mb") is not None:
    return None
  performance = dict(kwargs.get("performance") or {})
  performance["memory_mb"] = (train.budget - train.total) / memory.MB
  return {**kwargs, "performance": performance}
