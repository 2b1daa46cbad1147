"""big_vision pp strings run by name: the head compiles into the fused head, the rest are ops.

The strings are big_vision's bit_i1k config's, with the number of classes changed to the
test dataset's (4).
"""

import types

import numpy as np
import pytest

import pipeline
from pipeline import pp
from pipeline.pp import ops
from pipeline.pp.randaugment import NAMES, RandAugment
from tests.conftest import assert_same_batches, take

COMMON = '|onehot(4, key="label", key_result="labels")|value_range(-1, 1)|keep("image", "labels")'
BIT_TRAIN = "decode_jpeg_and_inception_crop(224)|flip_lr" + COMMON  # bit_i1k: config.input.pp
BIT_EVAL = "decode|resize_small(256)|central_crop(224)" + COMMON  # bit_i1k: pp_eval


def make(photos_dir, **kw):
  kw.setdefault("batch_size", 4)
  return pipeline.make_dataset(photos_dir, shard_index=0, shard_count=1, **kw)


def test_bit_i1k_train_pp_runs_as_written(photos_dir):
  batch = next(iter(make(photos_dir, pp=BIT_TRAIN)))
  assert set(batch) == {"image", "labels"}
  assert batch["image"].shape == (4, 224, 224, 3) and batch["image"].dtype == np.float32
  assert -1 <= batch["image"].min() < 0 < batch["image"].max() <= 1
  assert batch["labels"].shape == (4, 4) and batch["labels"].dtype == np.float32
  np.testing.assert_array_equal(batch["labels"].sum(1), 1)


def test_bit_i1k_eval_pp_runs_as_written_and_keeps_the_mask(photos_dir):
  batches = list(make(photos_dir, split="validation", batch_size=5, train=False, pp=BIT_EVAL))
  for batch in batches:
    assert set(batch) == {"image", "labels", "mask"}  # keep() never drops the pipeline's mask
    assert batch["image"].shape[1:] == (224, 224, 3) and batch["image"].dtype == np.float32
    assert batch["image"].min() >= -1 and batch["image"].max() <= 1
  assert sum(int(b["mask"].sum()) for b in batches) == 16  # every record once
  plain = list(make(photos_dir, split="validation", batch_size=5, train=False, image_size=224))
  for batch, raw in zip(batches, plain):
    np.testing.assert_array_equal(
      batch["labels"].argmax(1)[batch["mask"]], raw["label"][raw["mask"]]
    )


def test_a_pp_string_with_randaug_gives_the_same_batches_with_any_thread_count(photos_dir):
  vit = "decode_jpeg_and_inception_crop(64)|flip_lr|randaug(2, 15)" + COMMON
  one = take(iter(make(photos_dir, pp=vit, performance={"num_threads": 1})), 3)
  three = take(iter(make(photos_dir, pp=vit, performance={"num_threads": 3})), 3)
  assert_same_batches(one, three)
  plain = take(iter(make(photos_dir, pp=vit.replace("|randaug(2, 15)", ""))), 1)
  assert not np.array_equal(plain[0]["image"], one[0]["image"])  # randaug did something


def test_head_ops_compile_to_the_fused_heads_settings():
  train = pp.compile(BIT_TRAIN, num_classes=4)
  assert train.train and train.image_size == 224
  assert train.augment == {
    "crop": "tf",
    "area_range": (0.05, 1.0),
    "aspect_range": (0.75, 1.33),
    "flip": True,
    "interpolation": "bilinear",
  }
  assert train.image_ops == ()
  assert [type(op).__name__ for op in train.batch_ops] == ["OneHot", "ValueRange", "Keep"]
  custom = pp.compile("decode|inception_crop(160, area_min=20, area_max=90)", num_classes=4)
  assert custom.image_size == 160 and custom.augment["area_range"] == (0.2, 0.9)
  assert custom.augment["flip"] is False  # no flip_lr: no flip
  ev = pp.compile(BIT_EVAL, num_classes=4)
  assert not ev.train and ev.image_size == 224
  assert ev.augment == {"crop_fraction": 224 / 256, "eval_order": "resize_then_crop", "flip": False}
  pipeline.Augment(**train.augment), pipeline.Augment(**ev.augment)  # valid settings


