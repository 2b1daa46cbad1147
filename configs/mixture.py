"""A mixture: the built-in digits (30%) and photos (70%) in one stream, each source evaluated
on its own validation split.

    python -m train --config mixture --workdir runs/mixture
    make train CONFIG=mixture

`config.input.data_dir` names the sources and `weights` their shares (`pipeline.mixture`);
labels="offset" numbers the photos' classes after the digits' (the digits 0-9, then the
photos'); `config.eval_input.data_dir` names the sources to evaluate, each on its own stream
with its labels mapped into the mixture's classes (`train.inputs`): the log prints each one's
top-1 and loss. Everything else is the default recipe's.
"""

import ml_collections

from configs import default
from train.config import eval_input_config, input_config


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  data = default.REPO / "data"
  values = {k: v for k, v in c.input.items() if v is not None}
  values.update(
    data_dir={"digits": str(data / "digits"), "photos": str(data / "photos")},
    weights={"digits": 0.3, "photos": 0.7},
    labels="offset",
    decoding={**c.input.decoding, "cache_mb": 128.0},  # one cache's bytes over both sources
  )
  c.input = input_config(**values)
  sources = {"digits": str(data / "digits"), "photos": str(data / "photos")}
  c.eval_input = eval_input_config(data_dir=sources, split="validation")
  c.num_epochs = 10.0  # of the mixture's 2,240 training images
  return c
