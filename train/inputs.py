"""The trainer's streams: `pipeline.input` of `config.input` and `config.eval_input`, each eval
stream opened beside the train stream, within one memory budget (`pipeline.input`'s
`beside=`), and `evaluate`, which reads them.

`config.eval_input.data_dir` may name several sources ({name: data_dir or pipeline.Source}):
each is evaluated on its own stream, one after another (a stream holds its loader only during
its pass, so each plans within what the train stream left), with its own top-1, top-5 and
loss; where `config.input.data_dir` is a mixture, the names are its sources' and each
source's labels are mapped into the mixture's classes (`pipeline.mixture.label_tables`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import pipeline
from pipeline import mixture
from pipeline.host.memory import Split
from train import UsageError
from train import config as config_lib


def open_input(
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  evaluation: bool,
  beside: pipeline.Input | None = None,
  source: pipeline.Source | None = None,
) -> pipeline.Input:
  """The train or eval stream (`pipeline.input` of `config.input` or `config.eval_input`,
  `source`'s dataset and its own settings (split, pp, image_size, ops...) over them, if
  given); batches the steps cannot take are refused (`check_batches`). Unless
  config.eval_input sets its own `performance.memory_mb`, the eval stream plans `beside` the
  train stream, within the one budget (config.input's, or the default).
  `config.input.image_size` fills a pp string's `image_size`; a pp string's head that writes
  its own size keeps it."""
  where = "config.eval_input" if evaluation else "config.input"
  kwargs = config_lib.dataset_kwargs(config, evaluation)
  eval_input = config.get("eval_input", {})
  if evaluation and (eval_input.get("performance") or {}).get("memory_mb") is None:
    kwargs["performance"] = {**kwargs.get("performance", {}), "memory_mb": None}  # shared
  if source is not None:
    kwargs.pop("weights", None), kwargs.pop("labels", None)
    kwargs["data_dir"] = str(source.data_dir)
    if source.pp is not None:  # its head and ops in place of config.eval_input's
      for key in ("pp", "ops"):
        kwargs.pop(key, None)
    own = ("split", "pp", "augment", "image_size", "ops", "features")
    kwargs.update({k: getattr(source, k) for k in own if getattr(source, k) is not None})
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


@dataclasses.dataclass
class Evals:
  """The eval streams by name ("" for config.eval_input's one dataset), each with its
  labels' map into the train classes (None: as they are)."""

  streams: dict[str, pipeline.Input]
  tables: dict[str, np.ndarray | None]

  @property
  def memory(self) -> Split:
    """The largest stream's plan: what evaluation holds at most, one stream at a time."""
    return max((s.memory for s in self.streams.values()), key=lambda m: m.total)

  @property
  def image_size(self) -> int:
    return next(iter(self.streams.values())).image_size

  def close(self) -> None:
    for stream in self.streams.values():
      stream.close()


def open_evals(
  config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, beside: pipeline.Input
) -> Evals:
  """The eval streams of `config.eval_input` (see the module's docstring), each beside the
  train stream `beside`."""
  data_dir = config_lib.dataset_kwargs(config, evaluation=True)["data_dir"]
  if not isinstance(data_dir, Mapping):
    return Evals({"": open_input(config, mesh, True, beside)}, {"": None})
  train_dir = config.input.data_dir
  train_dir = train_dir.to_dict() if isinstance(train_dir, ml_collections.ConfigDict) else train_dir
  tables = {}
  if isinstance(train_dir, Mapping):
    try:
      tables = mixture.label_tables(train_dir, config.input.get("labels"))
    except (ValueError, OSError) as e:
      raise UsageError(f"config.input: {e}") from e
  streams = {}
  for name, source in data_dir.items():
    if tables and name not in tables:
      raise UsageError(
        f"config.eval_input.data_dir names {name!r}, not a source of config.input.data_dir "
        f"{sorted(tables)}: name each eval source as the train source whose classes it holds"
      )
    if not isinstance(source, pipeline.Source):
      source = pipeline.Source(source)
    streams[name] = open_input(config, mesh, True, beside, source)
  return Evals(streams, {n: tables.get(n) for n in streams})


@jax.jit
def _relabel(label: jax.Array, table: jax.Array) -> jax.Array:
  """`table[label]`, padded rows (label -1) kept -1."""
  return jnp.where(label >= 0, table[jnp.maximum(label, 0)], label)


def evaluate(eval_step, state, evals: Evals) -> dict:
  """Top-1, top-5 and mean loss over every eval stream ("eval_top1", ...), and per named
  source ("eval_sources": {name: {"top1", "top5", "loss", "examples"}})."""
  total, sources = {"top1": 0.0, "top5": 0.0, "loss": 0.0, "count": 0.0}, {}
  for name, stream in evals.streams.items():
    table = evals.tables[name]
    table = None if table is None else jnp.asarray(table, jnp.int32)
    sums = dict.fromkeys(total, 0.0)
    for batch in iter(stream):
      if table is not None:
        batch = {**batch, "label": _relabel(batch["label"], table)}
      for k, v in eval_step(state, batch).items():
        sums[k] += float(v)
    n = max(sums["count"], 1.0)
    sources[name] = {
      "top1": sums["top1"] / n,
      "top5": sums["top5"] / n,
      "loss": sums["loss"] / n,
      "examples": int(sums["count"]),
    }
    total = {k: total[k] + sums[k] for k in total}
  n = max(total["count"], 1.0)
  ev = {
    "eval_top1": total["top1"] / n,
    "eval_top5": total["top5"] / n,
    "eval_loss": total["loss"] / n,
    "eval_examples": int(total["count"]),
  }
  named = {k: v for k, v in sources.items() if k}
  return {**ev, "eval_sources": named} if named else ev
