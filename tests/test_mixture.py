"""Mixtures: several datasets in one stream with weights, one loader, states by source name."""

import re
import threading

import numpy as np
import pytest

import pipeline
from pipeline import dataset, mixture
from pipeline.catalog import manifest
from pipeline.order.elastic import StateError
from pipeline.pp import registry
from tests.conftest import assert_same_batches, take


@registry.register("test_mix_blank", "image")
def blank():
  return lambda image, rng: np.zeros_like(image)


def mixed(digits_dir, photos_dir, weights=None, **keywords):
  """The issue's call: two sources, batches of 64 at 64 px, seed 0."""
  keywords = {"batch_size": 64, "image_size": 64, "seed": 0, **keywords}
  weights = weights or {"in1k": 0.3, "extra": 0.7}
  sources = {"in1k": digits_dir, "extra": photos_dir}
  return pipeline.make_dataset(sources, "train", weights=weights, **keywords)


def shares(batches, source=1) -> list[float]:
  return [float(np.mean(b["source"] == source)) for b in batches]


def test_the_mixture_holds_the_weights_over_3000_images_and_every_window(digits_dir, photos_dir):
  batches = take(iter(mixed(digits_dir, photos_dir)), 47)  # 3,008 images
  sources = np.concatenate([b["source"] for b in batches])
  assert abs(np.mean(sources == 1) - 0.7) <= 0.01
  windows = [np.mean(sources[k : k + 4 * 64] == 1) for k in range(0, len(sources) - 255, 64)]
  assert max(abs(w - 0.7) for w in windows) <= 0.05
  assert max(abs(s - 0.7) for s in shares(batches)) < 1 / 64 + 1e-9  # within a slot a batch
  classes = [manifest.load(d).num_classes for d in (digits_dir, photos_dir)]
  for b in batches:
    assert b["image"].shape == (64, 64, 64, 3) and b["source"].dtype == np.int32
    for s, n in enumerate(classes):  # labels="own": each source's own classes
      assert ((b["label"][b["source"] == s] >= 0) & (b["label"][b["source"] == s] < n)).all()


def test_the_same_seed_gives_the_same_batches_and_a_state_resumes_exactly(digits_dir, photos_dir):
  it = iter(mixed(digits_dir, photos_dir))
  take(it, 10)
  state = it.get_state()
  after = take(it, 3)
  again = iter(mixed(digits_dir, photos_dir))
  again.set_state(state)
  assert_same_batches(take(again, 3), after)
  fresh = iter(mixed(digits_dir, photos_dir))
  assert_same_batches(take(fresh, 13)[10:], after)


def test_a_state_restored_with_other_weights_continues_each_source(digits_dir, photos_dir, capfd):
  it = iter(mixed(digits_dir, photos_dir))
  take(it, 10)
  state = it.get_state()
  capfd.readouterr()
  halves = iter(mixed(digits_dir, photos_dir, weights={"in1k": 0.5, "extra": 0.5}))
  halves.set_state(state)
  said = [line for line in capfd.readouterr().err.splitlines() if "mixture resumed" in line]
  assert len(said) == 1 and "global position 640" in said[0] and "in1k: 0.3" in said[0]
  batches = take(halves, 47)
  assert abs(np.mean(np.concatenate([b["source"] for b in batches])) - 0.5) <= 0.02
  # each source continues from its own uses at the state: its records come on in order
  used = state["mixture"]["used"]
  now = halves.get_state()["mixture"]["used"]
  assert now["in1k"] - used["in1k"] == sum(int((b["source"] == 0).sum()) for b in batches)
  table = halves.stats().table()  # per source: images, rate and realized share since restored
  assert re.search(r"source extra: 1504 images, [\d.]+/s \(50\.0% of the images, weight 50", table)


def test_states_of_another_mixture_or_of_one_dataset_are_refused(digits_dir, photos_dir):
  it = iter(mixed(digits_dir, photos_dir))
  next(it)
  other = pipeline.make_dataset(
    {"a": digits_dir, "b": photos_dir},
    "train",
    weights={"a": 1, "b": 1},
    batch_size=64,
    image_size=64,
    seed=0,
  )
  other_it = iter(other)
  with pytest.raises(StateError, match="another mixture.*no source in common"):
    other_it.set_state(it.get_state())
  single = iter(pipeline.make_dataset(digits_dir, "train", batch_size=64, image_size=64))
  with pytest.raises(StateError, match="single dataset, not of a mixture"):
    iter(mixed(digits_dir, photos_dir)).set_state(single.get_state())


