"""Stage 3, decode/augment (pipeline.stages.decode, pipeline.image.decode, pipeline.image.augment):
records -> uint8 images and labels; crop windows inside the image and drawn from (seed, epoch,
index)."""

import numpy as np
import pytest

from pipeline.catalog import records
from pipeline.image import augment, decode
from pipeline.stages.ahead import AheadIterDataset
from tests import stage_chain
from tests.conftest import jpeg


@pytest.mark.parametrize("train", [True, False])
def test_the_decode_stage_over_grain_fills_images_and_the_records_labels(photos_dir, train):
  s = stage_chain.stages(photos_dir, "train" if train else "validation", train=train, num_epochs=1)
  it = AheadIterDataset(AheadIterDataset(stage_chain.planned(s), s.read), s.decode)
  for batch in it:
    assert batch.images.shape == (len(batch.indices), 32, 32, 3)
    assert batch.images.dtype == np.uint8 and not batch.bad.any()
    real = batch.real
    labels = [records.parse(r, s.manifest.keys)[1] for r, ok in zip(batch.records, real) if ok]
    assert batch.labels[real].tolist() == labels
    assert all(image.std() > 0 for image in batch.images[real])  # pixels, not blank slots


def test_random_resized_crop_stays_within_area_and_aspect_ranges():
  for h, w in [(390, 470), (500, 333), (224, 224), (1000, 120)]:
    for index in range(500):
      y, x, ch, cw = augment.random_resized_crop_box(h, w, augment.example_key(0, 0, index))
      assert 0 <= y and y + ch <= h and 0 <= x and x + cw <= w
      if (h, w) != (1000, 120):  # the extreme shape needs the documented fallback
        assert 0.08 * 0.97 <= ch * cw / (h * w) <= 1.0
        assert 3 / 4 * 0.97 <= cw / ch <= 4 / 3 * 1.03


def test_crop_fallback_is_centred_and_in_ratio():
  y, x, ch, cw = augment.random_resized_crop_box(
    1000, 120, augment.example_key(0, 0, 0), area=(0.99, 1.0)
  )
  assert (cw, x) == (120, 0) and ch == 160 and y == (1000 - 160) // 2


def test_an_examples_draws_depend_only_on_seed_epoch_and_index():
  key = augment.example_key(5, 1, 42)
  assert key == augment.example_key(5, 1, 42)
  assert (
    len(
      {
        key,
        augment.example_key(6, 1, 42),
        augment.example_key(5, 2, 42),
        augment.example_key(5, 1, 43),
      }
    )
    == 4
  )
  draws = [augment.uniform(augment.example_key(0, 0, i), 0) for i in range(4000)]
  assert 0 <= min(draws) and max(draws) < 1 and abs(np.mean(draws) - 0.5) < 0.02


def test_crop_decode_matches_full_decode_and_dct_scaling_halves(decoder):
  data = jpeg(0, (240, 320))
  full = decode.decode(data)
  crop = decode.decode_crop(data, (16, 32, 128, 160))
  assert crop.shape == (128, 160, 3)
  assert np.abs(crop.astype(int) - full[16:144, 32:192]).mean() < 2
  assert augment.dct_scale((0, 0, 240, 320), 112) == 2
  assert augment.dct_scale((0, 0, 240, 320), 224) == 1
  half = decode.decode_crop(data, (0, 0, 240, 320), scale=2)
  assert half.shape == (120, 160, 3)


def test_decode_refuses_garbage_and_truncated_jpeg(decoder):
  with pytest.raises(decode.DecodeError):
    decode.decode(b"not an image at all")
  data = jpeg(1, (240, 320))
  with pytest.raises(decode.DecodeError):
    decode.decode_crop(data[: len(data) // 2], (0, 0, 240, 320))
