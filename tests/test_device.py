"""device_prefetch: host batches become sharded global arrays, ahead, resumably."""

import pathlib
import threading
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.device import device_prefetch, normalize_images
from tests.cluster import run_processes

try:  # Must precede the first JAX operation of the pytest process; see mesh().
  jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
  pass

ROOT = pathlib.Path(__file__).resolve().parent.parent
P = jax.sharding.PartitionSpec


def mesh(shape: tuple[int, ...]) -> jax.sharding.Mesh:
  if jax.device_count() < 8:
    pytest.fail(
      "test_device needs 8 CPU devices, but JAX started before it could ask for "
      "them: set XLA_FLAGS=--xla_force_host_platform_device_count=8."
    )
  names = ("data", "model")[: len(shape)]
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def examples(n: int) -> grain.MapDataset:
  """Examples whose label is their index and whose pixels encode it."""
  return grain.MapDataset.range(n).map(
    lambda i: {"image": np.full((4, 4, 3), i, np.uint8), "label": np.int32(i)}
  )


def host_batches(n: int, batch: int) -> grain.IterDataset:
  return examples(n).batch(batch).to_iter_dataset()


def labels(batches) -> list[list[int]]:
  return [np.asarray(b["label"]).tolist() for b in batches]


@pytest.mark.parametrize("shape", [(8,), (4, 2)])
def test_each_device_holds_its_slice_of_the_host_batch(shape):
  it = iter(device_prefetch(host_batches(32, 16), mesh(shape)))
  host = iter(host_batches(32, 16))
  for _ in range(2):
    batch, expected = next(it), next(host)
    assert set(batch) == {"image", "label", "mask"}
    for key, array in batch.items():
      if key == "mask":
        continue
      assert array.shape == expected[key].shape and array.dtype == expected[key].dtype
      assert array.sharding.spec == P("data")
      rows = {s.index[0].start for s in array.addressable_shards}
      assert len(rows) == shape[0]  # split over the data axis, replicated over "model"
      for shard in array.addressable_shards:
        assert shard.data.shape[0] == 16 // shape[0]
        np.testing.assert_array_equal(shard.data, expected[key][shard.index])
  it.close()


def test_normalize_moves_uint8_and_maps_pixels_to_minus_one_one_on_device():
  pixels = np.array([0, 51, 255], np.uint8).repeat(8)[:16].reshape(16, 1)
  ds = grain.MapDataset.source(list(pixels)).map(lambda p: {"image": p}).batch(16)
  it = iter(device_prefetch(ds.to_iter_dataset(), mesh((8,)), normalize=True))
  image = next(it)["image"]
  it.close()
  assert image.dtype == jnp.float32 and image.sharding.spec == P("data")
  np.testing.assert_allclose(np.asarray(image), pixels / 127.5 - 1, atol=1e-6)
  assert normalize_images(jnp.array([0, 255], jnp.uint8), jnp.bfloat16).tolist() == [-1, 1]


def test_transfer_runs_on_a_background_thread_at_most_depth_batches_ahead():
  produced = []

  def record(batch):
    produced.append(threading.current_thread())
    return batch

  depth = 2
  it = iter(device_prefetch(host_batches(80, 8).map(record), mesh((8,)), depth=depth))
  next(it)
  deadline = time.monotonic() + 30
  while len(produced) < depth + 2 and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.2)
  # depth batches wait in the buffer, one more waits in the producer's hand.
  assert len(produced) == depth + 2
  assert threading.main_thread() not in produced
  it.close()


def test_restoring_a_saved_state_resumes_at_the_next_unseen_batch():
  ds = device_prefetch(host_batches(48, 8), mesh((8,)), depth=2)
  it = iter(ds)
  seen = labels([next(it), next(it)])
  state = it.get_state()
  rest = labels(it)  # the buffer ran ahead of `state` while these were consumed
  assert seen + rest == labels(host_batches(48, 8))
  it.set_state(state)
  assert labels(it) == rest
  fresh = iter(ds)
  fresh.set_state(state)
  assert labels([next(fresh)]) == rest[:1]
  host = iter(host_batches(48, 8))  # the state is the host pipeline's own
  host.set_state(state)
  assert labels([next(host)]) == rest[:1]
  fresh.close()
  it.close()