def test_a_pp_string_says_the_size_its_head_makes_or_that_the_dataset_fills_it():
  assert pp.image_size(BIT_TRAIN) == pp.image_size(BIT_EVAL) == 224
  assert pp.image_size("decode|resize_small(36)|central_crop((32, 32))|onehot(num_classes)") == 32
  assert pp.image_size("decode_jpeg_and_inception_crop(image_size)|flip_lr") is None
  assert pp.image_size("decode|resize_small(image_size)|central_crop(image_size)") is None
  with pytest.raises(ValueError, match="does not start with a decode"):
    pp.image_size("flip_lr|value_range(-1, 1)")


def test_vit_i1k_strings_with_randaug_and_an_empty_slot_compile():
  vit = "decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2,15)" + COMMON
  compiled = pp.compile(vit, num_classes=4)
  assert compiled.image_ops == (RandAugment(2, 15),)
  none = "decode_jpeg_and_inception_crop(224)|flip_lr|" + COMMON  # vit_i1k's aug='none'
  assert len(pp.compile(none, num_classes=4).batch_ops) == 3


def test_onehot_must_have_the_datasets_classes_or_say_num_classes():
  with pytest.raises(ValueError, match=r"onehot\(1000\).*1000 classes.*dataset has 4"):
    pp.compile("decode_jpeg_and_inception_crop(224)|onehot(1000)", num_classes=4)
  named = pp.compile("decode_jpeg_and_inception_crop(224)|onehot(num_classes)", num_classes=4)
  assert named.batch_ops == (ops.OneHot(4),)


def test_onehot_on_off_values():
  batch = {"label": np.array([2, 0], np.int32)}
  out = ops.OneHot(3, key_result="labels", on=0.9, off=0.05)(batch, None)
  np.testing.assert_allclose(out["labels"], [[0.05, 0.05, 0.9], [0.9, 0.05, 0.05]])
  assert out["label"] is batch["label"]  # the source stays


def test_keep_keeps_the_named_entries_and_the_mask_and_refuses_missing_ones():
  batch = {"image": np.zeros((2, 1)), "label": np.zeros(2), "id": np.zeros(2), "mask": np.ones(2)}
  assert set(ops.Keep("image")(batch, None)) == {"image", "mask"}
  assert set(ops.Keep("image", "id")({k: batch[k] for k in ("image", "id")}, None)) == {
    "image",
    "id",
  }
  with pytest.raises(ops.OpError, match=r"keep: the batch has no \['labels'\]"):
    ops.Keep("image", "labels")(batch, None)


def test_value_range_is_big_vision_s_affine_map_to_float32():
  x = np.arange(256, dtype=np.uint8).reshape(4, 8, 8, 1).repeat(3, -1)
  out = ops.ValueRange(-1, 1)({"image": x}, None)["image"]
  assert out.dtype == np.float32
  np.testing.assert_allclose(out, x / 127.5 - 1, atol=1e-6)
  op = ops.ValueRange(-1, 1)
  held = [op({"image": x}, None)["image"] for _ in range(6)]  # all held: all distinct
  assert len({id(h) for h in held}) == 6
  for h in held:
    np.testing.assert_allclose(h, x / 127.5 - 1, atol=1e-6)
  zero_one = ops.ValueRange(0, 1, in_min=64, in_max=128, clip_values=True)({"image": x}, None)
  np.testing.assert_allclose(
    zero_one["image"], np.clip((x.astype(float) - 64) / 64, 0, 1), atol=1e-6
  )


def test_randaug_is_a_pure_function_of_the_examples_generator_and_differs_across_examples():
  image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
  op = RandAugment(2, 15)
  run = lambda i: op(image.copy(), ops.example_rng(0, 0, i))
  np.testing.assert_array_equal(run(3), run(3))
  outs = [run(i) for i in range(12)]
  assert len({o.tobytes() for o in outs}) > 6  # different ops, signs and positions
  for o in outs:
    assert o.dtype == np.uint8 and o.shape == image.shape
  with pytest.raises(ops.OpError, match="randaug needs uint8"):
    op(image.astype(np.float32), ops.example_rng(0, 0, 0))


