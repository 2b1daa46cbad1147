"""MobileNet V1/V2: Keras' parameter counts and BatchNorm settings, shapes, modes, training.

Shape and count checks trace the models abstractly (`nnx.eval_shape`), so every alpha is
cheap; behaviour runs alpha 0.25 models on 32x32 images, compiled step by step (`make
test-slow`). The slowest loads Keras' weights and compares outputs, when TensorFlow (the
`peers` extra) is installed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from train import models

# `tf.keras.applications.MobileNet / MobileNetV2(weights=None).count_params()`, TF 2.21:
# 1000 classes, parameters plus BatchNorm moving mean and variance.
KERAS_PARAM_COUNTS = [
  ("mobilenet_v1", 0.25, 475_544),
  ("mobilenet_v1", 0.5, 1_342_536),
  ("mobilenet_v1", 0.75, 2_601_976),
  ("mobilenet_v1", 1.0, 4_253_864),
  ("mobilenet_v2", 0.25, 1_529_768),
  ("mobilenet_v2", 0.5, 1_987_224),
  ("mobilenet_v2", 0.75, 2_663_064),
  ("mobilenet_v2", 1.0, 3_538_984),
  ("mobilenet_v2", 1.4, 6_156_712),  # alpha > 1 also widens the last 1x1 conv
]


def images(batch: int = 2, size: int = 32, seed: int = 0) -> jax.Array:
  return jax.random.uniform(jax.random.key(seed), (batch, size, size, 3), minval=-1, maxval=1)


@nnx.jit
def forward(model: nnx.Module, x: jax.Array) -> jax.Array:
  return model(x)


def load_keras_weights(keras_model, model: nnx.Module) -> None:
  """Copies a Keras MobileNet's weights into ours: layers with weights pair up in order."""
  units = [model.stem]
  for block in model.blocks:
    names = (
      ("depthwise", "pointwise")
      if hasattr(block, "pointwise")
      else ("expand", "depthwise", "project")
    )
    units += [getattr(block, n) for n in names if getattr(block, n) is not None]
  units += [model.head] if hasattr(model, "head") else []
  layers = [layer for layer in keras_model.layers if layer.get_weights()]
  assert len(layers) == 2 * len(units) + 1
  for unit, conv, bn in zip(units, layers[0:-1:2], layers[1:-1:2]):
    (kernel,) = conv.get_weights()  # a depthwise (3, 3, C, 1) kernel is our (3, 3, 1, C)
    unit.conv.kernel[...] = jnp.asarray(kernel).reshape(unit.conv.kernel.shape)
    for variable, value in zip(
      (unit.bn.scale, unit.bn.bias, unit.bn.mean, unit.bn.var), bn.get_weights()
    ):
      variable[...] = jnp.asarray(value)
  kernel, bias = layers[-1].get_weights()
  model.classifier.kernel[...] = jnp.asarray(kernel).reshape(model.classifier.kernel.shape)
  model.classifier.bias[...] = jnp.asarray(bias)


@pytest.fixture(scope="module")
def small_models() -> dict[str, nnx.Module]:
  """One alpha-0.25, 10-class model per architecture, built once; tests work on clones.

  Eager init compiles a sampler per kernel shape; an "rbg" key compiles in half threefry's time.
  """
  return {
    name: models.create_model(
      name, 10, alpha=0.25, dropout=0.0, rngs=nnx.Rngs(jax.random.key(0, impl="rbg"))
    )
    for name in models.MODELS
  }


@pytest.mark.parametrize("name, alpha, keras_count", KERAS_PARAM_COUNTS)
def test_parameter_count_and_output_shape_match_keras(name, alpha, keras_count):
  def build_and_apply():
    model = models.create_model(name, 1000, alpha=alpha, rngs=nnx.Rngs(0))
    model.eval()  # same shapes as train mode; tracing its statistic updates is slow in flax 0.12
    return model, model(images())

  model, logits = nnx.eval_shape(build_and_apply)
  assert models.count_params(model) == keras_count
  assert logits.shape == (2, 1000) and logits.dtype == jnp.float32


def test_depth_multiplier_widens_v1_depthwise_convs_as_keras():
  model = nnx.eval_shape(
    lambda: models.create_model("mobilenet_v1", 10, alpha=0.5, depth_multiplier=2, rngs=nnx.Rngs(0))
  )
  assert models.count_params(model) == 1_651_802  # Keras, same arguments
  assert model.blocks[0].depthwise.conv.kernel.shape == (3, 3, 1, 32)


@pytest.mark.parametrize("name, momentum", [("mobilenet_v1", 0.99), ("mobilenet_v2", 0.999)])
def test_batchnorm_settings_are_keras(name, momentum):
  model = nnx.eval_shape(lambda: models.create_model(name, 10, rngs=nnx.Rngs(0)))
  norms = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.BatchNorm)]
  assert len(norms) == {"mobilenet_v1": 27, "mobilenet_v2": 52}[name]
  assert {(bn.epsilon, bn.momentum) for bn in norms} == {(1e-3, momentum)}