def test_a_source_added_continues_the_others(digits_dir, photos_dir, capfd):
  it = iter(mixed(digits_dir, photos_dir))
  take(it, 2)
  state = it.get_state()
  sources = {"in1k": digits_dir, "extra": photos_dir, "more": digits_dir}
  three = iter(
    pipeline.make_dataset(
      sources,
      "train",
      weights={"in1k": 1, "extra": 1, "more": 1},
      batch_size=64,
      image_size=64,
      seed=0,
    )
  )
  three.set_state(state)
  assert "sources added: more" in capfd.readouterr().err
  assert set(np.unique(next(three)["source"]).tolist()) == {0, 1, 2}


def test_each_source_has_its_own_pp_and_the_sizes_must_agree(digits_dir, photos_dir):
  blanked = mixture.Source(photos_dir, pp="decode_jpeg_and_inception_crop(64)|test_mix_blank")
  ds = pipeline.make_dataset(
    {"in1k": digits_dir, "extra": blanked},
    "train",
    weights={"in1k": 1, "extra": 1},
    batch_size=32,
    image_size=64,
  )
  b = next(iter(ds))
  assert (b["image"][b["source"] == 1] == 0).all()
  assert (b["image"][b["source"] == 0].reshape(-1, 64 * 64 * 3).max(axis=1) > 0).all()
  small = pipeline.Source(photos_dir, pp="decode_jpeg_and_inception_crop(32)")
  with pytest.raises(ValueError, match="source 'extra' makes 32x32 images, 'in1k' 64x64"):
    pipeline.make_dataset(
      {"in1k": digits_dir, "extra": small},
      "train",
      weights={"in1k": 1, "extra": 1},
      batch_size=32,
      image_size=64,
    )


@pytest.mark.parametrize("labels", ["offset", "joined"])
def test_labels_offset_or_joined_by_class_name(digits_dir, photos_dir, labels):
  ds = mixed(digits_dir, photos_dir, labels=labels, batch_size=32)
  b = take(iter(ds), 3)
  digits, photos = (manifest.load(d).classes for d in (digits_dir, photos_dir))
  labels_of = lambda s: np.concatenate([x["label"][x["source"] == s] for x in b])
  if labels == "offset":
    assert (labels_of(1) >= len(digits)).all() and (labels_of(0) < len(digits)).all()
  else:  # the two class lists share no name: joined is the offset numbering too
    joined = list(dict.fromkeys(digits + photos))
    assert (labels_of(1) >= joined.index(photos[0])).all()


def test_35_sources_plan_within_one_budget_and_one_pool_of_threads(digits_dir, photos_dir):
  keywords = dict(batch_size=32, image_size=64, seed=0, shard_index=0, shard_count=1)
  keywords["performance"] = {"memory_mb": 1000}
  one = dataset.build(pipeline.Spec.of(digits_dir, "train", **keywords))
  sources = {f"s{k:02d}": (digits_dir, photos_dir)[k % 2] for k in range(35)}
  weights = {name: 1 + k % 3 for k, name in enumerate(sources)}
  stages = dataset.Stages(**mixture.stages(sources, "train", weights=weights, **keywords))
  assert stages.decode.threads.size == one.decode.threads.size
  assert all(p.threads is stages.decode.threads for p in stages.decode.parts)
  assert all(c.threads is stages.finish.threads for c in stages.decode.checks)
  assert stages.read.memory == one.read.memory  # the same plan, within the same budget
  assert stages.workers == one.workers
  before = {t.name for t in threading.enumerate()}
  it = iter(dataset.chain(stages))
  batches = take(it, 4)
  assert set(np.concatenate([b["source"] for b in batches]).tolist()) == set(range(35))
  started = [t for t in threading.enumerate() if t.name not in before]
  decode = [t for t in started if "pipeline-decode" in t.name]
  assert len(decode) <= one.decode.num_threads
  table = it.stats().table()
  assert "source s00:" in table and "source s34:" in table


def test_pipeline_input_feeds_a_mixture(digits_dir, photos_dir):
  train = pipeline.input(
    {"in1k": digits_dir, "extra": photos_dir},
    "train",
    weights={"in1k": 0.3, "extra": 0.7},
    global_batch_size=64,
    image_size=64,
    seed=0,
  )
  b = next(train)
  assert b["image"].shape == (64, 64, 64, 3)
  assert abs(float(np.mean(np.asarray(b["source"]) == 1)) - 0.7) < 1 / 64 + 1e-9
  table = train.stats().table()
  assert "source extra:" in table


