"""The Flax ImageNet example (flax/examples/imagenet/train.py) ported onto `pipeline.input`: its
pmap steps and loops as written there, its tf.data input_pipeline.py replaced by the settings
docs/RECIPES.md gives for it (the same crops, TF's eval window, the fast IDCT); a small CNN
stands in for the ResNet so that it runs anywhere.

    python examples/flax_imagenet.py DATA_DIR --epochs 2 --batch-size 64
    python examples/flax_imagenet.py /tmp/digits --make-digits 600   # no data yet

What changes in the example's train.py: `create_input_iter` (below), `steps_per_eval` (the eval
stream's `steps_per_epoch`: its last batch is padded, not dropped) and the eval metrics, which
count only the rows of `mask` (padded rows have label -1: a one-hot of zeros and never a correct
prediction, but still rows of the mean).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import optax
from flax import jax_utils
from flax import linen as nn
from flax.training import common_utils, train_state

import pipeline

# input_pipeline.py's preprocess_for_train / preprocess_for_eval, as pipeline settings
TRAIN_AUGMENT = dict(
  crop="tf", area_range=(0.08, 1.0), aspect_range=(3 / 4, 4 / 3), min_object_covered=0.1
)
EVAL_AUGMENT = dict(crop_padding=32)
COMMON = dict(
  normalize="imagenet",  # (pixels - MEAN_RGB) / STDDEV_RGB, on the devices
  layout="pmap",  # [local devices, rows per device, ...] as the example's prepare_tf_data
  decoding=dict(fast_dct=True),  # tf.io.decode_and_crop_jpeg's default IDCT
)


def create_input_iter(data_dir, split, batch_size, image_size, dtype, train):
  """The example's create_input_iter: repeat=True lets its eval loop call next() a fixed
  number of times per evaluation, a whole pass each time."""
  augment = TRAIN_AUGMENT if train else EVAL_AUGMENT
  return pipeline.input(
    data_dir,
    split,
    global_batch_size=batch_size,
    train=train,
    image_size=image_size,
    dtype=dtype,
    augment=dict(augment, interpolation="bicubic"),  # the example's _resize
    repeat=not train,
    **COMMON,
  )


class CNN(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(x))
    x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))
    return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


def cross_entropy_loss(logits, labels):
  one_hot_labels = common_utils.onehot(labels, num_classes=logits.shape[-1])
  return optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)


def train_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["image"])
    return cross_entropy_loss(logits, batch["label"]).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=jax.lax.pmean(grads, axis_name="batch"))
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  return state, jax.lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name="batch")


def eval_step(state, batch):
  """The example's compute_metrics, summed over the rows of `mask` (the port's change)."""
  logits = state.apply_fn({"params": state.params}, batch["image"])
  mask = batch["mask"].astype(jnp.float32)
  metrics = {
    "loss": jnp.sum(cross_entropy_loss(logits, batch["label"]) * mask),
    "correct": jnp.sum((jnp.argmax(logits, -1) == batch["label"]) * mask),
    "count": jnp.sum(mask),
  }
  return jax.lax.psum(metrics, axis_name="batch")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("data_dir", type=pathlib.Path)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=64, help="global batch")
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--make-digits", type=int, metavar="N", help="first convert N digits")
  args = parser.parse_args(argv)
  if not (args.data_dir / "manifest.json").exists():
    if not args.make_digits:
      parser.exit(2, f"error: {args.data_dir}/manifest.json not found: pass --make-digits N\n")
    from pipeline.convert import builtin, images

    raw = args.data_dir.parent / f"{args.data_dir.name}-raw"
    builtin.make_digits(raw, num_images=args.make_digits)
    images.convert(images.Request(raw, args.data_dir, val_fraction=0.2, seed=0), progress=False)

  make = functools.partial(create_input_iter, args.data_dir, batch_size=args.batch_size)
  train_iter = make("train", image_size=args.image_size, dtype=jnp.float32, train=True)
  eval_iter = make("validation", image_size=args.image_size, dtype=jnp.float32, train=False)
  steps_per_epoch = train_iter.steps_per_epoch
  steps_per_eval = eval_iter.steps_per_epoch  # the example: examples // batch_size (dropped)

  model = CNN(train_iter.num_classes)
  shape = (1, args.image_size, args.image_size, 3)
  params = model.init(jax.random.key(0), jnp.ones(shape))["params"]
  tx = optax.sgd(optax.cosine_decay_schedule(0.1, steps_per_epoch * args.epochs), 0.9)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  state = jax_utils.replicate(state)
  p_train_step = jax.pmap(train_step, axis_name="batch")
  p_eval_step = jax.pmap(eval_step, axis_name="batch")

  for step, batch in zip(range(steps_per_epoch * args.epochs), train_iter):
    state, metrics = p_train_step(state, batch)
    if (step + 1) % steps_per_epoch == 0:
      epoch = step // steps_per_epoch
      totals = []
      for _ in range(steps_per_eval):
        totals.append(jax_utils.unreplicate(p_eval_step(state, next(eval_iter))))
      total = jax.tree_util.tree_map(lambda *x: float(sum(x)), *totals)
      print(
        f"epoch {epoch}: train loss {float(metrics['loss'][0]):.4f}, eval loss "
        f"{total['loss'] / total['count']:.4f}, accuracy "
        f"{100 * total['correct'] / total['count']:.2f} over {int(total['count'])} images"
      )
  train_iter.close()
  eval_iter.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
