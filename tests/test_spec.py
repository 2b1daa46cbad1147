"""The settings object and the batch plan: `Spec.of` checks and completes make_dataset's
keywords once; `plan.Sizes` is the one rule for batches per epoch and per stream."""

import inspect
import sys

import pytest

import pipeline
from pipeline.order.sampling import Sampler
from pipeline.stages import plan


def test_make_datasets_keywords_are_the_specs_fields_with_the_ops_group_spread_out():
  params = inspect.signature(pipeline.make_dataset).parameters
  spec = pipeline.Spec.of("data", batch_size=8, pp=None, ops="color_jitter(0.4)")
  assert list(params)[:3] == ["data_dir", "split", "batch_size"]
  assert {"pp", "ops", "batch_ops", "features", "decoding"} <= set(params)
  assert "normalize" not in params  # host: value_range; device: pipeline.input(normalize=)
  assert spec.transforms == pipeline.spec.Transforms(ops="color_jitter(0.4)")
  assert spec.augment == pipeline.Augment() and spec.performance == pipeline.Performance()
  assert spec.decoding == pipeline.Decoding()


def test_the_pixel_changing_options_are_decodings_and_a_field_in_the_wrong_group_is_one_line():
  spec = pipeline.Spec.of("data", batch_size=8, decoding={"fast_dct": True, "cache_mb": 64})
  assert spec.decoding == pipeline.Decoding(cache_mb=64, fast_dct=True)
  assert spec.performance == pipeline.Performance()
  with pytest.raises(ValueError, match=r"unknown Performance field\(s\) \['fast_dct'\]") as e:
    pipeline.Spec.of("data", batch_size=8, performance={"fast_dct": True})
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "train, shuffle, drop_remainder, num_epochs", [(True, True, True, None), (False, False, False, 1)]
)
def test_the_defaults_that_follow_from_train_are_filled_in(
  train, shuffle, drop_remainder, num_epochs
):
  spec = pipeline.Spec.of("data", "validation", batch_size=8, train=train)
  assert (spec.shuffle, spec.drop_remainder, spec.num_epochs) == (
    shuffle,
    drop_remainder,
    num_epochs,
  )
  given = pipeline.Spec.of("data", batch_size=8, train=train, shuffle=True, num_epochs=3)
  assert (given.shuffle, given.num_epochs) == (True, 3)


@pytest.mark.parametrize(
  "keywords, error",
  [
    (dict(batch_size=0), "batch_size must be positive, got 0"),
    (dict(batch_size="8"), r"batch_size must be an int, got '8' \(str\)"),
    (
      dict(batch_size=8, image_size=224.0),
      r"image_size must be an int or None, got 224.0 \(float\)",
    ),
    (dict(batch_size=8, seed="0"), r"^seed must be an int, got '0' \(str\)$"),
    (
      dict(batch_size=8, performance={"memory_mb": "500"}),
      r"^performance.memory_mb must be a number or None, got '500' \(str\)$",
    ),
    (
      dict(batch_size=8, augment={"area_range": "0.08"}),
      r"^augment.area_range must be a pair of numbers, got '0.08' \(str\)$",
    ),
    (
      dict(batch_size=8, decoding={"fast_dct": "yes"}),
      r"^decoding.fast_dct must be True or False, got 'yes' \(str\)$",
    ),
    (dict(batch_size=8, on_error="ignore"), "on_error must be 'raise' or 'skip', not 'ignore'"),
    (dict(batch_size=8, sharding="files"), "sharding must be 'records' or 'shards'"),
    (dict(batch_size=8, image_size=0), "image_size must be positive, got 0"),
    (
      dict(batch_size=8, augment={"flip": False, "zoom": 2}),
      r"unknown Augment field\(s\) \['zoom'\]",
    ),
  ],
)
def test_a_wrong_value_is_refused_before_any_data_is_opened(keywords, error):
  with pytest.raises(ValueError, match=error):
    pipeline.Spec.of("/nonexistent", **keywords)


def test_an_unknown_or_missing_keyword_is_a_type_error_naming_it():
  with pytest.raises(
    TypeError, match=r"make_dataset\(\) got an unexpected keyword argument 'batchsize'"
  ):
    pipeline.make_dataset("/nonexistent", batchsize=8)
  with pytest.raises(
    TypeError, match=r"make_dataset\(\) missing a required argument: 'batch_size'"
  ):
    pipeline.make_dataset("/nonexistent")


def test_sizes_count_full_batches_when_dropping_and_a_padded_last_one_otherwise():
  train = Sampler(100, shard_index=1, shard_count=3, remainder="drop")  # 33 records each
  assert plan.Sizes.of(train, 8, True, "'train'") == plan.Sizes(8, 4, sys.maxsize // 8)
  evaluation = Sampler(100, shard_count=3, num_epochs=2, remainder="pad")  # 34 each
  assert plan.Sizes.of(evaluation, 8, False, "'validation'") == plan.Sizes(8, 5, 9)
  with pytest.raises(ValueError, match="batch_size=40 is larger than the 33 records of 'train'"):
    plan.Sizes.of(train, 40, True, "'train'")


def test_a_global_batch_splits_evenly_over_the_processes_or_is_refused_naming_them():
  assert plan.process_batch_size(48, 4) == 12
  with pytest.raises(ValueError, match="global_batch_size=50 does not divide over the 4 processes"):
    plan.process_batch_size(50, 4)
  with pytest.raises(ValueError, match=r"config.batch_size must be a positive int, got 0"):
    plan.process_batch_size(0, 1, name="config.batch_size")
