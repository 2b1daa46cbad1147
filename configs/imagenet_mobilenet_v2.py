"""ImageNet, MobileNet V2 (alpha 1.0) at 224: V1's recipe with V2's weight decay."""

from configs import imagenet_mobilenet_v1


def get_config():
  c = imagenet_mobilenet_v1.get_config()
  c.model = "mobilenet_v2"
  c.dropout = 0.2
  c.bn_momentum = 0.999
  c.weight_decay = 4e-5
  return c
