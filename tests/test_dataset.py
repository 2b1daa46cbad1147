"""The Grain pipeline: sampling, determinism, exact resume, crops, bad records, labels."""

import hashlib
import math

import numpy as np
import pytest

import pipeline
from pipeline import dataset
from pipeline.catalog import manifest, records
from pipeline.convert import images
from pipeline.dataset import BadRecordError
from pipeline.image import augment, decode
from pipeline.stages.stream import StateError
from pipeline.storage.source import ShardedSource
from tests.conftest import assert_same_batches, jpeg, take


def one_process(data, *args, **kwargs):
  """`pipeline.make_dataset` as the only process (shard 0 of 1)."""
  return pipeline.make_dataset(data, *args, shard_index=0, shard_count=1, **kwargs)


def fingerprints(batches) -> list[str]:
  """One hash per real example (eval images are a pure function of the record)."""
  out = []
  for b in batches:
    mask = b.get("mask", np.ones(len(b["label"]), bool))
    out += [hashlib.sha1(img.tobytes()).hexdigest() for img, m in zip(b["image"], mask) if m]
  return out


# --- the dataset ------------------------------------------------------------------------


def test_train_batches_have_the_documented_form(photos_dir):
  ds = one_process(photos_dir, batch_size=8, image_size=64)
  b = next(iter(ds))
  assert b["image"].shape == (8, 64, 64, 3) and b["image"].dtype == np.uint8
  assert b["label"].shape == (8,) and b["label"].dtype == np.int32
  classes = manifest.load(photos_dir).num_classes
  assert b["label"].min() >= 0 and b["label"].max() < classes


def test_eval_covers_every_record_exactly_once_per_epoch(photos_dir):
  n = manifest.load(photos_dir).splits["train"].num_records
  ds = one_process(
    photos_dir, "train", batch_size=5, train=False, image_size=32, shuffle=True, num_epochs=2
  )
  batches = list(ds)
  prints = fingerprints(batches)
  assert len(prints) == 2 * n
  first, second = prints[:n], prints[n:]
  assert sorted(first) == sorted(second) and len(set(first)) == n
  assert first != second  # a new order each epoch


def test_processes_read_disjoint_slices_that_cover_the_split(photos_dir):
  n = manifest.load(photos_dir).splits["validation"].num_records
  per_process = []
  for k in range(3):
    ds = pipeline.make_dataset(
      photos_dir,
      "validation",
      batch_size=4,
      train=False,
      image_size=32,
      shard_index=k,
      shard_count=3,
    )
    batches = list(ds)
    per_process.append(fingerprints(batches))
    assert len(batches) == math.ceil(math.ceil(n / 3) / 4)  # the same count on every process
  together = sum(per_process, [])
  assert len(together) == n and len(set(together)) == n


def test_same_seed_same_batches_whatever_the_thread_count(photos_dir):
  def run(threads, seed=0):
    ds = one_process(
      photos_dir,
      batch_size=6,
      image_size=48,
      seed=seed,
      performance=dict(num_threads=threads),
    )
    return take(iter(ds), 4)

  one = run(1)
  assert_same_batches(one, run(3))
  other = run(1, seed=1)
  assert not np.array_equal(one[0]["image"], other[0]["image"])


def test_exact_resume_mid_epoch(photos_dir):
  ds = one_process(photos_dir, batch_size=7, image_size=40)
  it = iter(ds)
  take(it, 3)
  state = it.get_state()
  expected = take(it, 5)
  resumed = iter(ds)
  resumed.set_state(state)
  assert_same_batches(expected, take(resumed, 5))