def test_randaug_ops_do_what_their_tf_counterparts_do():
  image = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
  op, rng = RandAugment(1, 10), np.random.default_rng(0)
  np.testing.assert_array_equal(op.apply("Invert", image, rng), 255 - image)
  np.testing.assert_array_equal(op.apply("Posterize", image, rng), image & 0b11110000)
  solarized = np.where(image < 128, np.minimum(image.astype(int) + 110, 255), image)
  np.testing.assert_array_equal(op.apply("SolarizeAdd", image, rng), solarized)
  # Brightness blends toward black by 1.9, truncating as TF's cast.
  np.testing.assert_array_equal(
    op.apply("Brightness", image, rng), np.trunc(np.clip(image * 1.9, 0, 255)).astype(np.uint8)
  )
  low = (image // 3 + 30).astype(np.uint8)  # a narrow range: autocontrast and equalize act
  stretched = op.apply("AutoContrast", low, rng)
  assert stretched.min() == 0 and stretched.max() == 255
  from PIL import Image, ImageOps  # TF's Equalize is a port of PIL's

  want = np.asarray(ImageOps.equalize(Image.fromarray(low)))
  np.testing.assert_array_equal(op.apply("Equalize", low, rng), want)
  np.testing.assert_array_equal(op.apply("Solarize", image, rng), image)  # threshold 256
  shifted = op.apply("TranslateX", image, np.random.default_rng(0))  # 100 px: all grey
  np.testing.assert_array_equal(shifted, 128)
  assert len(NAMES) == 16


def test_big_vision_mixup_matches_a_hand_computation():
  rng_batch = np.random.default_rng(5)
  batch = {
    "image": rng_batch.random((4, 2, 2, 3), dtype=np.float32),
    "labels": np.eye(4, dtype=np.float32)[[0, 1, 2, 3]],
  }
  op = ops.BigVisionMixup(p=0.2)
  out = op(batch, ops.batch_rng(0, 7))
  a = ops.batch_rng(0, 7).beta(0.2, 0.2)
  a = np.float32(max(a, 1 - a))
  for k in ("image", "labels"):
    want = a * batch[k] + (1 - a) * np.roll(batch[k], 1, axis=0)  # partner: the previous row
    np.testing.assert_allclose(out[k], want, rtol=1e-6)
  assert a >= 0.5
  assert ops.BigVisionMixup(p=0.0)(batch, ops.batch_rng(0, 7)) is batch
  with pytest.raises(ops.OpError, match="run onehot first|onehot"):
    op({"image": batch["image"], "labels": np.arange(4)}, ops.batch_rng(0, 0))
  with pytest.raises(ops.OpError, match="mask"):
    op({**batch, "mask": np.ones(4, bool)}, ops.batch_rng(0, 0))


def test_mixup_in_a_pp_string_is_big_vision_s(photos_dir):
  compiled = pp.compile(BIT_TRAIN + "|mixup(p=0.2, fold_in=None)", num_classes=4)
  assert compiled.batch_ops[-1] == ops.BigVisionMixup(p=0.2)
  batch = next(iter(make(photos_dir, pp=BIT_TRAIN + "|mixup(p=1.0)")))
  np.testing.assert_allclose(batch["labels"].sum(1), 1, rtol=1e-6)
  top = batch["labels"].max(1)  # a = max(a, 1 - a) >= 0.5 for each row's own label
  assert top.min() >= 0.5 and top.min() < 1  # mixed with the row before


def test_image_ops_see_label_and_requested_features(tmp_path, write_dataset):
  from tensorflow_datasets.proto import tf_example_pb2

  from pipeline.catalog import records

  recs = []
  for i in range(8):
    jpeg = _jpeg(i)
    example = tf_example_pb2.Example.FromString(records.encode(jpeg, i % 2))
    example.features.feature["image/id"].int64_list.value.append(100 + i)
    recs.append(example.SerializeToString())
  data = write_dataset(tmp_path / "ids", recs)

  def stamp(image, rng, example):
    assert isinstance(example, types.MappingProxyType)  # read-only
    image[0, 0, 0] = example["label"]
    image[0, 0, 1] = int(example["id"]) - 100
    return image

  assert ops.takes_example(stamp) and not ops.takes_example(lambda image, rng: image)
  batches = list(
    pipeline.make_dataset(
      data,
      batch_size=4,
      train=False,
      image_size=16,
      shard_index=0,
      shard_count=1,
      ops=[stamp],
      features={"id": "image/id"},
    )
  )
  for b in batches:
    np.testing.assert_array_equal(b["image"][:, 0, 0, 0], b["label"])
    np.testing.assert_array_equal(b["image"][:, 0, 0, 1], b["id"] - 100)


def _jpeg(i: int) -> bytes:
  import cv2

  image = np.full((24, 24, 3), 40 * (i % 6), np.uint8)
  return cv2.imencode(".jpg", image)[1].tobytes()


def test_batch_ops_may_drop_any_entry_but_the_mask():
  batch = {"image": np.zeros((2, 1)), "label": np.zeros(2), "mask": np.ones(2, bool)}
  drop_label = lambda b, rng: {k: v for k, v in b.items() if k != "label"}
  assert set(ops.apply_batch([drop_label], batch, None)) == {"image", "mask"}
  drop_mask = lambda b, rng: {"image": b["image"]}
  with pytest.raises(ops.OpError, match="dropped the 'mask' entry"):
    ops.apply_batch([drop_mask], batch, None)
  train = {"image": np.zeros((2, 1)), "label": np.zeros(2)}  # train batches have no mask
  assert set(ops.apply_batch([drop_mask], train, None)) == {"image"}


def test_an_eval_pp_string_cannot_overwrite_the_padding_mask(photos_dir):
  head = "decode|resize_small(72)|central_crop(64)|"
  for op in ("onehot(4, key_result='mask')", "value_range(0, 1, key='image', key_result='mask')"):
    with pytest.raises(ValueError, match=r"^pp: op .* writes the 'mask' entry") as e:
      make(photos_dir, split="validation", batch_size=5, train=False, pp=head + op)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "op, verb",
  [
    (lambda b, rng: {**b, "mask": np.ones_like(b["mask"])}, "replaced"),
    (lambda b, rng: b["mask"].fill(True) or b, "wrote into"),
  ],
)
def test_a_batch_op_cannot_change_the_padding_mask(op, verb):
  mask = np.array([True, False])
  batch = {"image": np.zeros((2, 1)), "mask": mask}
  with pytest.raises(ops.OpError, match=f"{verb} the 'mask' entry"):
    ops.apply_batch([op], batch, None)
  np.testing.assert_array_equal(mask, [True, False])
  reads = lambda b, rng: {**b, "image": b["image"] * b["mask"][:, None]}  # reading is fine
  assert ops.apply_batch([reads], batch, None)["mask"] is mask


