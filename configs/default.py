"""The built-in default: MobileNet V1 (alpha 0.25) on the built-in digits, 2 CPU cores.

    python -m train --config configs/default.py --workdir runs/default
    python -m train --config configs/default.py --config.num_steps=200   # any field
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Data: `make data` builds it from scikit-learn's digits (no downloads).
  c.data_dir = "data/digits"
  c.train_split = "train"
  c.eval_split = "validation"
  c.image_size = 32
  c.area_range = (0.5, 1.0)  # digits survive mild crops, not Inception's 8%
  c.flip = False             # a mirrored 3 is not a 3
  c.num_threads = 0          # 0: one decode thread per core
  c.prefetch = 2             # host batches in flight
  c.device_depth = 2         # batches already on the devices
  c.cache_mb = 256.0         # decoded digits fit in RAM: decode once, crop per epoch

  # Model.
  c.model = "mobilenet_v1"
  c.alpha = 0.25
  c.depth_multiplier = 1
  c.dropout = 1e-3
  c.bn_momentum = 0.9        # Keras' 0.999 needs thousands of steps for eval statistics
  c.compute_dtype = "float32"

  # Optimization.
  c.batch_size = 128         # global, over all processes
  c.num_steps = 450
  c.optimizer = "adamw"
  c.learning_rate = 3e-3
  c.warmup_steps = 50
  c.weight_decay = 1e-4
  c.label_smoothing = 0.1
  c.seed = 0

  # Mesh: data-parallel over all devices; model_parallel > 1 adds a model axis.
  c.model_parallel = 1

  # Bookkeeping.
  c.log_every = 50
  c.eval_every = 225
  c.checkpoint_every = 200
  c.keep_checkpoints = 2
  c.synthetic_steps = 20     # steps timed on an on-device batch to measure input wait
  c.profile_steps = ()       # e.g. (100, 110): jax.profiler trace of those steps
  return c
