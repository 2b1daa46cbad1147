"""ImageNet, MobileNet V1 (alpha 1.0) at 224, the Keras/paper recipe adapted to TPU pods.

    python -m train --config imagenet_mobilenet_v1 --workdir gs://.../mnv1 \
        --config.input.data_dir=/mnt/imagenet_arrayrecord

The learning rate is per 256 examples and the schedule in epochs, so `--config.batch_size`
alone rescales both.
"""

import pipeline
from configs import default
from train.config import eval_input_config, input_config, options


def get_config():
  c = default.get_config()
  c.input = input_config(
    data_dir="/data/imagenet",  # python -m pipeline.convert images .../train ...
    split="train",
    image_size=224,
    on_error="raise",
    augment=options(pipeline.Augment),  # Inception crop (8-100% of the area), flip
    performance=options(pipeline.Performance),
  )
  c.eval_input = eval_input_config(split="validation")
  c.model = "mobilenet_v1"
  c.alpha = 1.0
  c.dropout = 1e-3
  c.bn_momentum = 0.99  # as Keras MobileNet V1 (V2: 0.999)
  c.compute_dtype = "bfloat16"  # params stay float32
  c.batch_size = 4096
  c.num_epochs = 300.0
  c.optimizer = "sgd"  # Nesterov momentum 0.9
  c.learning_rate_per_256 = 0.1  # 1.6 at batch 4096
  c.warmup_epochs = 5.0
  c.weight_decay = 4e-5
  c.label_smoothing = 0.1
  c.log_every = 100
  c.eval_every_epochs = 5.0
  c.checkpoint_every_epochs = 3.0
  return c
