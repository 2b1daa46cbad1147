"""pipeline.input: one call from a converted dataset to device batches, with its sizes."""

import pathlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import pipeline
from pipeline.host import memory
from tests.cluster import run_processes

try:  # Must precede the first JAX operation of the pytest process (see test_device.py).
  jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
  pass

ROOT = pathlib.Path(__file__).resolve().parent.parent
P = jax.sharding.PartitionSpec
FAST_THREADS = {"performance": {"num_threads": 2}}
FAST = {"image_size": 16, **FAST_THREADS}


@pytest.fixture(autouse=True)
def eight_devices():
  if jax.device_count() != 8:
    pytest.fail(
      "test_input needs 8 CPU devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8."
    )


def test_train_input_knows_its_sizes_and_feeds_global_batches(digits_dir):
  train = pipeline.input(digits_dir, "train", global_batch_size=16, **FAST)
  assert (train.num_examples, train.steps_per_epoch, train.num_classes) == (240, 15, 10)
  assert train.classes == [str(d) for d in range(10)] and train.train
  batch = next(train)
  assert batch["image"].shape == (16, 16, 16, 3) and batch["image"].dtype == np.uint8
  assert batch["image"].sharding.spec == P("data") and batch["label"].shape == (16,)
  assert set(batch) == {"image", "label"}  # full batches need no mask
  assert isinstance(train, grain.DatasetIterator) and iter(train) is train
  train.close()


def test_each_eval_pass_counts_every_example_once_and_the_next_loop_starts_another(digits_dir):
  val = pipeline.input(digits_dir, "validation", global_batch_size=16, **FAST)
  assert not val.train and val.steps_per_epoch == 4  # 60 examples, the last batch padded
  passes = []
  for _ in range(2):
    labels = [np.asarray(b["label"])[np.asarray(b["mask"])] for b in val]
    passes.append(np.concatenate(labels))
  assert len(passes[0]) == 60 and passes[0].tolist() == passes[1].tolist()
  next(val)
  val.reset()  # a pass abandoned half-way: reset starts over
  assert len(list(val)) == 4
  val.close()


def test_a_next_loop_past_the_eval_pass_is_told_how_to_loop_in_one_line(digits_dir):
  """The Flax ImageNet example calls next() steps_per_eval times per evaluation."""
  val = pipeline.input(digits_dir, "validation", global_batch_size=16, **FAST)
  for _ in range(val.steps_per_epoch):  # the first evaluation: the whole pass
    next(val)
  with pytest.raises(StopIteration) as ended:  # the second one's first call
    next(val)
  line = str(ended.value)
  assert "\n" not in line and "end of the eval pass (4 batches of 16, 60 examples" in line
  assert "`for batch in ...:`" in line and "repeat=True" in line and "steps_per_eval" in line
  assert len(list(val)) == 4  # and a for loop still runs one pass
  val.close()


def test_repeat_serves_a_fixed_count_next_loop_one_whole_pass_per_evaluation(digits_dir):
  val = pipeline.input(digits_dir, "validation", global_batch_size=16, repeat=True, **FAST)
  passes = []
  for _ in range(3):
    batches = [next(val) for _ in range(val.steps_per_epoch)]
    passes.append(np.concatenate([np.asarray(b["label"])[np.asarray(b["mask"])] for b in batches]))
  assert len(passes[0]) == 60 and all(p.tolist() == passes[0].tolist() for p in passes)
  val.close()


def test_padded_rows_count_as_nothing_for_a_client_that_ignores_the_mask(digits_dir):
  """Label -1: jax.nn.one_hot gives zeros, so the cross-entropy is 0, and no prediction
  equals it; the mask stays for the denominators."""
  val = pipeline.input(digits_dir, "validation", global_batch_size=16, **FAST)
  last = list(val)[-1]
  label, mask = np.asarray(last["label"]), np.asarray(last["mask"])
  assert mask.sum() == 12 and (label[~mask] == -1).all() and (label[mask] >= 0).all()
  onehot = jax.nn.one_hot(last["label"], val.num_classes)
  assert not np.asarray(onehot)[~mask].any()
  loss = optax.softmax_cross_entropy(jnp.zeros((16, val.num_classes)), onehot)
  assert not np.asarray(loss)[~mask].any() and np.asarray(loss)[mask].all()
  for guess in range(val.num_classes):  # a model that always answers `guess`
    assert not (np.full(16, guess) == label)[~mask].any()
  val.close()


