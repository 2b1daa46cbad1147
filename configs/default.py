"""The built-in default: MobileNet V1 (alpha 0.25) on the built-in digits, 2 CPU cores.

    python -m train --config default --workdir runs/default
    python -m train --config default --workdir runs/a --config.batch_size=64   # any field

`config.input` holds exactly `pipeline.make_dataset`'s keywords (the trainer adds the
per-process batch_size and train); `config.eval_input` overrides some for evaluation.
Step counts are given in epochs (or, when set, in steps) and the learning rate per 256
examples: both follow the final batch size and the dataset's size.
"""

import pathlib

import ml_collections
from ml_collections import config_dict

import pipeline
from train.config import eval_input_config, input_config, options

REPO = pathlib.Path(__file__).resolve().parent.parent


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Data: `make data` builds the digits from scikit-learn's (no downloads).
  c.input = input_config(  # every make_dataset keyword; those not named here: its defaults
    data_dir=str(REPO / "data" / "digits"),
    split="train",
    image_size=32,
    on_error="raise",  # or "skip" bad records (counted)
    # Digits survive mild crops, not Inception's 8%; a mirrored 3 is not a 3.
    augment=options(pipeline.Augment, area_range=(0.5, 1.0), flip=False),
    # Decoded digits fit in RAM: decode once, crop per epoch (other crops: pixels change).
    decoding=options(pipeline.Decoding, cache_mb=256.0),
    performance=options(pipeline.Performance, prefetch=2),  # None: chosen for the host
  )
  c.eval_input = eval_input_config(split="validation")  # unset fields: as in c.input
  c.device_depth = 2  # batches already on the devices

  # Model.
  c.model = "mobilenet_v1"
  c.alpha = 0.25
  c.depth_multiplier = 1
  c.dropout = 1e-3
  c.bn_momentum = 0.9  # Keras' 0.999 needs thousands of steps for eval statistics
  c.compute_dtype = "float32"

  # Optimization. Lengths in epochs of the train split; a `*_steps` field, when set, wins.
  c.batch_size = 128  # global, over all processes
  c.num_epochs = 40.0  # 449 steps of 128 on the 1,438 training digits
  c.num_steps = config_dict.placeholder(int)
  c.optimizer = "adamw"
  c.learning_rate_per_256 = 6e-3  # peak lr = this x batch_size / 256
  c.warmup_epochs = 4.5
  c.warmup_steps = config_dict.placeholder(int)
  c.weight_decay = 1e-4
  c.label_smoothing = 0.1
  c.seed = 0  # model init, and the data order and augmentation unless input.seed is set

  # Mesh: data-parallel over all devices; model_parallel > 1 adds a model axis.
  c.model_parallel = 1

  # Bookkeeping.
  c.log_every = 50  # steps
  c.eval_every_epochs = 20.0
  c.eval_every_steps = config_dict.placeholder(int)
  c.checkpoint_every_epochs = 10.0
  c.checkpoint_every_steps = config_dict.placeholder(int)
  c.keep_checkpoints = 2
  c.synthetic_steps = 20  # steps timed on an on-device batch to measure input wait
  c.profile_steps = ()  # e.g. (100, 110): jax.profiler trace of those steps
  return c
