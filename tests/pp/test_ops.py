"""Preprocessing ops: per-example generators, the op contract, colour jitter, mixup, names."""

import concurrent.futures
import multiprocessing
import pickle

import cloudpickle
import numpy as np
import pytest

from pipeline import pp
from pipeline.pp import ops, registry


def photo(index: int, size: int = 24) -> np.ndarray:
  """A colourful uint8 image that differs per index."""
  rng = np.random.default_rng(index)
  return rng.integers(0, 256, (size, size, 3), dtype=np.uint8)


def jittered(op, index: int, seed: int = 0, epoch: int = 0) -> np.ndarray:
  return ops.apply([op], photo(index), ops.example_rng(seed, epoch, index))


def test_an_examples_generator_depends_only_on_seed_epoch_and_index():
  draws = lambda s, e, i: ops.example_rng(s, e, i).integers(0, 2**62, 4).tolist()
  assert draws(3, 1, 7) == draws(3, 1, 7)
  others = {str(draws(4, 1, 7)), str(draws(3, 2, 7)), str(draws(3, 1, 8)), str(draws(3, 1, 7))}
  assert len(others) == 4
  # The image ops' and batch ops' streams differ even for equal numbers.
  assert draws(3, 0, 7) != ops.batch_rng(3, 7).integers(0, 2**62, 4).tolist()
  assert ops.batch_rng(3, 7).random() == ops.batch_rng(3, 7).random()
  with pytest.raises(ValueError, match="seed must be in"):
    ops.example_rng(-1, 0, 0)


def test_color_jitter_is_deterministic_across_threads_calls_and_resume_points():
  op = ops.ColorJitter(0.4, 0.4, 0.4, 0.1)
  in_order = [jittered(op, i) for i in range(16)]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:  # any thread, any order
    shuffled = list(pool.map(lambda i: (i, jittered(op, i)), [5, 3, 15, 0, *range(16)]))
  for i, image in shuffled:
    np.testing.assert_array_equal(image, in_order[i])
  resumed = [jittered(op, i) for i in range(8, 16)]  # a run that starts at example 8
  for got, want in zip(resumed, in_order[8:]):
    np.testing.assert_array_equal(got, want)
  assert not np.array_equal(in_order[0], photo(0))  # it does change images
  assert not np.array_equal(jittered(op, 0, epoch=1), in_order[0])  # anew each epoch


def run_pickled(payload: bytes, index: int) -> np.ndarray:
  op = cloudpickle.loads(payload)
  return ops.apply([op], photo(index), ops.example_rng(0, 0, index))


def test_ops_give_the_same_images_in_a_worker_process():
  lambda_op = lambda image, rng: np.roll(image, int(rng.integers(0, 5)), axis=0)
  assert pickle.loads(pickle.dumps(ops.ColorJitter(0.3))) == ops.ColorJitter(0.3)
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
    for op in (ops.ColorJitter(0.3, 0.3, 0.3, 0.05), lambda_op):
      got = pool.submit(run_pickled, cloudpickle.dumps(op), 4).result(timeout=120)
      np.testing.assert_array_equal(got, ops.apply([op], photo(4), ops.example_rng(0, 0, 4)))


def test_color_jitter_brightness_scales_pixels_by_its_drawn_factor():
  op = ops.ColorJitter(brightness=0.5, contrast=0, saturation=0, hue=0)
  factor = ops.example_rng(0, 0, 2).uniform(0.5, 1.5)  # its first draw
  expected = np.clip(np.rint(photo(2).astype(np.float32) * factor), 0, 255)
  np.testing.assert_allclose(jittered(op, 2), expected, atol=1)


def test_color_jitter_leaves_grey_pixels_grey_under_saturation_and_hue():
  grey = np.repeat(np.arange(0, 256, 4, dtype=np.uint8)[:, None, None], 3, axis=2)
  grey = np.repeat(grey, 4, axis=1)
  op = ops.ColorJitter(brightness=0, contrast=0, saturation=0.9, hue=0.5)
  out = ops.apply([op], grey, ops.example_rng(0, 0, 0))
  assert out.dtype == np.uint8 and out.shape == grey.shape
  np.testing.assert_allclose(out, grey, atol=1)


def test_color_jitter_with_everything_off_returns_the_image():
  np.testing.assert_array_equal(jittered(ops.ColorJitter(0, 0, 0, 0), 1), photo(1))


