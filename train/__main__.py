"""`python -m train --config configs/NAME.py --workdir DIR [--config.FIELD=VALUE ...]`

Trains and evaluates; re-running the same command resumes from the latest checkpoint.
On a TPU pod slice run it on every host (`--worker=all`); JAX joins the hosts.
"""

import os

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.DEFINE_string("workdir", None, "checkpoints, TensorBoard logs, summary.json",
                            required=True)
config_flags.DEFINE_config_file("config", "configs/default.py", "a configs/*.py recipe")
MULTIHOST = flags.DEFINE_bool(
    "multihost", None, "call jax.distributed.initialize() (default: when on a TPU pod slice)")
CACHE = flags.DEFINE_string("compilation_cache", os.path.expanduser("~/.cache/jax"),
                            "persistent XLA compilation cache ('' to disable)")


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top

  multihost = MULTIHOST.value
  if multihost is None:  # TPU VMs of a pod slice list their peers here
    multihost = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if multihost:
    jax.distributed.initialize()
  if CACHE.value:
    jax.config.update("jax_compilation_cache_dir", CACHE.value)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  from train import train  # pylint: disable=g-import-not-at-top

  config = flags.FLAGS.config
  train.train_and_evaluate(config, FLAGS.value)


if __name__ == "__main__":
  flags.FLAGS.set_default("verbosity", -1)  # warnings and up; --verbosity=0 for Orbax's info
  app.run(main)