def test_an_input_says_what_its_spec_made_of_the_images_before_the_first_batch(digits_dir):
  pp = "decode|resize_small(28)|central_crop(24)|value_range(-1, 1)"
  val = pipeline.input(digits_dir, "validation", global_batch_size=8, pp=pp, **FAST_THREADS)
  assert val.image_size == 24  # the pp string's head sets it
  assert [type(op).__name__ for op in val.batch_ops] == ["ValueRange"]
  assert val.manifest == pipeline.load_manifest(digits_dir)
  assert val.manifest.splits["validation"].num_records == val.num_examples == 60
  plain = pipeline.input(digits_dir, "train", global_batch_size=8, **FAST_THREADS)
  assert plain.image_size == 224 and plain.batch_ops == ()  # the library's default size
  val.close()
  plain.close()


def test_an_eval_stream_beside_the_train_stream_plans_within_what_its_budget_left(digits_dir):
  budget = {"performance": {"memory_mb": 500, "num_threads": 2}}
  train = pipeline.input(digits_dir, "train", global_batch_size=16, image_size=16, **budget)
  val = pipeline.input(digits_dir, "validation", global_batch_size=16, beside=train, **FAST)
  first, then = train.memory, val.memory
  assert (train.memory_mb, val.memory_mb) == (500, None)
  assert first.budget == 500 * memory.MB and then.budget == first.budget - first.total
  assert first.total + then.total <= 500 * memory.MB
  alone = pipeline.input(digits_dir, "validation", global_batch_size=16, **FAST)
  assert [b["label"].tolist() for b in val] == [b["label"].tolist() for b in alone]
  own = {"performance": {"memory_mb": 300, "num_threads": 2}}  # its own budget: not shared
  apart = pipeline.input(digits_dir, "validation", global_batch_size=16, beside=train, **own)
  assert apart.memory.budget == 300 * memory.MB
  for stream in (train, val, alone, apart):
    stream.close()


def test_streams_that_cannot_share_the_budget_set_are_refused_in_one_line(digits_dir):
  greedy = {"memory_mb": 500, "record_cache_mb": 10**7, "num_threads": 2}  # the cache takes all
  train = pipeline.input(digits_dir, "train", global_batch_size=16, performance=greedy)
  assert train.memory.total == train.memory.budget
  with pytest.raises(memory.BudgetError) as refused:
    pipeline.input(digits_dir, "validation", global_batch_size=16, beside=train, **FAST)
  line = str(refused.value)
  assert line.startswith("performance.memory_mb=500 holds this stream and the one beside it")
  assert "\n" not in line and line.endswith("give this stream a performance.memory_mb of its own")
  assert f"below the least this stream holds, {memory.mb(refused.value.least)} MB" in line
  train.close()


def test_beside_the_default_budget_a_stream_that_does_not_fit_plans_within_its_own(digits_dir):
  greedy = {"record_cache_mb": 10**7, "num_threads": 2}  # the cache takes the default budget
  train = pipeline.input(digits_dir, "train", global_batch_size=16, performance=greedy)
  val = pipeline.input(digits_dir, "validation", global_batch_size=16, beside=train, **FAST)
  first, then = train.memory, val.memory
  assert first.total == first.budget  # nothing left: the eval stream's default budget instead
  assert then.budget == pytest.approx(first.budget, rel=0.1)  # half the memory available now
  assert 0 < then.total <= then.budget
  train.close()
  val.close()


def test_normalization_and_dtype_happen_on_device(digits_dir):
  raw = pipeline.input(digits_dir, "validation", global_batch_size=8, **FAST)
  norm = pipeline.input(
    digits_dir, "validation", global_batch_size=8, normalize="imagenet", dtype="bfloat16", **FAST
  )
  pixels, image = np.asarray(next(raw)["image"], np.float32), next(norm)["image"]
  assert image.dtype == "bfloat16" and image.sharding.spec == P("data")
  mean, std = np.array([0.485, 0.456, 0.406]) * 255, np.array([0.229, 0.224, 0.225]) * 255
  np.testing.assert_allclose(np.asarray(image, np.float32), (pixels - mean) / std, atol=0.03)
  raw.close()
  norm.close()


def test_pmap_layout_gives_each_local_device_its_rows(digits_dir):
  train = pipeline.input(
    digits_dir, "train", global_batch_size=16, layout="pmap", normalize="minus_one_one", **FAST
  )
  batch = next(train)
  assert batch["image"].shape == (8, 2, 16, 16, 3) and batch["label"].shape == (8, 2)
  means = jax.pmap(lambda x: jax.lax.pmean(x.mean(), "d"), axis_name="d")(batch["image"])
  np.testing.assert_allclose(np.asarray(means), np.asarray(batch["image"]).mean(), rtol=1e-4)
  train.close()


