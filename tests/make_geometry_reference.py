"""Records TensorFlow's crop statistics and big_vision's eval pixels for
tests/image/test_geometry.py.

Needs tensorflow (not a test dependency): `python tests/make_geometry_reference.py` rewrites
tests/reference/geometry_reference.json and tests/reference/geometry_eval.npz.

- crops: `tf.image.sample_distorted_bounding_box` as big_vision's `inception_crop` calls it
  (no boxes, min_object_covered=0, max_attempts default 100), DRAWS draws over SHAPES per
  area range: mean crop area share, share under 8%, share of whole-image crops.
- eval: big_vision's `decode|resize_small(R)|central_crop(S)` (TF decode, resize "area"
  without antialias, clip and cast) on JPEGs shipped with scikit-learn and scikit-image.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent / "reference"
SHAPES = [  # (height, width): ImageNet's common shapes and a few others
  (375, 500),
  (500, 375),
  (333, 500),
  (500, 333),
  (500, 500),
  (427, 640),
  (480, 640),
  (640, 480),
  (390, 470),
  (1200, 1600),
  (200, 600),
  (64, 64),
]
AREA_RANGES = [(0.05, 1.0), (0.08, 1.0)]
ASPECT_RANGE = (0.75, 1.33)  # big_vision's decode_jpeg_and_inception_crop default
DRAWS = 36_000
FALLBACK = {"shape": (100, 400), "area_range": (0.9, 1.0), "draws": 500}
EVAL_IMAGES = [  # (package, file, image sizes)
  ("sklearn", "china.jpg", (224, 64)),
  ("sklearn", "flower.jpg", (224, 64)),
  ("skimage", "rocket.jpg", (64,)),
  ("skimage", "hubble_deep_field.jpg", (64,)),
]
CROP_FRACTION = 0.875  # 224 / 256


def image_path(package: str, name: str) -> str:
  if package == "sklearn":
    import sklearn.datasets

    return os.path.join(os.path.dirname(sklearn.datasets.__file__), "images", name)
  import skimage

  return os.path.join(os.path.dirname(skimage.__file__), "data", name)


def tf_crops(tf, shape, area_range, aspect_range, n, seed):
  """n crops (height, width) of an image of `shape` by the stateless sampler (same kernel)."""

  @tf.function
  def draw(seeds):
    def one(s):
      begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.constant([shape[0], shape[1], 3]),
        tf.zeros([0, 0, 4], tf.float32),
        seed=s,
        min_object_covered=0.0,
        area_range=area_range,
        aspect_ratio_range=aspect_range,
        use_image_if_no_bounding_boxes=True,
      )
      return tf.concat([begin[:2], size[:2]], 0)

    return tf.map_fn(one, seeds, fn_output_signature=tf.int32, parallel_iterations=64)

  seeds = np.stack([np.full(n, seed), np.arange(n)], 1).astype(np.int32)
  return draw(tf.constant(seeds)).numpy()  # (n, 4): y, x, h, w


def crop_stats():
  import tensorflow as tf

  per_shape = DRAWS // len(SHAPES)
  out = {
    "shapes": SHAPES,
    "aspect_range": ASPECT_RANGE,
    "draws_per_shape": per_shape,
    "ranges": [],
  }
  for area_range in AREA_RANGES:
    areas, whole, shapes = [], [], {}
    for i, (h, w) in enumerate(SHAPES):
      boxes = tf_crops(tf, (h, w), area_range, ASPECT_RANGE, per_shape, seed=i + 1)
      assert (boxes[:, 0] + boxes[:, 2] <= h).all() and (boxes[:, 1] + boxes[:, 3] <= w).all()
      a = boxes[:, 2] * boxes[:, 3] / (h * w)
      areas.append(a)
      whole.append((boxes[:, 2] == h) & (boxes[:, 3] == w))
      shapes[f"{h}x{w}"] = round(float(a.mean()), 4)
    areas, whole = np.concatenate(areas), np.concatenate(whole)
    out["ranges"].append(
      {
        "area_range": area_range,
        "mean_area": round(float(areas.mean()), 4),
        "share_under_8pct": round(float((areas < 0.08).mean()), 4),
        "share_whole_image": round(float(whole.mean()), 4),
        "mean_area_by_shape": shapes,
      }
    )
  shape, area_range, n = FALLBACK["shape"], FALLBACK["area_range"], FALLBACK["draws"]
  boxes = tf_crops(tf, shape, area_range, ASPECT_RANGE, n, seed=99)
  whole = (boxes == [0, 0, shape[0], shape[1]]).all(1)
  out["fallback"] = dict(FALLBACK, share_whole_image=float(whole.mean()))
  return out


def eval_pixels():
  """big_vision's decode|resize_small(R)|central_crop(S), written out with its TF calls."""
  import tensorflow as tf

  arrays = {}
  for package, name, sizes in EVAL_IMAGES:
    data = open(image_path(package, name), "rb").read()
    image = tf.io.decode_image(data, channels=3, expand_animations=False)
    for size in sizes:
      small = round(size / CROP_FRACTION)
      h, w = tf.shape(image)[0], tf.shape(image)[1]
      factor = tf.cast(small, tf.float32) / tf.cast(tf.minimum(h, w), tf.float32)
      rh = tf.cast(tf.round(tf.cast(h, tf.float32) * factor), tf.int32)
      rw = tf.cast(tf.round(tf.cast(w, tf.float32) * factor), tf.int32)
      resized = tf.image.resize(image, (rh, rw), method="area", antialias=False)
      resized = tf.cast(tf.clip_by_value(resized, 0, 255), tf.uint8)
      dy, dx = (rh - size) // 2, (rw - size) // 2
      crop = tf.image.crop_to_bounding_box(resized, dy, dx, size, size)
      arrays[f"{package}/{name}@{size}"] = crop.numpy()
  return arrays


if __name__ == "__main__":
  HERE.mkdir(exist_ok=True)
  stats = crop_stats()
  (HERE / "geometry_reference.json").write_text(json.dumps(stats, indent=1) + "\n")
  np.savez_compressed(HERE / "geometry_eval.npz", **eval_pixels())
  for r in stats["ranges"]:
    print(r["area_range"], r["mean_area"], r["share_under_8pct"], r["share_whole_image"])
  print("fallback", stats["fallback"])
