"""The trainer's two streams: `pipeline.input` of `config.input` and `config.eval_input`, the
eval stream opened beside the train stream, within one memory budget (`pipeline.input`'s
`beside=`)."""

from __future__ import annotations

import jax
import ml_collections

import pipeline
from train import UsageError
from train import config as config_lib


def open_input(
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  evaluation: bool,
  beside: pipeline.Input | None = None,
) -> pipeline.Input:
  """The train or eval stream (`pipeline.input` of `config.input` or `config.eval_input`);
  batches the steps cannot take are refused (`check_batches`). Unless config.eval_input sets
  its own `performance.memory_mb`, the eval stream plans `beside` the train stream, within
  the one budget (config.input's, or the default). `config.input.image_size` fills a pp
  string's `image_size`; a pp string's head that writes its own size keeps it."""
  where = "config.eval_input" if evaluation else "config.input"
  kwargs = config_lib.dataset_kwargs(config, evaluation)
  eval_input = config.get("eval_input", {})
  if evaluation and (eval_input.get("performance") or {}).get("memory_mb") is None:
    kwargs["performance"] = {**kwargs.get("performance", {}), "memory_mb": None}  # shared
  try:
    if "pp" in kwargs and pipeline.pp.image_size(kwargs["pp"]) is not None:
      kwargs.pop("image_size", None)
    data = pipeline.input(
      kwargs.pop("data_dir"),
      kwargs.pop("split", "train"),
      global_batch_size=config.batch_size,
      mesh=mesh,
      train=not evaluation,
      depth=config.device_depth,
      beside=beside,
      **kwargs,
    )
  except (ValueError, TypeError, OSError) as e:
    raise UsageError(f"{where}: {e}") from e
  except KeyError as e:
    raise UsageError(f"{where}: {e.args[0]}") from e
  config_lib.check_batches(data, where, "pp" if "pp" in kwargs else "batch_ops")
  return data