def test_eval_images_are_the_resized_centre_crop_and_deterministic(photos_dir):
  def run():
    return list(
      one_process(
        photos_dir,
        "validation",
        batch_size=8,
        train=False,
        image_size=32,
        decoding=dict(dct_scaling=False),
      )
    )

  batches = run()
  assert_same_batches(batches, run())
  meta = manifest.load(photos_dir)
  source = ShardedSource(
    meta.shard_paths(photos_dir, "validation"),
    [s.num_records for s in meta.splits["validation"].shards],
  )
  images = np.concatenate([b["image"][b["mask"]] for b in batches])
  for index, image in enumerate(images[:6]):  # eval is in record order
    full = decode.decode(records.parse(source.read([index])[0])[0])
    h, w = full.shape[:2]
    y, x, ch, cw = augment.center_crop_box(h, w, 0.875)
    centred = augment.resize(full[y : y + ch, x : x + cw], 32).astype(int)
    shifted = augment.resize(full[y // 4 : y // 4 + ch, x // 4 : x // 4 + cw], 32).astype(int)
    assert np.abs(image - centred).mean() < 1.5
    assert np.abs(image - shifted).mean() > 3 * np.abs(image - centred).mean()


def test_cache_decodes_each_record_once_over_epochs(photos_dir, monkeypatch):
  decoded = []
  real_decode = decode.decode
  monkeypatch.setattr(decode, "decode", lambda data: decoded.append(1) or real_decode(data))
  ds = one_process(
    photos_dir,
    "validation",
    batch_size=4,
    image_size=32,
    num_epochs=3,
    decoding=dict(cache_mb=64),
  )
  batches = list(ds)
  n = manifest.load(photos_dir).splits["validation"].num_records
  assert sum(len(b["label"]) for b in batches) == 4 * (3 * n // 4)  # drop_remainder
  assert all(b["image"].shape[1:] == (32, 32, 3) for b in batches)
  assert len(decoded) == n  # epochs 2 and 3 crop the cached pixels


@pytest.mark.parametrize(
  "train, augment",
  [
    (True, dict(interpolation="bicubic")),
    (False, dict()),
    (True, dict(crop="tf", area_range=(0.05, 1.0))),
    (False, dict(eval_order="resize_then_crop")),
    (True, dict(crop="tf", min_object_covered=0.1, interpolation="bicubic")),  # Flax's
    (False, dict(crop_padding=32, interpolation="bicubic")),
  ],
)
@pytest.mark.usefixtures("native")
def test_native_and_python_paths_give_identical_images(photos_dir, train, augment):
  for image_size in (40, 100):  # 40: DCT-scaled windows
    stages = dataset.build(
      dataset.Spec.of(
        photos_dir,
        batch_size=8,
        train=train,
        image_size=image_size,
        seed=3,
        shard_index=0,
        shard_count=1,
        augment=augment,
      )
    )
    assert_native_batch_is_the_python_paths(stages, 8)


@pytest.mark.usefixtures("native")
def test_narrow_windows_are_mirrored_alike_on_both_paths(tmp_path):
  raw = tmp_path / "raw" / "narrow"
  raw.mkdir(parents=True)
  for width in range(1, 33):  # mirrored rows of every width, SIMD's 5 pixels at a time and not
    (raw / f"{width:02d}.jpg").write_bytes(jpeg(width, size=(9, width)))
  images.convert(images.Request(tmp_path / "raw", tmp_path / "data"), workers=1, progress=False)
  spec = dataset.Spec.of(tmp_path / "data", batch_size=32, image_size=12, seed=5)
  stages = dataset.build(spec)
  flipped = assert_native_batch_is_the_python_paths(stages, 32)
  assert 8 <= flipped <= 24


def assert_native_batch_is_the_python_paths(stages: dataset.Stages, n: int) -> int:
  """The first batch of `stages` (all n images by the native path) is bitwise what the Python
  path makes of each record; returns how many of them were flipped."""
  python_slots, python_slot = [], stages.decode._python_slot
  stages.decode._python_slot = lambda b, s, seen=python_slots, f=python_slot: (
    seen.append(s) or f(b, s)
  )
  batch = next(iter(dataset.chain(stages)))
  assert python_slots == []  # every window fitted its arena slot: the native path made them
  epochs, indices = stages.plan.sampler.records(np.arange(n))
  decode_stage, flipped = stages.decode, 0
  for slot in range(n):
    data = records.parse(stages.read.source.read([indices[slot]])[0])[0]
    out = np.empty(batch["image"].shape[1:], np.uint8)
    decode_stage.python_image(data, int(epochs[slot]), int(indices[slot]), out)
    np.testing.assert_array_equal(batch["image"][slot], out)
    key = augment.example_key(decode_stage.seed, int(epochs[slot]), int(indices[slot]))
    flipped += decode_stage.head.flips(key)
  return flipped


def test_the_host_normalizes_one_way_value_range_and_normalize_is_refused_naming_it(photos_dir):
  keywords = dict(batch_size=4, image_size=32)
  pixels = next(iter(one_process(photos_dir, **keywords)))["image"]
  ds = one_process(photos_dir, batch_ops="value_range(-1, 1)", **keywords)
  img = next(iter(ds))["image"]
  assert img.dtype == np.float32
  np.testing.assert_allclose(img, pixels / 127.5 - 1.0, atol=1e-6)
  with pytest.raises(TypeError, match=r"normalize=\) is gone: normalize on the device") as e:
    one_process(photos_dir, normalize=True, **keywords)
  assert "batch_ops='value_range(-1, 1)'" in str(e.value) and "\n" not in str(e.value)


def test_bad_records_raise_naming_shard_and_index(tmp_path, write_dataset):
  good = [records.encode(jpeg(i), i % 2) for i in range(6)]
  recs = good[:3] + [records.encode(b"\xff\xd8\xffgarbage", 0)] + good[3:]
  data = write_dataset(tmp_path / "bad", recs)
  ds = one_process(data, batch_size=7, train=False, image_size=32)
  with pytest.raises(BadRecordError, match=r"train\.array_record-00000-of-00001 record 3"):
    list(ds)


def test_bad_records_are_skipped_and_counted_when_asked(tmp_path, write_dataset):
  good = [records.encode(jpeg(i), i % 2) for i in range(6)]
  missing_key = records.encode(jpeg(9), 1, keys=records.Keys(image="other"))
  recs = good[:2] + [b"\x00\x01not a proto", missing_key] + good[2:]
  data = write_dataset(tmp_path / "bad", recs)
  eval_batches = list(one_process(data, batch_size=8, train=False, image_size=32, on_error="skip"))
  assert sum(int(b["mask"].sum()) for b in eval_batches) == 6
  train = next(iter(one_process(data, batch_size=8, image_size=32, on_error="skip")))
  assert train["image"].shape[0] == 8 and "mask" not in train


def test_out_of_range_label_is_an_error(tmp_path, write_dataset):
  data = write_dataset(tmp_path / "labels", [records.encode(jpeg(i), 5) for i in range(4)])
  ds = one_process(data, batch_size=2, image_size=32)
  with pytest.raises(BadRecordError, match=r"label 5 outside \[0, 2\)"):
    next(iter(ds))


def test_other_key_names_are_read(tmp_path, write_dataset):
  keys = records.TFDS_KEYS
  recs = [records.encode(jpeg(i), i % 2, f"{i}.jpg", keys=keys) for i in range(4)]
  data = write_dataset(tmp_path / "tfds", recs)
  ds = one_process(data, batch_size=4, image_size=32, keys=keys, train=False)
  assert list(next(iter(ds))["label"]) == [0, 1, 0, 1]


def test_worker_processes_give_the_batches_threads_give_and_resume_exactly(photos_dir):
  def make(workers, threads):
    return one_process(
      photos_dir,
      batch_size=4,
      image_size=32,
      performance=dict(num_workers=workers, num_threads=threads),
    )

  threads_only = take(iter(make(0, 2)), 5)
  it = iter(make(2, 1))  # real Grain worker processes, batches in shared memory
  with_workers = take(it, 2)
  state = it.get_state()
  with_workers += take(it, 3)
  it.close()
  assert_same_batches(threads_only, with_workers)
  resumed = iter(make(2, 1))
  resumed.set_state(state)
  rest = take(resumed, 3)
  resumed.close()
  assert_same_batches(threads_only[2:], rest)


@pytest.mark.parametrize("workers", [0, 2])
def test_skipped_records_are_counted_in_the_iterator_and_its_state(
  tmp_path, write_dataset, workers
):
  good = [records.encode(jpeg(i), i % 2) for i in range(6)]
  recs = good[:2] + [b"\x00\x01not a proto", records.encode(b"\xff\xd8\xffbad", 0)] + good[2:]
  data = write_dataset(tmp_path / "bad", recs)
  it = iter(
    one_process(
      data,
      batch_size=4,
      train=False,
      image_size=32,
      on_error="skip",
      performance=dict(num_workers=workers, num_threads=1),
    )
  )
  list(it)  # with workers, the counts travel with the batches out of each worker process
  assert it.skipped == 2 and it.get_state()["skipped"] == 2


def test_a_state_restored_with_numpy_values_resumes_at_the_next_unseen_batch(photos_dir):
  ds = one_process(photos_dir, batch_size=4, image_size=32)
  it = iter(ds)
  take(it, 5)
  state = it.get_state()
  expected = take(it, 3)
  as_arrays = {
    k: ({kk: np.array(vv) for kk, vv in v.items()} if isinstance(v, dict) else np.array(v))
    for k, v in state.items()
  }  # as a pytree checkpoint returns
  resumed = iter(ds)
  resumed.set_state(as_arrays)
  assert_same_batches(expected, take(resumed, 3))
  after = {"next_index": state["next_index"] + 3, "position": state["position"] + 3 * 4}
  assert resumed.get_state() == {**state, **after}


@pytest.mark.parametrize(
  "state",
  [
    {"next_index": -1},
    {"next_index": "3"},
    {"bogus": 1},
    [1, 2],
    {"next_index": 1.5},
    {"next_index": True},
    {"next_index": 2, "skipped": -4},
  ],
)
def test_garbage_states_are_refused_in_one_line(photos_dir, state):
  it = iter(one_process(photos_dir, batch_size=4, image_size=32))
  with pytest.raises(StateError) as e:
    it.set_state(state)
  assert "\n" not in str(e.value)


@pytest.mark.slow
def test_worker_processes_give_the_same_batches_for_the_same_worker_count(photos_dir):
  def run():
    ds = one_process(
      photos_dir,
      batch_size=4,
      image_size=32,
      performance=dict(num_workers=2),
    )
    it = iter(ds)
    out = take(it, 3)
    it.close()
    return out

  assert_same_batches(run(), run())


def test_custom_ops_and_extra_features_are_deterministic_across_threads_workers_and_resume(
  tmp_path, write_dataset
):
  from tensorflow_datasets.proto import tf_example_pb2

  recs = []
  for i in range(24):
    example = tf_example_pb2.Example.FromString(records.encode(jpeg(i), i % 2))
    example.features.feature["image/id"].int64_list.value.append(1000 + i)
    recs.append(example.SerializeToString())
  data = write_dataset(tmp_path / "extra", recs)

  def make(workers, threads):
    return one_process(
      data,
      batch_size=4,
      image_size=32,
      ops="color_jitter(0.4)",
      batch_ops="permuted_mixup(0.2)",
      features={"id": "image/id"},
      performance=dict(num_workers=workers, num_threads=threads),
    )

  in_order = list(
    one_process(
      data,
      batch_size=5,
      train=False,
      image_size=32,
      features={"id": "image/id"},
    )
  )
  ids = np.concatenate([b["id"][b["mask"]] for b in in_order])
  labels = np.concatenate([b["label"][b["mask"]] for b in in_order])
  np.testing.assert_array_equal(ids, 1000 + np.arange(24))  # each record's own value
  np.testing.assert_array_equal(labels, np.arange(24) % 2)
  threads = take(iter(make(0, 1)), 6)
  for batch in threads:
    assert set(batch["id"] - 1000) <= set(range(24))
    assert batch["label"].shape == (4, 2) and np.allclose(batch["label"].sum(1), 1)  # mixup
  assert_same_batches(threads, take(iter(make(0, 3)), 6))
  it = iter(make(2, 1))
  first = take(it, 2)
  state = it.get_state()
  it.close()
  resumed = iter(make(2, 1))
  resumed.set_state(state)
  rest = take(resumed, 4)
  resumed.close()
  assert_same_batches(threads, first + rest)
  plain = next(iter(one_process(data, batch_size=4, image_size=32)))
  assert not np.array_equal(plain["image"], threads[0]["image"])  # the ops did something


def test_a_failing_custom_op_names_the_record(photos_dir):
  def broken(image, rng):
    raise RuntimeError("boom")

  ds = one_process(photos_dir, batch_size=4, image_size=32, ops=[broken])
  with pytest.raises(ValueError, match=r"array_record-\d+-of-\d+ record \d+: RuntimeError: boom"):
    next(iter(ds))


def test_make_dataset_refuses_shards_that_disagree_with_the_manifest(tmp_path, photos_dir):
  import json
  import os
  import shutil

  data = tmp_path / "copy"
  shutil.copytree(photos_dir, data)
  path = data / "manifest.json"
  meta = json.loads(path.read_text())
  meta["splits"]["validation"]["num_records"] -= 3  # edited down: would serve fewer records
  path.write_text(json.dumps(meta))
  with pytest.raises(manifest.ManifestError, match="validation"):
    one_process(data, "validation", batch_size=4)
  shutil.copy(photos_dir / "manifest.json", path)
  shard = data / meta["splits"]["train"]["shards"][0]["file"]
  shard.unlink()
  os.mkfifo(shard)  # would hang a reader that opened it
  with pytest.raises(manifest.ManifestError, match=shard.name):
    one_process(data, "train", batch_size=4)


def test_a_many_core_host_gets_worker_processes_and_the_same_batches(
  photos_dir, monkeypatch, capfd
):
  from pipeline.host import parallelism

  def make():
    return one_process(photos_dir, batch_size=48, image_size=32)

  here = take(iter(make()), 3)
  monkeypatch.setattr(parallelism, "available_cores", lambda: 24)  # as if on a bigger host
  monkeypatch.setattr(parallelism, "available_memory", lambda: 64 << 30)
  chosen = parallelism.plan(batch_size=48, image_bytes=32 * 32 * 3)
  assert chosen.workers > 0
  it = iter(make())
  there = take(it, 3)
  it.close()
  assert f"{chosen.workers} worker processes x {chosen.threads} decode threads" in (
    capfd.readouterr().err
  )
  assert_same_batches(here, there)


def test_a_state_without_its_stream_is_refused(photos_dir):
  ds = one_process(photos_dir, batch_size=4, image_size=32)
  it = iter(ds)
  take(it, 2)
  state = it.get_state()
  del state["stream"]  # whose batch positions these are can no longer be checked
  with pytest.raises(StateError, match="another stream"):
    iter(ds).set_state(state)