def test_color_jitter_refuses_what_it_cannot_jitter():
  with pytest.raises(ops.OpError, match=r"uint8 HxWx3.*float32\[4, 4, 3\]"):
    ops.apply([ops.ColorJitter()], np.zeros((4, 4, 3), np.float32), ops.example_rng(0, 0, 0))
  with pytest.raises(ValueError, match="hue must be <= 0.5"):
    ops.ColorJitter(hue=0.7)


def test_ops_run_in_order_and_may_change_shape_and_dtype():
  crop = lambda image, rng: image[:8, :8]
  scale = lambda image, rng: image.astype(np.float32) / 255
  out = ops.apply([crop, scale], photo(0), ops.example_rng(0, 0, 0))
  assert out.shape == (8, 8, 3) and out.dtype == np.float32
  np.testing.assert_array_equal(out, photo(0)[:8, :8] / np.float32(255))


def test_an_op_that_returns_no_array_is_named():
  def in_place(image, rng):
    image[:] = 0

  with pytest.raises(ops.OpError, match="in_place returned NoneType"):
    ops.apply([in_place], photo(0), ops.example_rng(0, 0, 0))


def batch_of(rows: int, num_classes: int, mask=None) -> dict:
  """Row i: every pixel 10 * i, label i."""
  batch = {
    "image": np.repeat(np.arange(rows, dtype=np.uint8)[:, None, None, None] * 10, 4, axis=1)
    .repeat(4, axis=2)
    .repeat(3, axis=3),
    "label": np.arange(rows, dtype=np.int32) % num_classes,
  }
  if mask is not None:
    batch["mask"] = np.array(mask, bool)
  return batch


def test_mixup_mixes_each_row_with_one_partner_by_one_weight_and_softens_labels():
  out = ops.apply_batch(
    [ops.PermutedMixup(alpha=0.4, num_classes=8)], batch_of(8, 8), ops.batch_rng(0, 3)
  )
  assert out["label"].shape == (8, 8) and out["label"].dtype == np.float32
  np.testing.assert_allclose(out["label"].sum(1), 1, rtol=1e-6)
  assert out["image"].dtype == np.uint8 and out["image"].shape == (8, 4, 4, 3)
  weights = set()
  partners = []
  for i, soft in enumerate(out["label"]):
    lam = soft[i]
    others = np.flatnonzero(soft > 1e-6)
    j = others[others != i][0] if len(others) > 1 else i
    partners.append(j)
    if j != i:
      weights.add(round(float(lam), 5))
    np.testing.assert_allclose(out["image"][i], lam * 10 * i + (1 - lam) * 10 * j, atol=0.51)
  assert len(weights) == 1  # one lam per batch
  assert sorted(partners) == list(range(8))  # a permutation
  again = ops.apply_batch([ops.PermutedMixup(0.4, 8)], batch_of(8, 8), ops.batch_rng(0, 3))
  np.testing.assert_array_equal(again["image"], out["image"])
  other = ops.apply_batch([ops.PermutedMixup(0.4, 8)], batch_of(8, 8), ops.batch_rng(0, 4))
  assert not np.array_equal(other["label"], out["label"])
  floats = {**batch_of(8, 8), "image": batch_of(8, 8)["image"].astype(np.float32)}
  exact = ops.apply_batch([ops.PermutedMixup(0.4, 8)], floats, ops.batch_rng(0, 3))["image"]
  assert exact.dtype == np.float32
  np.testing.assert_allclose(exact, out["image"], atol=0.51)


def test_mixup_leaves_padding_rows_alone_and_mixes_real_rows_among_themselves():
  mask = [1, 1, 1, 1, 1, 0, 0, 0]
  batch = batch_of(8, 8, mask)
  for b in range(5):
    out = ops.apply_batch([ops.PermutedMixup(1.0, 8)], batch, ops.batch_rng(0, b))
    np.testing.assert_array_equal(out["mask"], batch["mask"])
    np.testing.assert_array_equal(out["image"][5:], batch["image"][5:])
    assert not out["label"][5:].any()  # padding rows' labels: zeros, counted as nothing
    assert not out["label"][:5, 5:].any()  # no real row took from a padding row


def test_batch_ops_keep_every_row_and_the_mask():
  batch = batch_of(4, 4, [1, 1, 1, 0])
  drop_mask = lambda b, rng: {k: v for k, v in b.items() if k != "mask"}
  half = lambda b, rng: {k: v[:2] for k, v in b.items()}
  with pytest.raises(ops.OpError, match="dropped the 'mask'"):
    ops.apply_batch([drop_mask], batch, ops.batch_rng(0, 0))
  with pytest.raises(ops.OpError, match="from 4 rows to 2"):
    ops.apply_batch([half], batch, ops.batch_rng(0, 0))
  with pytest.raises(ops.OpError, match="returned list"):
    ops.apply_batch([lambda b, rng: [b]], batch, ops.batch_rng(0, 0))
  real = {**batch, "mask": np.ones(4, bool)}  # label 3 on a real row
  with pytest.raises(ops.OpError, match="labels outside"):
    ops.apply_batch([ops.PermutedMixup(0.2, 3)], real, ops.batch_rng(0, 0))
  ops.apply_batch([ops.PermutedMixup(0.2, 3)], batch, ops.batch_rng(0, 0))  # on padding: none