def test_the_reused_generator_draws_exactly_the_examples_stream():
  want = ops.example_rng(3, 1, 7).integers(0, 2**62, 6)
  ops.reused_example_rng(3, 1, 8).random(5)  # whatever came before on this thread
  np.testing.assert_array_equal(ops.reused_example_rng(3, 1, 7).integers(0, 2**62, 6), want)


def test_pp_errors_are_one_clear_line(photos_dir):
  bad = {
    "flip_lr|decode": "does not start with a decode",
    "decode_jpeg_and_inception_crop(224)|value_range(-1, 1)|flip_lr": (
      r"head op 'flip_lr' comes after 'value_range\(-1, 1\)'"
    ),
    "decode_jpeg_and_inception_crop(224)|nope(3)": r"unknown op 'nope'.*registered: \[",
    "decode_jpeg_and_inception_crop(224)|value_range|randaug(2, 15)": "image op 'randaug",
    "decode|central_crop(224)": "not one the fused head runs",
    "decode_jpeg_and_inception_crop(224)|keep(image)": "cannot read op",
  }
  for text, message in bad.items():
    with pytest.raises(ValueError, match=message):
      pp.compile(text, num_classes=4)
  with pytest.raises(ValueError, match="either pp= or ops="):
    make(photos_dir, pp=BIT_TRAIN, batch_ops="mixup(0.2)")
  with pytest.raises(ValueError, match="eval.*train=True: pass train=False"):
    make(photos_dir, pp=BIT_EVAL)
  with pytest.raises(ValueError, match="image_size=160 but pp"):
    make(photos_dir, pp=BIT_TRAIN, image_size=160)
  with pytest.raises(ValueError, match=r"augment.area_range=\(0.2, 1.0\) conflicts with pp"):
    make(photos_dir, pp=BIT_TRAIN, augment={"area_range": (0.2, 1.0)})
  with pytest.raises(ValueError, match="runs 'mixup.p=0.2.', registered for training batches only"):
    make(photos_dir, split="validation", train=False, pp=BIT_EVAL + "|mixup(p=0.2)")
  with pytest.raises(ValueError, match="augment.crop must be one of"):
    pipeline.Augment(crop="timm")