def test_pad_fills_the_last_batch_and_masks_the_padding():
  it = iter(device_prefetch(host_batches(20, 8), mesh((8,))))
  batches = list(it)
  assert [b["label"].shape[0] for b in batches] == [8, 8, 8]
  masks = np.stack([np.asarray(b["mask"]) for b in batches])
  assert masks.dtype == bool and masks.sum() == 20
  last = batches[-1]
  assert np.asarray(last["label"]).tolist() == [16, 17, 18, 19, -1, -1, -1, -1]  # no class
  assert not np.asarray(last["image"])[4:].any()
  real = np.concatenate([np.asarray(b["label"])[np.asarray(b["mask"])] for b in batches])
  assert real.tolist() == list(range(20))


def test_pad_extends_an_existing_mask_in_its_dtype():
  def with_mask(i):  # the dataset layer marks example 9 as padding of its own
    return {"label": np.int32(i), "mask": np.int32(i != 9)}

  ds = grain.MapDataset.range(10).map(with_mask).batch(8).to_iter_dataset()
  batches = list(iter(device_prefetch(ds, mesh((8,)))))
  assert np.asarray(batches[1]["mask"]).tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
  assert batches[1]["mask"].dtype == jnp.int32


def test_pad_to_a_given_batch_size_when_the_first_batch_is_partial():
  batches = list(iter(device_prefetch(host_batches(3, 8), mesh((8,)), batch_size=8)))
  assert len(batches) == 1 and int(batches[0]["mask"].sum()) == 3


def test_drop_discards_the_partial_last_batch():
  ds = device_prefetch(host_batches(20, 8), mesh((8,)), remainder="drop")
  batches = list(iter(ds))
  assert labels(batches) == [list(range(8)), list(range(8, 16))]
  assert "mask" not in batches[0]


def test_a_batch_that_does_not_split_over_the_data_axis_says_what_to_change():
  it = iter(device_prefetch(host_batches(24, 6), mesh((8,))))
  with pytest.raises(ValueError, match="multiple of 8"):
    next(it)
  it.close()
  with pytest.raises(ValueError, match="no data axis 'batch'"):
    device_prefetch(host_batches(8, 8), mesh((8,)), data_axis="batch")


@pytest.mark.parametrize(
  "preset, mean, std",
  [
    ("imagenet", [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]),
    ("zero_one", [0, 0, 0], [255, 255, 255]),
    (([10, 20, 30], 2), [10, 20, 30], [2, 2, 2]),
  ],
)
def test_normalize_presets_and_mean_std_map_pixels_on_device_in_the_given_dtype(preset, mean, std):
  pixels = np.arange(16 * 2 * 3, dtype=np.uint8).reshape(16, 1, 2, 3)
  ds = grain.MapDataset.source(list(pixels)).map(lambda p: {"image": p}).batch(16)
  it = iter(device_prefetch(ds.to_iter_dataset(), mesh((8,)), normalize=preset, dtype=jnp.bfloat16))
  image = next(it)["image"]
  it.close()
  assert image.dtype == jnp.bfloat16 and image.sharding.spec == P("data")
  expected = (pixels - np.array(mean, np.float32)) / np.array(std, np.float32)
  np.testing.assert_allclose(np.asarray(image, np.float32), expected, rtol=1e-2, atol=1e-2)


def test_dtype_alone_casts_the_images_and_bad_normalizations_are_refused():
  it = iter(device_prefetch(host_batches(8, 8), mesh((8,)), dtype="float16"))
  image = next(it)["image"]
  it.close()
  assert image.dtype == jnp.float16 and np.asarray(image).max() == 7
  with pytest.raises(ValueError, match="one of .*'imagenet'"):
    device_prefetch(host_batches(8, 8), mesh((8,)), normalize="imagenette")
  with pytest.raises(ValueError, match="pixel units.*multiply"):
    device_prefetch(host_batches(8, 8), mesh((8,)), normalize=((0.485, 0.456, 0.406), 0.2))