@registry.register("test_invert", "image")
def invert(strength=255):
  return lambda image, rng: (strength - image).astype(np.uint8)


def test_a_spec_string_names_registered_ops_with_literal_arguments():
  built = pp.build("color_jitter(0.2, hue=0.1)|test_invert", "image")
  assert built[0] == ops.ColorJitter(0.2, hue=0.1)
  np.testing.assert_array_equal(built[1](photo(0), None), 255 - photo(0))
  mine = lambda image, rng: image
  assert pp.build(["color_jitter", mine], "image") == (ops.ColorJitter(), mine)
  assert pp.build(ops.PermutedMixup(0.3, 2), "batch") == (ops.PermutedMixup(0.3, 2),)
  # Context fills what the spec leaves out (the manifest's class count, say).
  assert pp.build("permuted_mixup(0.5)", "batch", num_classes=10) == (ops.PermutedMixup(0.5, 10),)
  assert pp.build("permuted_mixup(0.5, num_classes=3)", "batch", num_classes=10)[0].num_classes == 3
  # ... and a bare num_classes is its value, as in a whole pp string.
  assert pp.build("onehot(num_classes)", "batch", num_classes=10) == (ops.OneHot(10),)
  assert pp.build(None, "image") == () and pp.build("", "batch") == ()
  assert pickle.loads(pickle.dumps(pp.build("color_jitter(0.1)", "image")))


def test_a_bad_spec_says_what_is_wrong():
  with pytest.raises(ValueError, match=r"op 'mixup\(0.2\)' is a batch op.*batch_ops="):
    pp.build("mixup(0.2)", "image")
  with pytest.raises(ValueError, match=r"op 'flip_lr' is a head op.*augment= or a pp= string"):
    pp.build("flip_lr", "image")
  with pytest.raises(ValueError, match=r"onehot\(8\)' one-hot encodes 8 classes.*has 10"):
    pp.build("onehot(8)", "batch", num_classes=10)
  with pytest.raises(ValueError, match=r"unknown op 'blur'.*registered: \[.*color_jitter"):
    pp.build("color_jitter|blur(3)", "image")
  with pytest.raises(ValueError, match="cannot read op"):
    pp.build("color_jitter(__import__('os').getcwd())", "image")
  with pytest.raises(ValueError, match="color_jitter\\(1, 2, 3, 4, 5\\)"):
    pp.build("color_jitter(1, 2, 3, 4, 5)", "image")
  with pytest.raises(ValueError, match="already registered"):
    registry.register("color_jitter", "image")(lambda: None)


def test_mixup_after_onehot_to_another_key_mixes_the_labels_the_model_reads():
  # big_vision's "onehot(8, key_result='labels')|mixup(...)": the labels live in "labels".
  batch = batch_of(8, 8)
  chain = pp.build("onehot(8, key_result='labels')|permuted_mixup(0.4, key='labels')", "batch")
  out = ops.apply_batch(chain, batch, ops.batch_rng(0, 3))
  plain = ops.apply_batch([ops.PermutedMixup(0.4, 8)], batch, ops.batch_rng(0, 3))
  np.testing.assert_array_equal(out["labels"], plain["label"])  # mixed as "label" would be
  np.testing.assert_array_equal(out["image"], plain["image"])
  np.testing.assert_array_equal(out["label"], batch["label"])  # the int labels untouched
  # Without key=, mixing the images but not "labels" is refused, naming the key to pass.
  with pytest.raises(ops.OpError, match=r"soft labels in 'labels'.*key='labels'"):
    ops.apply_batch(
      pp.build("onehot(8, key_result='labels')|permuted_mixup(0.4, 8)", "batch"),
      batch,
      ops.batch_rng(0, 3),
    )
  # A batch without the labels' key is refused, naming what it has.
  no_label = {"image": batch["image"]}
  with pytest.raises(ops.OpError, match=r"no 'label' entry \(it has \['image'\]\)"):
    ops.apply_batch([ops.PermutedMixup(0.4, 8)], no_label, ops.batch_rng(0, 0))
  with pytest.raises(ops.OpError, match=r"no 'labels' entry"):
    ops.apply_batch([ops.PermutedMixup(0.4, 8, key="labels")], batch, ops.batch_rng(0, 0))
  with pytest.raises(ops.OpError, match=r"onehot: labels outside \[0, 3\)"):
    ops.apply_batch([ops.OneHot(3)], batch, ops.batch_rng(0, 0))