def test_mixture_mistakes_are_one_line(digits_dir, photos_dir):
  sources = {"in1k": digits_dir, "extra": photos_dir}
  with pytest.raises(ValueError, match="source 'extra' has no weight"):
    pipeline.make_dataset(sources, "train", weights={"in1k": 1}, batch_size=8)
  with pytest.raises(ValueError, match="weights name 'other', not a source"):
    pipeline.make_dataset(sources, "train", weights={"other": 1}, batch_size=8)
  with pytest.raises(ValueError, match="a mixture is a training stream"):
    pipeline.make_dataset(
      sources, "train", weights={"in1k": 1, "extra": 1}, batch_size=8, train=False
    )


def test_a_state_continues_on_another_process_count(digits_dir, photos_dir):
  one = iter(mixed(digits_dir, photos_dir, shard_index=0, shard_count=1))
  take(one, 10)
  state = one.get_state()
  after = take(one, 2)
  halves = []
  for p in range(2):
    it = iter(mixed(digits_dir, photos_dir, batch_size=32, shard_index=p, shard_count=2))
    it.set_state(state)
    halves.append(take(it, 2))
  for k, whole in enumerate(after):
    for key in ("image", "label", "source"):
      np.testing.assert_array_equal(np.concatenate([h[k][key] for h in halves]), whole[key])


@registry.register("test_mix_corner", "image")
def corner(size: int = 16):
  return lambda image, rng: np.ascontiguousarray(image[:size, :size])


def two(digits_dir, photos_dir, in1k=None, extra=None, **keywords):
  """The two sources, each a `Source` with `in1k` / `extra` as its own settings."""
  sources = {
    "in1k": pipeline.Source(digits_dir, **(in1k or {})),
    "extra": pipeline.Source(photos_dir, **(extra or {})),
  }
  keywords = {"batch_size": 32, "image_size": 64, "seed": 0, **keywords}
  return pipeline.make_dataset(sources, "train", weights={"in1k": 1, "extra": 1}, **keywords)


def test_each_source_has_its_own_image_size_ops_and_features(digits_dir, photos_dir):
  both = {"image_size": 48, "ops": "test_mix_corner(40)", "features": {"file": "image/filename"}}
  b = next(iter(two(digits_dir, photos_dir, both, {**both, "ops": "test_mix_corner(40)"})))
  assert b["image"].shape == (32, 40, 40, 3)  # the sources' size and ops, not the mixture's 64
  assert b["file"].dtype == object and all(isinstance(f, bytes) and f for f in b["file"])
  files = {s: {f for f, k in zip(b["file"], b["source"]) if k == s} for s in (0, 1)}
  assert files[0] and files[1] and not files[0] & files[1]  # each row's own record's
  blank = next(iter(two(digits_dir, photos_dir, extra={"ops": "test_mix_blank"})))
  assert (blank["image"][blank["source"] == 1] == 0).all()
  assert (blank["image"][blank["source"] == 0].reshape(-1, 64 * 64 * 3).max(axis=1) > 0).all()


@pytest.mark.parametrize(
  "extra, said",
  [
    ({"image_size": 32}, "source 'extra' makes 32x32 images, 'in1k' 64x64: "),
    ({"ops": "test_mix_corner(16)"}, "source 'extra' makes 16x16 images, 'in1k' 64x64: "),
    (
      {"features": {"file": "image/filename"}},
      "source 'extra' makes file bytes.* features, 'in1k' no",
    ),
    ({"ops": "no_such_op"}, "source 'extra': .*no_such_op"),
  ],
)
def test_a_source_whose_output_differs_is_named_in_one_line(digits_dir, photos_dir, extra, said):
  with pytest.raises(ValueError, match=said) as e:
    two(digits_dir, photos_dir, extra=extra)
  assert "\n" not in str(e.value)


def blocked(digits_dir, photos_dir, shard=(0, 1), workers=0, weights=None):
  """The stages of the two sources in the block order (blocks of 16 records), process
  `shard[0]` of `shard[1]`, batches of 16 a process."""
  keywords = dict(batch_size=16, image_size=16, seed=0, order="blocks", block_records=16)
  keywords.update(shard_index=shard[0], shard_count=shard[1])
  keywords["performance"] = dict(num_workers=workers, record_cache_mb=0, read_ahead=2)
  sources = {"in1k": digits_dir, "extra": photos_dir}
  weights = weights or {"in1k": 0.3, "extra": 0.7}
  return dataset.Stages(**mixture.stages(sources, "train", weights=weights, **keywords))


def source_records(sampler, s: int, uses: int) -> np.ndarray:
  """Source `s`'s own record index at each of its first `uses` uses in a process's stream."""
  positions = np.flatnonzero(sampler.sources(np.arange(uses * 4)) == s)[:uses]
  return sampler.records(positions)[1] - sampler.offsets[s]


