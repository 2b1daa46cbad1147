"""ImageNet, MobileNet V2 (alpha 1.0) at 224: V1's recipe with V2's dropout (0.2) and
BatchNorm momentum (0.999), as Keras builds it."""

from configs import imagenet_mobilenet_v1


def get_config():
  c = imagenet_mobilenet_v1.get_config()
  c.model = "mobilenet_v2"
  c.dropout = 0.2
  c.bn_momentum = 0.999
  return c