def test_unknown_model_name_is_rejected_with_the_choices():
  with pytest.raises(ValueError, match="mobilenet_v1.*mobilenet_v2"):
    models.create_model("resnet50", 10, rngs=nnx.Rngs(0))


def test_v2_takes_the_shared_config_but_no_real_depth_multiplier():
  def build(depth_multiplier: int) -> nnx.Module:
    return models.create_model(
      "mobilenet_v2", 10, depth_multiplier=depth_multiplier, rngs=nnx.Rngs(0)
    )

  assert models.count_params(nnx.eval_shape(lambda: build(1))) == 2_270_794  # Keras, 10 classes
  with pytest.raises(ValueError, match="depth multiplier"):
    build(2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_eval_mode_is_deterministic_and_leaves_statistics_alone(small_models, name):
  model = nnx.clone(small_models[name])
  model.eval()
  before = jax.tree.map(np.array, nnx.state(model, nnx.BatchStat))
  x = images()
  first, second = forward(model, x), forward(model, x)
  assert first.shape == (2, 10)
  np.testing.assert_array_equal(first, second)
  jax.tree.map(np.testing.assert_array_equal, before, nnx.state(model, nnx.BatchStat))


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params_and_logits(small_models):
  reference = nnx.clone(small_models["mobilenet_v2"])
  model = nnx.eval_shape(
    lambda: models.create_model(
      "mobilenet_v2", 10, alpha=0.25, dropout=0.0, dtype="bfloat16", rngs=nnx.Rngs(0)
    )
  )
  state = nnx.state(model, nnx.Param, nnx.BatchStat)
  assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}
  nnx.update(model, nnx.state(reference))  # the same float32 weights in both
  reference.eval()
  model.eval()
  x = images()
  expected, logits = forward(reference, x), forward(model, x)
  assert logits.dtype == jnp.float32
  assert not np.array_equal(logits, expected)  # the convolutions really ran in bfloat16
  np.testing.assert_allclose(logits, expected, rtol=0.1, atol=0.05 * np.abs(expected).max())


@pytest.mark.slow
@pytest.mark.parametrize("name, momentum", [("mobilenet_v1", 0.99), ("mobilenet_v2", 0.999)])
def test_one_adam_step_reduces_the_loss_and_moves_statistics_as_keras(small_models, name, momentum):
  model = nnx.clone(small_models[name])
  model.train()
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  x = images(batch=8)
  labels = jnp.arange(8) % 10
  old_mean = np.array(model.stem.bn.mean[...])
  batch_mean = np.asarray(model.stem.conv(x).mean(axis=(0, 1, 2)))

  @nnx.jit
  def train_step(model, optimizer, x, labels):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  before = train_step(model, optimizer, x, labels)
  # Keras and Flax agree: running = momentum * running + (1 - momentum) * batch statistic.
  np.testing.assert_allclose(
    model.stem.bn.mean[...],
    momentum * old_mean + (1 - momentum) * batch_mean,
    rtol=1e-5,
    atol=1e-7,
  )
  after = train_step(model, optimizer, x, labels)  # the loss the first step left behind
  assert np.isfinite(before) and after < before - 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_outputs_and_statistics_match_keras_with_the_same_weights(small_models, name):
  tf = pytest.importorskip("tensorflow")
  build = {
    "mobilenet_v1": tf.keras.applications.MobileNet,
    "mobilenet_v2": tf.keras.applications.MobileNetV2,
  }[name]
  extra = {"dropout": 0.0} if name == "mobilenet_v1" else {}
  # 34x34 makes the first stride-2 depthwise input odd (17x17), where V1's fixed
  # ((0, 1), (0, 1)) padding and V2's `correct_pad` ((1, 1), (1, 1)) part ways.
  keras_model = build(
    input_shape=(34, 34, 3),
    alpha=0.25,
    weights=None,
    classes=10,
    classifier_activation=None,
    **extra,
  )
  rng = np.random.default_rng(0)
  for layer in keras_model.layers:  # random BatchNorm weights and statistics, not 1 and 0
    if isinstance(layer, tf.keras.layers.BatchNormalization):
      layer.set_weights(
        [
          rng.uniform(0.5, 1.5, w.shape) if i in (0, 3) else rng.normal(0, 0.2, w.shape)
          for i, w in enumerate(layer.get_weights())
        ]
      )
  model = nnx.clone(small_models[name])
  load_keras_weights(keras_model, model)
  x = np.asarray(images(batch=4, size=34))

  model.eval()
  expected = keras_model(x, training=False).numpy()
  np.testing.assert_allclose(forward(model, x), expected, atol=1e-5 * np.abs(expected).max())
  model.train()
  expected = keras_model(x, training=True).numpy()  # batch statistics; moves Keras' means
  np.testing.assert_allclose(forward(model, x), expected, atol=1e-4 * np.abs(expected).max())
  keras_stem_bn = next(
    layer for layer in keras_model.layers if isinstance(layer, tf.keras.layers.BatchNormalization)
  )
  np.testing.assert_allclose(
    model.stem.bn.mean[...], keras_stem_bn.moving_mean.numpy(), rtol=1e-5, atol=1e-6
  )