def test_in_the_block_order_each_source_reads_its_own_blocks_once_an_epoch(digits_dir, photos_dir):
  st = blocked(digits_dir, photos_dir)
  sampler = st.plan.sampler
  for s, own in enumerate(sampler.samplers):
    assert own.blocks is not None and own.blocks.block_records == 16
    n = own.num_records
    epochs = source_records(sampler, s, 2 * n)  # each epoch every record once, a new order
    assert sorted(epochs[:n]) == sorted(epochs[n:]) == list(range(n))
    assert list(epochs[:n]) != list(epochs[n:])
  it = iter(dataset.chain(st))
  batches = take(it, 50)  # 800 images: an epoch of the digits' 240, 16 of the photos' 48
  assert abs(np.mean(np.concatenate([b["source"] for b in batches]) == 1) - 0.7) < 0.01
  # every block of each epoch begun read once: no more (read ahead: 2 batches), no fewer
  begun, done = sampler.used((50 + 2) * 16), sampler.used(50 * 16)
  counts = [own.blocks.count for own in sampler.samplers]
  sizes = [own.num_records for own in sampler.samplers]
  most = sum(c * -(-u // n) for c, u, n in zip(counts, begun.tolist(), sizes))
  least = sum(c * (u // n) for c, u, n in zip(counts, done.tolist(), sizes))
  assert least <= st.read.stats.requests <= most
  assert st.read.stats.request_records / st.read.stats.requests >= 8  # not one per image
  assert "blocks of 16, each source its own" in st.stream["order"]


def test_in_the_block_order_each_process_reads_its_own_share_of_each_sources_blocks(
  digits_dir, photos_dir
):
  samplers = [blocked(digits_dir, photos_dir, (p, 2)).plan.sampler for p in range(2)]
  positions = np.arange(5 * 16)
  np.testing.assert_array_equal(*(m.sources(positions) for m in samplers))  # the same slots
  for s, own in enumerate(samplers[0].samplers):
    loads = own.blocks.loads(2)
    shares = [set(source_records(m, s, int(loads[p])).tolist()) for p, m in enumerate(samplers)]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(own.num_records))
    cuts = np.asarray(own.cuts, np.int64)  # where shares cut at records split a block
    # one shard a source: blocks of 16, each part between cuts a read of its own
    block_of = lambda records, c=cuts: {
      (r // 16, int(np.searchsorted(c, r, "right"))) for r in records
    }
    assert not block_of(shares[0]) & block_of(
      shares[1]
    )  # a block (a cut one's part): one process's


def test_a_block_ordered_mixture_resumes_exactly_also_in_worker_processes(digits_dir, photos_dir):
  expected = take(iter(dataset.chain(blocked(digits_dir, photos_dir))), 12)
  assert_same_batches(
    expected, take(iter(dataset.chain(blocked(digits_dir, photos_dir, workers=1))), 12)
  )
  it = iter(dataset.chain(blocked(digits_dir, photos_dir)))
  take(it, 7)
  state = it.get_state()
  resumed = iter(dataset.chain(blocked(digits_dir, photos_dir)))
  resumed.set_state(state)
  assert_same_batches(expected[7:], take(resumed, 5))
  halves = iter(dataset.chain(blocked(digits_dir, photos_dir, weights={"in1k": 1, "extra": 1})))
  halves.set_state(state)  # other weights: each source continues its own block order
  assert abs(np.mean(np.concatenate([b["source"] for b in take(halves, 4)])) - 0.5) < 0.02
  with pytest.raises(StateError, match="read in blocks of 16.*this one reads in the global order"):
    iter(mixed(digits_dir, photos_dir, batch_size=16)).set_state(state)


def test_through_the_rig_a_mixture_reads_in_the_block_order_few_requests_per_image(
  storage_rig, digits_dir, photos_dir
):
  with storage_rig.mount(photos_dir, latency_ms=1) as m:
    sources = {"in1k": digits_dir, "extra": str(m.path)}  # one source on a mount
    keywords = dict(batch_size=8, image_size=16, seed=0, shard_index=0, shard_count=1)
    keywords["performance"] = dict(num_workers=0, record_cache_mb=0)
    st = dataset.Stages(
      **mixture.stages(sources, "train", weights={"in1k": 1, "extra": 1}, **keywords)
    )
    assert st.read.ranges is not None and "each source its own" in st.stream["order"]
    take(iter(dataset.chain(st)), 2 * 48 // 4)  # two epochs of the photos
    assert st.read.stats.request_records / st.read.stats.requests >= 8
