"""Records the Flax ImageNet example's crops and eval pixels, made by TensorFlow, for
tests/image/test_flax_recipe.py.

Needs tensorflow (not a test dependency): `python tests/make_flax_reference.py` rewrites
tests/reference/flax_reference.json and tests/reference/flax_eval.npz. The functions below are
flax/examples/imagenet/input_pipeline.py's, written out with the same TF calls:

- train: `sample_distorted_bounding_box` as `_decode_and_random_crop` calls it (the whole image
  as its one box, min_object_covered=0.1, area (0.08, 1), aspect (3/4, 4/3), 10 attempts),
  DRAWS boxes (y, x, h, w) per shape of `make_geometry_reference.SHAPES`;
- eval boxes: `_decode_and_center_crop`'s window (float32 side, truncated; offset rounded up)
  for BOX_SHAPES at each of BOX_SIZES;
- eval pixels: `_decode_and_center_crop` at 224 px (TF's decode, fast IDCT by default, then
  `tf.image.resize` bicubic), rounded and clipped to uint8, every STRIDE-th row and column
  (the whole images would be 150 KB each), of the JPEGs in tests/reference/batches and of
  those scikit-learn and scikit-image ship (`EVAL_IMAGES`).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from tests import make_geometry_reference as geometry

HERE = pathlib.Path(__file__).resolve().parent / "reference"
CROP_PADDING = 32  # the example's
MIN_OBJECT_COVERED, AREA_RANGE, ASPECT_RANGE, MAX_ATTEMPTS = 0.1, (0.08, 1.0), (3 / 4, 4 / 3), 10
DRAWS = 2_000
BOX_SIZES = (224, 160, 64)
BOX_SHAPES = [(h, w) for h in range(150, 700, 37) for w in range(150, 700, 53)]
STRIDE = 4
EVAL_SIZE = 224
EVAL_IMAGES = [("sklearn", "china.jpg"), ("sklearn", "flower.jpg"), ("skimage", "rocket.jpg")]


def eval_jpegs() -> dict[str, bytes]:
  """{name: JPEG bytes}: the photos of tests/reference/batches (not its 32 px digits) and
  EVAL_IMAGES."""
  out = {}
  for path in sorted((HERE / "batches").glob("*/*.jpg")):
    if not path.name.startswith("digit"):
      out[f"batches/{path.parent.name}/{path.name}"] = path.read_bytes()
  for package, name in EVAL_IMAGES:
    out[f"{package}/{name}"] = pathlib.Path(geometry.image_path(package, name)).read_bytes()
  return out


def train_boxes(tf, shape, n, seed) -> np.ndarray:
  """n boxes (y, x, h, w) of `_decode_and_random_crop`'s sampler on an image of `shape` (the
  stateless sampler: the same kernel, GenerateRandomCrop and the overlap check)."""

  @tf.function
  def draw(seeds):
    def one(s):
      begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.constant([shape[0], shape[1], 3]),
        tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, shape=[1, 1, 4]),
        seed=s,
        min_object_covered=MIN_OBJECT_COVERED,
        aspect_ratio_range=ASPECT_RANGE,
        area_range=AREA_RANGE,
        max_attempts=MAX_ATTEMPTS,
        use_image_if_no_bounding_boxes=True,
      )
      return tf.concat([begin[:2], size[:2]], 0)

    return tf.map_fn(one, seeds, fn_output_signature=tf.int32, parallel_iterations=64)

  seeds = np.stack([np.full(n, seed), np.arange(n)], 1).astype(np.int32)
  return draw(tf.constant(seeds)).numpy()


def center_window(tf, height, width, image_size):
  """`_decode_and_center_crop`'s crop window (offset_y, offset_x, side), as the example
  computes it."""
  padded_center_crop_size = tf.cast(
    ((image_size / (image_size + CROP_PADDING)) * tf.cast(tf.minimum(height, width), tf.float32)),
    tf.int32,
  )
  offset_height = ((height - padded_center_crop_size) + 1) // 2
  offset_width = ((width - padded_center_crop_size) + 1) // 2
  return offset_height, offset_width, padded_center_crop_size


def decode_and_center_crop(tf, image_bytes, image_size):
  """The example's `_decode_and_center_crop`: its window decoded, then `_resize` (bicubic)."""
  shape = tf.io.extract_jpeg_shape(image_bytes)
  y, x, side = center_window(tf, shape[0], shape[1], image_size)
  image = tf.io.decode_and_crop_jpeg(image_bytes, tf.stack([y, x, side, side]), channels=3)
  return tf.image.resize([image], [image_size, image_size], method="bicubic")[0]


def main() -> None:
  import tensorflow as tf

  boxes = {}
  for i, (h, w) in enumerate(geometry.SHAPES):
    b = train_boxes(tf, (h, w), DRAWS, seed=i + 1)
    assert (b[:, 0] + b[:, 2] <= h).all() and (b[:, 1] + b[:, 3] <= w).all()
    boxes[f"train/{h}x{w}"] = b.astype(np.int16)
  windows = []
  for size in BOX_SIZES:
    for h, w in BOX_SHAPES:
      y, x, side = center_window(tf, tf.constant(h), tf.constant(w), size)
      windows.append([h, w, size, int(y), int(x), int(side)])
  pixels = {}
  for name, data in eval_jpegs().items():
    image = decode_and_center_crop(tf, tf.constant(data), EVAL_SIZE).numpy()
    pixels[f"eval/{name}"] = np.clip(np.rint(image), 0, 255).astype(np.uint8)[::STRIDE, ::STRIDE]
  np.savez_compressed(HERE / "flax_eval.npz", **boxes, **pixels)
  shares = [
    b[:, 2].astype(int) * b[:, 3] / (h * w) for (h, w), b in zip(geometry.SHAPES, boxes.values())
  ]
  shares = np.concatenate(shares)
  summary = {
    "tensorflow": tf.__version__,
    "center_windows": {"columns": ["h", "w", "image_size", "y", "x", "side"], "rows": windows},
    "train": {
      "draws_per_shape": DRAWS,
      "share_under_10pct": round(float((shares < 0.1).mean()), 4),
      "share_whole_image": round(float((shares == 1).mean()), 4),
      "mean_area": round(float(shares.mean()), 4),
    },
  }
  (HERE / "flax_reference.json").write_text(json.dumps(summary) + "\n")
  print(summary["train"], len(pixels), "eval images")


if __name__ == "__main__":
  main()