def test_pmap_layout_gives_a_leading_device_axis_that_pmap_takes():
  it = iter(device_prefetch(host_batches(32, 16), layout="pmap", normalize=True))
  batch = next(it)
  it.close()
  assert batch["image"].shape == (8, 2, 4, 4, 3) and batch["label"].shape == (8, 2)
  assert batch["mask"].shape == (8, 2)
  per_device = jax.pmap(lambda b: b["label"].sum())(batch)
  assert np.asarray(per_device).tolist() == [2 * d + (2 * d + 1) for d in range(8)]
  with pytest.raises(ValueError, match="takes no mesh"):
    device_prefetch(host_batches(8, 8), mesh((8,)), layout="pmap")
  with pytest.raises(ValueError, match="multiple of 8"):
    next(iter(device_prefetch(host_batches(12, 12), layout="pmap")))


def test_an_explicit_axis_mesh_gives_arrays_on_that_mesh_for_a_model_on_it():
  explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  it = iter(device_prefetch(host_batches(16, 16), explicit, normalize=True))
  batch = next(it)
  it.close()
  assert batch["image"].sharding.mesh.axis_types == (jax.sharding.AxisType.Explicit,)
  # Weights replicated on the same Explicit mesh: jit takes both (arrays of an Auto mesh
  # beside them would be refused, "Mesh for all inputs should be equal").
  w = jax.device_put(np.ones((48, 2), np.float32), jax.sharding.NamedSharding(explicit, P()))
  out = jax.jit(lambda w, x: x.reshape(x.shape[0], -1) @ w)(w, batch["image"])
  np.testing.assert_allclose(np.asarray(out)[:, 0], (np.arange(16) / 127.5 - 1) * 48, rtol=1e-5)


def test_without_a_mesh_the_batch_is_sharded_over_every_device():
  it = iter(device_prefetch(host_batches(16, 16)))
  batch = next(it)
  it.close()
  assert batch["label"].sharding.spec == P("data") and len(batch["label"].sharding.device_set) == 8


def test_bytes_entries_stay_on_the_host_with_this_processs_rows_padded():
  ds = (
    grain.MapDataset.range(10)
    .map(lambda i: {"label": np.int32(i), "id": np.bytes_(f"id{i}")})
    .batch(8)
  )
  batches = list(iter(device_prefetch(ds.to_iter_dataset(), mesh((8,)))))
  assert isinstance(batches[0]["label"], jax.Array)
  ids = batches[1]["id"]
  assert isinstance(ids, np.ndarray) and ids.tolist() == [b"id8", b"id9"] + [b""] * 6
  pmapped = next(iter(device_prefetch(ds.to_iter_dataset(), layout="pmap")))
  assert pmapped["id"].shape == (8, 1) and pmapped["id"][3, 0] == b"id3"


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["8", "4,2"])
def test_two_processes_each_feed_their_slice_of_one_global_batch(tmp_path, shape):
  run_processes("multihost_device_worker.py", 2, 240, mesh=shape, out=tmp_path / "{i}.npz")
  seen = [np.load(tmp_path / f"{i}.npz") for i in range(2)]
  for key in seen[0].files:  # both processes see the same global arrays
    np.testing.assert_array_equal(seen[0][key], seen[1][key])
  got = seen[0]
  # Process 0 feeds ids 0..15, process 1 ids 16..31, four per step each.
  expected = [list(range(4 * s, 4 * s + 4)) + list(range(16 + 4 * s, 20 + 4 * s)) for s in range(3)]
  assert got["train_label"].tolist() == expected
  np.testing.assert_allclose(
    got["train_image"][..., 0, 0, 0], np.array(expected) / 127.5 - 1, atol=1e-6
  )
  assert set(got["spec"]) == {"P('data',)"}
  assert got["resumed_label"].tolist() == expected[1]
  # Eval over 21 ids split 11/10: every id counted once, padding masked out.
  real = got["eval_label"][got["eval_mask"]]
  assert sorted(real.tolist()) == list(range(21))
  assert got["eval_count"].sum() == 21
