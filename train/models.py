"""MobileNet V1 and V2 in Flax NNX, layer for layer as `tf.keras.applications` builds them.

With include_top and 1000 classes at alpha 1.0 they hold exactly Keras' parameter counts
(BatchNorm statistics included): V1 4,253,864, V2 3,538,984. Inputs are NHWC floats in
[-1, 1]; outputs are float32 logits (Keras ends in a softmax, optax losses take logits).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src import core

Dtype = Any

IN_CHANNELS = 3  # RGB, as the Keras models expect.
BN_EPSILON = 1e-3  # Keras BatchNormalization's default; MobileNetV2 also sets it explicitly.
# Keras' initializer for Conv2D, DepthwiseConv2D and Dense kernels (biases start at zero in both).
KERNEL_INIT = nnx.initializers.glorot_uniform()

# MobileNet V1 after the stem: (pointwise filters, stride) of Keras blocks conv_dw_1..13.
V1_BLOCKS: tuple[tuple[int, int], ...] = (
  (64, 1),
  (128, 2),
  (128, 1),
  (256, 2),
  (256, 1),
  (512, 2),
  (512, 1),
  (512, 1),
  (512, 1),
  (512, 1),
  (512, 1),
  (1024, 2),
  (1024, 1),
)

# MobileNet V2 stages: (expansion, filters, repeats, first stride); Keras blocks 0..16.
V2_STAGES: tuple[tuple[int, int, int, int], ...] = (
  (1, 16, 1, 1),
  (6, 24, 2, 2),
  (6, 32, 3, 2),
  (6, 64, 4, 2),
  (6, 96, 3, 1),
  (6, 160, 3, 2),
  (6, 320, 1, 1),
)


def make_divisible(value: float, divisor: int = 8) -> int:
  """Rounds a channel count to a multiple of `divisor`, never down by more than 10%.

  Keras' (and the V2 paper's) `_make_divisible`, so widths match for every alpha.
  """
  rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
  return rounded + divisor if rounded < 0.9 * value else rounded


class ConvBN(nnx.Module):
  """Conv2D without bias, BatchNorm, and an optional ReLU6: the unit both MobileNets repeat."""

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int,
    *,
    strides: int = 1,
    padding: str | Sequence[tuple[int, int]] = "SAME",
    groups: int = 1,
    relu: bool = True,
    momentum: float,
    dtype: Dtype,
    param_dtype: Dtype,
    rngs: nnx.Rngs,
  ):
    self.conv = nnx.Conv(
      in_features,
      out_features,
      (kernel_size, kernel_size),
      strides=strides,
      padding=padding,
      feature_group_count=groups,
      use_bias=False,
      kernel_init=KERNEL_INIT,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.bn = nnx.BatchNorm(
      out_features,
      momentum=momentum,
      epsilon=BN_EPSILON,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.relu = relu

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.bn(self.conv(x))
    return jax.nn.relu6(x) if self.relu else x


class DepthwiseSeparable(nnx.Module):
  """Keras V1 `_depthwise_conv_block`: 3x3 depthwise, then 1x1 pointwise, each BN + ReLU6."""

  def __init__(
    self, in_features: int, out_features: int, *, strides: int, depth_multiplier: int, **kw
  ):
    # Keras pads stride-2 inputs with ZeroPadding2D(((0, 1), (0, 1))) and convolves 'valid'.
    padding = "SAME" if strides == 1 else ((0, 1), (0, 1))
    mid = in_features * depth_multiplier
    self.depthwise = ConvBN(
      in_features, mid, 3, strides=strides, padding=padding, groups=in_features, **kw
    )
    self.pointwise = ConvBN(mid, out_features, 1, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.pointwise(self.depthwise(x))


class MobileNetV1(nnx.Module):
  """MobileNet V1 (Howard et al. 2017) as `tf.keras.applications.MobileNet(include_top=True)`.

  Stem conv, 13 depthwise-separable blocks, global average pool, dropout, 1x1 conv classifier.
  """

  def __init__(
    self,
    num_classes: int,
    *,
    alpha: float = 1.0,
    depth_multiplier: int = 1,
    dropout: float = 1e-3,
    bn_momentum: float = 0.99,
    dtype: Dtype = jnp.float32,
    param_dtype: Dtype = jnp.float32,
    rngs: nnx.Rngs,
  ):
    kw = dict(momentum=bn_momentum, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    width = int(32 * alpha)
    self.stem = ConvBN(IN_CHANNELS, width, 3, strides=2, **kw)
    blocks = []
    for filters, strides in V1_BLOCKS:
      out = int(filters * alpha)
      blocks.append(
        DepthwiseSeparable(width, out, strides=strides, depth_multiplier=depth_multiplier, **kw)
      )
      width = out
    self.blocks = nnx.List(blocks)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    # Keras' "conv_preds": a 1x1 conv with bias on the pooled (N, 1, 1, C) features.
    self.classifier = nnx.Conv(
      width,
      num_classes,
      (1, 1),
      kernel_init=KERNEL_INIT,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.stem(x)
    for block in self.blocks:
      x = block(x)
    x = jnp.mean(x, axis=(1, 2), keepdims=True)
    x = self.classifier(self.dropout(x))
    return x.reshape(x.shape[0], -1).astype(jnp.float32)


class InvertedResidual(nnx.Module):
  """Keras V2 `_inverted_res_block`: 1x1 expand, 3x3 depthwise, linear 1x1 project, skip."""

  def __init__(self, in_features: int, out_features: int, *, expansion: int, strides: int, **kw):
    mid = in_features * expansion
    self.expand = ConvBN(in_features, mid, 1, **kw) if expansion != 1 else None
    # Keras pads stride-2 inputs with `correct_pad` and convolves 'valid'; for a 3x3 kernel
    # and a known input size that is exactly 'SAME' ((0, 1) for even sizes, (1, 1) for odd).
    self.depthwise = ConvBN(mid, mid, 3, strides=strides, groups=mid, **kw)
    self.project = ConvBN(mid, out_features, 1, relu=False, **kw)
    self.residual = in_features == out_features and strides == 1

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.expand(x) if self.expand is not None else x
    y = self.project(self.depthwise(y))
    return x + y if self.residual else y


class MobileNetV2(nnx.Module):
  """MobileNet V2 (Sandler et al. 2018) as `tf.keras.applications.MobileNetV2(include_top=True)`.

  Keras has no dropout; the default 0.2 is the reference training recipe's (0 gives Keras).
  """

  def __init__(
    self,
    num_classes: int,
    *,
    alpha: float = 1.0,
    dropout: float = 0.2,
    bn_momentum: float = 0.999,
    dtype: Dtype = jnp.float32,
    param_dtype: Dtype = jnp.float32,
    rngs: nnx.Rngs,
  ):
    kw = dict(momentum=bn_momentum, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    width = make_divisible(32 * alpha)
    self.stem = ConvBN(IN_CHANNELS, width, 3, strides=2, **kw)
    blocks = []
    for expansion, filters, repeats, first_stride in V2_STAGES:
      out = make_divisible(int(filters * alpha))
      for i in range(repeats):
        strides = first_stride if i == 0 else 1
        blocks.append(InvertedResidual(width, out, expansion=expansion, strides=strides, **kw))
        width = out
    self.blocks = nnx.List(blocks)
    last = make_divisible(1280 * alpha) if alpha > 1.0 else 1280
    self.head = ConvBN(width, last, 1, **kw)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.classifier = nnx.Linear(
      last, num_classes, kernel_init=KERNEL_INIT, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.stem(x)
    for block in self.blocks:
      x = block(x)
    x = jnp.mean(self.head(x), axis=(1, 2))
    return self.classifier(self.dropout(x)).astype(jnp.float32)


def _no_sharding(tracer) -> None:
  raise AttributeError(f"The 'sharding' attribute is not available on {tracer._error_repr()}.")


@contextlib.contextmanager
def quick_tracing() -> Iterator[None]:
  """Traces NNX models in linear time: NNX probes `value.sharding` on every variable it sets,
  and JAX < 0.11 answers a tracer's probe with an error message that walks everything traced
  so far (jax-ml/jax#40041), which made each trace of a MobileNet quadratic (2-2.5x the
  trainer's start-up on 2 cores). Within, the probe raises the same AttributeError, without
  naming where the tracer came from."""
  probe = core.Tracer.sharding
  core.Tracer.sharding = property(_no_sharding)
  try:
    yield
  finally:
    core.Tracer.sharding = probe


MODELS = {"mobilenet_v1": MobileNetV1, "mobilenet_v2": MobileNetV2}


def create_model(
  name: str, num_classes: int, *, alpha: float = 1.0, rngs: nnx.Rngs, **kw
) -> nnx.Module:
  """Builds a model by config name; `dtype`/`param_dtype` may be strings such as "bfloat16".

  Other keywords go to the constructor (depth_multiplier, dropout, bn_momentum). One config
  schema serves both models, so V2 accepts depth_multiplier=1, its only (implicit) value.
  """
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
  if name == "mobilenet_v2" and kw.pop("depth_multiplier", 1) != 1:
    raise ValueError("mobilenet_v2 has no depth multiplier; use depth_multiplier=1")
  for key in ("dtype", "param_dtype"):
    if key in kw:
      kw[key] = jnp.dtype(kw[key])
  return MODELS[name](num_classes, alpha=alpha, rngs=rngs, **kw)


def count_params(model: nnx.Module) -> int:
  """Counts parameters and BatchNorm statistics, the way Keras' `count_params` does."""
  state = nnx.state(model, nnx.Param, nnx.BatchStat)
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state))