OP_SOURCE = '''
import numpy as np
from pipeline.pp import registry

@registry.register("test_reloaded_{n}", "image")
def shift(amount=1):  # a comment
  return lambda image, rng: np.roll(image, amount, axis=0)

@registry.register("test_reloaded_class_{n}", "batch")
class Keep:
  scale = 1.0
  def __call__(self, batch, rng):
    return batch
'''


def test_registering_the_same_definition_again_is_a_no_op_and_another_is_refused(tmp_path):
  import importlib
  import sys

  # A notebook cell run twice: the same source executed again makes new objects.
  for _ in range(2):
    exec(compile(OP_SOURCE.format(n=1), "<cell>", "exec"), {"__name__": "__main__"})
  assert pp.build("test_reloaded_1(2)", "image")[0](photo(0), None).shape == photo(0).shape
  # importlib.reload of a module that registers ops.
  (tmp_path / "my_ops_module.py").write_text(OP_SOURCE.format(n=2))
  sys.path.insert(0, str(tmp_path))
  try:
    module = importlib.import_module("my_ops_module")
    importlib.reload(module)
    assert pp.build("test_reloaded_2", "image")
    # A different definition under a taken name: refused in one line, naming it.
    edited = OP_SOURCE.format(n=2).replace("amount, axis=0", "amount, axis=1")
    (tmp_path / "my_ops_module.py").write_text(edited)
    importlib.invalidate_caches()
    with pytest.raises(
      ValueError,
      match=r"a different image op is already registered as "
      r"'test_reloaded_2' \(my_ops_module\.shift\).*replace=True",
    ):
      exec(
        compile(edited, str(tmp_path / "my_ops_module.py"), "exec"), {"__name__": "my_ops_module"}
      )
    changed_class = OP_SOURCE.format(n=2).replace("scale = 1.0", "scale = 2.0")
    changed_class = changed_class.replace('"test_reloaded_2"', '"test_reloaded_other"')
    with pytest.raises(ValueError, match="'test_reloaded_class_2'"):
      exec(compile(changed_class, "<edited>", "exec"), {"__name__": "my_ops_module"})
    # replace=True is the way to swap one in on purpose.
    registry.register("test_reloaded_2", "image", replace=True)(lambda: lambda image, rng: image)
  finally:
    sys.path.remove(str(tmp_path))
    sys.modules.pop("my_ops_module", None)


def test_the_registry_names_each_op_once_and_lists_every_name():
  assert registry.lookup("mixup") == registry.Op("mixup", "batch", ops.BigVisionMixup, True)
  assert registry.lookup("permuted_mixup").factory is ops.PermutedMixup
  assert registry.lookup("randaug").kind == "image"
  assert registry.lookup("flip_lr") == registry.Op("flip_lr", "head", None)
  names = registry.names()
  assert {"color_jitter", "randaug", "mixup", "permuted_mixup", "onehot", "value_range"} <= set(
    names
  )
  assert set(registry.HEAD) <= set(names) and "bv_mixup" not in names
  with pytest.raises(ValueError, match=r"^unknown op 'blur'; registered: \[.*'randaug'") as e:
    registry.lookup("blur")
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="is a head op"):
    registry.register("flip_lr", "image")(lambda: None)
  with pytest.raises(ValueError, match="kind must be 'image' or 'batch'"):
    registry.register("my_head", "head")


def test_a_pp_string_and_batch_ops_read_the_same_language():
  tail = "onehot(num_classes, key_result='labels')|value_range(-1, 1)|mixup(p=0.2)"
  compiled = pp.compile("decode_jpeg_and_inception_crop(32)|" + tail, num_classes=8)
  assert compiled.batch_ops == pp.build(tail, "batch", num_classes=8)
  assert [type(op) for op in compiled.batch_ops] == [ops.OneHot, ops.ValueRange, ops.BigVisionMixup]


def test_mixup_names_big_vision_op_which_says_which_op_mixes_int_labels():
  (bv,) = pp.build("mixup(0.2)", "batch", num_classes=8)
  with pytest.raises(ops.OpError, match=r"no \['labels'\] entries.*permuted_mixup\(alpha\)"):
    ops.apply_batch([bv], batch_of(8, 8), ops.batch_rng(0, 0))
