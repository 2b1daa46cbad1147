"""What the processes of a run must agree on before the first step (`train.hosts.agree`
checks it), and the settings each host may choose for itself.

Every config field but those `per_host` (`pipeline.Performance` fields that change no batch),
the code (`code_version`: JAX, the sources of the trainer and the pipeline, the JPEG decoder),
each dataset's manifest, each stream's input order (chosen per host from its storage), the
plan, the mesh, the workdir and whether it holds a checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Iterator

import jax
import ml_collections
from etils import epath

import pipeline
from pipeline.image import decode
from train import checkpoints, models
from train import config as config_lib

# `pipeline.Performance`'s fields: none changes a batch, so each host may set its own.
PER_HOST = tuple(f.name for f in dataclasses.fields(pipeline.Performance))


def per_host(name: str) -> bool:
  """Whether config field `name` (`config.input.performance.num_threads`) is `PER_HOST`."""
  group, _, field = name.rpartition(".")
  return field in PER_HOST and group.endswith("input.performance")


def host_settings(config: ml_collections.ConfigDict) -> dict[str, str]:
  """This host's settings that change no batch (`PER_HOST`): they may differ per process."""
  return {k: repr(v) for k, v in flatten(config.to_dict(), "config.") if per_host(k)}


def start_fields(
  config: ml_collections.ConfigDict,
  data: tuple[pipeline.Input, object],
  plan: config_lib.Plan,
  mesh: jax.sharding.Mesh,
  workdir: epath.Path,
  token: str,
) -> dict[str, str]:
  """What every process must agree on before the first step, in the order to check it:
  `data` is the train input and the eval inputs (`train.inputs.Evals`), `token` what this
  process read of the workdir's token."""
  fields = {"code": code_version()}
  for name, value in flatten(config.to_dict(), "config."):
    if not per_host(name):
      fields[name] = repr(value)
  train, evals = data
  named = [("data", "order", train, config_lib.dataset_kwargs(config)["data_dir"])]
  eval_dir = config_lib.dataset_kwargs(config, evaluation=True)["data_dir"]
  for name, stream in evals.streams.items():  # `train.inputs.Evals`: "" for one dataset
    at = f"eval data {name}".strip(), f"eval order {name}".strip()
    named.append((*at, stream, eval_dir[name] if name else eval_dir))
  for data_field, order_field, stream, data_dir in named:
    meta = json.dumps(stream.manifest.to_json(), sort_keys=True).encode()
    digest = hashlib.sha256(meta).hexdigest()
    fields[data_field] = f"{data_dir} (manifest {digest[:12]})"
    fields[order_field] = input_order(stream)
  fields["plan"] = plan.describe()
  fields["mesh"] = repr(dict(mesh.shape))
  fields["workdir"] = token
  fields["resume from"] = str(checkpoints.saved_steps(workdir)[-1:] or "no checkpoint")
  fields["summary.json"] = str((workdir / "summary.json").exists())
  return fields


def input_order(stream: pipeline.Input) -> str:
  """What decides the stream's batches beside the config (the order each host chose from its
  storage: global or blocks, and their sizes), as every process must have it."""
  tag = {k: v for k, v in stream.stream.items() if k not in ("shard_index", "shards")}
  order = tag.pop("order", "global")
  return "; ".join([order, *(f"{k}={v}" for k, v in sorted(tag.items()))])


def flatten(d: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
  for k, v in sorted(d.items()):
    if isinstance(v, dict):
      yield from flatten(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def sources_digest(*folders: pathlib.Path) -> str:
  """A digest of the Python and C sources under `folders`."""
  h = hashlib.sha256()
  for folder in folders:
    for path in sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".c")):
      h.update(path.read_bytes())
  return h.hexdigest()[:12]


def code_version() -> str:
  """JAX's version, a digest of the trainer's and the pipeline's sources (the C decoder's
  included) and whether that decoder is built here (else simplejpeg decodes: other pixels)."""
  folders = [pathlib.Path(package.__file__).parent for package in (pipeline, models)]
  decoder = "C" if decode.native() is not None else "simplejpeg"
  return f"jax {jax.__version__}, sources {sources_digest(*folders)}, {decoder} JPEG decoder"
