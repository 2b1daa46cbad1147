"""ImageNet, MobileNet V1 (alpha 1.0) at 224, the Keras/paper recipe adapted to TPU pods.

    python -m train --config configs/imagenet_mobilenet_v1.py --workdir gs://.../mnv1 \
        --config.data_dir=/mnt/imagenet_arrayrecord
"""

from configs import default


def get_config():
  c = default.get_config()
  c.data_dir = "/data/imagenet"  # python -m pipeline.convert images .../train ...
  c.eval_split = "validation"
  c.image_size = 224
  c.area_range = (0.08, 1.0)
  c.flip = True
  c.cache_mb = 0.0
  c.model = "mobilenet_v1"
  c.alpha = 1.0
  c.dropout = 1e-3
  c.bn_momentum = 0.99           # as Keras MobileNet V1 (V2: 0.999)
  c.compute_dtype = "bfloat16"   # params stay float32
  c.batch_size = 4096
  c.num_steps = 312 * 300        # ~300 epochs of 1.28M images
  c.optimizer = "sgd"            # Nesterov momentum 0.9
  c.learning_rate = 0.1 * c.batch_size / 256
  c.warmup_steps = 312 * 5
  c.weight_decay = 4e-5
  c.label_smoothing = 0.1
  c.log_every = 100
  c.eval_every = 312 * 5
  c.checkpoint_every = 1000
  return c
