"""A small Flax experiment on the pipeline, outside train/: your own per-image op, mixup and
an extra record feature, with the model and the data position checkpointed together.

    python examples/custom_ops.py DATA_DIR --workdir /tmp/run --steps 200
    python examples/custom_ops.py /tmp/digits --make-digits 600 --steps 200   # no data yet

DATA_DIR is a converted dataset (manifest.json + ArrayRecord shards), e.g. data/digits from
`make data`. Re-running with the same --workdir resumes model, optimizer and data stream.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import grain
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import pipeline


def cutout(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Our own per-image op (Cutout): blank a random square of a quarter of the side."""
  side = max(1, image.shape[0] // 4)
  y, x = rng.integers(0, image.shape[0] - side + 1), rng.integers(0, image.shape[1] - side + 1)
  image = image.copy()
  image[y : y + side, x : x + side] = 0
  return image


class SmallCNN(nnx.Module):
  def __init__(self, num_classes: int, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(3, 16, (3, 3), strides=2, rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
    self.head = nnx.Linear(32, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
    return self.head(x.mean(axis=(1, 2)))


@nnx.jit
def train_step(
  model: SmallCNN, optimizer: nnx.Optimizer, image: jax.Array, label: jax.Array
) -> jax.Array:
  def loss_fn(model):  # mixup made the labels soft: float32[B, num_classes]
    return optax.softmax_cross_entropy(model(image), label).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def correct(model: SmallCNN, image: jax.Array, label: jax.Array, mask: jax.Array) -> jax.Array:
  return (model(image).argmax(-1) == label) & mask


def make_digits(data_dir: pathlib.Path, num_images: int) -> None:
  """Converts scikit-learn's digits (32x32 JPEGs) into an empty or new `data_dir`."""
  from pipeline.convert import builtin, images

  raw = data_dir.parent / f"{data_dir.name}-raw"
  builtin.make_digits(raw, num_images=num_images)
  images.convert(images.Request(raw, data_dir, val_fraction=0.2, seed=0), progress=False)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("data_dir", type=pathlib.Path)
  parser.add_argument("--workdir", type=pathlib.Path, help="checkpoints; resumes from it")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--batch-size", type=int, default=32, help="global batch")
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--log-every", type=int, default=50)
  parser.add_argument(
    "--make-digits",
    type=int,
    metavar="N",
    help="first convert N built-in digit images into DATA_DIR",
  )
  args = parser.parse_args(argv)
  if not (args.data_dir / "manifest.json").exists():
    if not args.make_digits:
      parser.exit(
        2,
        f"error: {args.data_dir}/manifest.json not found: convert a dataset "
        "there first, or pass --make-digits N\n",
      )
    make_digits(args.data_dir, args.make_digits)

  filename = pipeline.Feature("image/filename", dtype="bytes", max_bytes=64)
  common = dict(
    global_batch_size=args.batch_size,
    image_size=args.image_size,
    normalize="minus_one_one",
    features={"filename": filename},
  )
  num_classes = pipeline.load_manifest(args.data_dir).num_classes
  train = pipeline.input(
    args.data_dir,
    "train",
    **common,
    ops=[pipeline.ColorJitter(0.3, 0.3, 0.3), cutout],
    batch_ops=[pipeline.PermutedMixup(0.2, num_classes)],
  )
  val = pipeline.input(args.data_dir, "validation", **common)

  model = SmallCNN(train.num_classes, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  manager = ocp.CheckpointManager(args.workdir.absolute()) if args.workdir else None
  step = 0
  if manager and manager.latest_step() is not None:
    step = manager.latest_step()
    abstract = nnx.state((model, optimizer))
    restored = manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(train)
      ),
    )
    nnx.update((model, optimizer), restored.state)
    print(f"resumed at step {step}")

  while step < args.steps:
    batch = next(train)
    # jit takes arrays: the bytes "filename" entry stays a numpy array on the host.
    loss = train_step(model, optimizer, batch["image"], batch["label"])
    step += 1
    if step % args.log_every == 0 or step == args.steps:
      print(f"step {step}: loss {float(loss):.3f}")

  hits, wrong = 0, []
  for batch in val:  # one pass; the next loop would start another
    ok = np.asarray(correct(model, batch["image"], batch["label"], batch["mask"]))
    hits += int(ok.sum())
    real = np.asarray(batch["mask"])
    wrong += [f.decode() for f in batch["filename"][real & ~ok]]  # host bytes, this process's
  print(
    f"validation accuracy {hits / val.num_examples:.3f} over {val.num_examples} images; "
    f"e.g. wrong: {wrong[:3]}"
  )

  if manager:
    manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(nnx.state((model, optimizer))),
        data=grain.checkpoint.CheckpointSave(train),
      ),
    )
    manager.wait_until_finished()
    manager.close()
  train.close()
  val.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