def test_a_batch_that_cannot_split_is_refused_before_reading(digits_dir):
  with pytest.raises(ValueError, match="multiple of 8"):
    pipeline.input(digits_dir, "train", global_batch_size=12, **FAST)
  with pytest.raises(TypeError, match="takes global_batch_size="):
    pipeline.input(digits_dir, "train", global_batch_size=16, batch_size=2)
  with pytest.raises(TypeError, match="needs global_batch_size= .*; got global_batch_sise=$"):
    pipeline.input(digits_dir, "train", global_batch_sise=16)


def test_orbax_saves_the_iterator_beside_the_model_state_and_resumes_it(digits_dir, tmp_path):
  train = pipeline.input(digits_dir, "train", global_batch_size=16, seed=3, **FAST)
  state = {"w": np.zeros(3, np.float32)}
  manager = ocp.CheckpointManager(tmp_path / "ckpt")
  for _ in range(2):
    next(train)
    state = {"w": state["w"] + 1}
  manager.save(
    2,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(train)
    ),
  )
  manager.wait_until_finished()
  expected = [np.asarray(next(train)["label"]) for _ in range(3)]  # steps 3, 4, 5
  train.close()

  resumed = pipeline.input(digits_dir, "train", global_batch_size=16, seed=3, **FAST)
  restored = manager.restore(
    manager.latest_step(),
    args=ocp.args.Composite(
      state=ocp.args.StandardRestore(state), data=grain.checkpoint.CheckpointRestore(resumed)
    ),
  )
  assert restored.state["w"].tolist() == [2, 2, 2]
  np.testing.assert_array_equal([np.asarray(next(resumed)["label"]) for _ in range(3)], expected)
  resumed.close()
  manager.close()


@pytest.mark.slow
def test_two_processes_each_read_their_share_of_every_global_batch(digits_dir, tmp_path):
  run_processes("multihost_input_worker.py", 2, data_dir=digits_dir, out=tmp_path / "{i}.npz")
  seen = [np.load(tmp_path / f"{i}.npz") for i in range(2)]
  got = seen[0]
  assert int(got["train_local_rows"]) == 8  # 16 over 2 processes
  # The global batch is both processes' rows: 16 different examples.
  assert len(set(got["train_image_sum"].tolist())) == 16
  np.testing.assert_array_equal(got["train_label"], seen[1]["train_label"])
  # Eval: 60 examples, 30 per process, each counted once: 4 steps of 16 (the last padded).
  assert int(got["eval_steps"]) == 4 and int(got["eval_real"]) == 60
  # pmap: [8 devices, 2 rows]; a psum over all devices of both processes.
  assert tuple(got["pmap_shape"]) == (8, 2)
  assert int(got["pmap_psum"]) == int(got["pmap_label"].sum())
  np.testing.assert_array_equal(got["pmap_label"].reshape(-1), got["train_label"])
  assert "does not divide over the 2 processes" in str(got["error"])


def value_range(image, rng):  # big_vision's value_range(-1, 1), ported as an image op
  return image.astype(np.float32) / 127.5 - 1


def test_images_an_op_already_scaled_are_not_normalized_twice(digits_dir):
  # The op's floats in [-1, 1] normalized again would all land in [-1.0, -0.992], silently.
  scaled = pipeline.input(digits_dir, "validation", global_batch_size=8, ops=[value_range], **FAST)
  image = np.asarray(next(scaled)["image"])
  assert image.dtype == np.float32 and image.min() < -0.5 and image.max() > 0.5
  scaled.close()
  twice = pipeline.input(
    digits_dir,
    "validation",
    global_batch_size=8,
    ops=[value_range],
    normalize="minus_one_one",
    **FAST,
  )
  with pytest.raises(
    ValueError,
    match=r"normalize='minus_one_one' maps pixel values .* "
    r"'image' entry is already float32 .*drop normalize=",
  ):
    next(twice)
  twice.close()


def test_a_global_batch_larger_than_the_split_is_refused_naming_the_sizes(digits_dir):
  # Before: "0 steps per epoch", then batches that repeated records.
  with pytest.raises(
    ValueError,
    match=r"batch_size=256 is larger than the 240 records of "
    r"'train' this process reads",
  ):
    pipeline.input(digits_dir, "train", global_batch_size=256, **FAST)
  val = pipeline.input(digits_dir, "validation", global_batch_size=64, **FAST)  # one padded
  assert val.steps_per_epoch == 1
  val.close()
