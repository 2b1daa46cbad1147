"""`decoding.on="device"`: windows decoded by nvImageCodec, on its CPU backend where there is no GPU
(as in CI, where the `gpu` extra is installed and these tests must run, not skip)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from PIL import Image

from pipeline.catalog import records
from pipeline.dataset import BadRecordError, make_dataset
from pipeline.image import nvdecode
from tests.conftest import build_or_skip, jpeg, native_or_skip


class NoExtra(ImportError):
  pass


def _windows() -> nvdecode.Windows:
  if not nvdecode.available():
    raise NoExtra(f"nvImageCodec is not installed: {nvdecode.EXTRA}")
  return nvdecode.Windows(nvdecode.local_gpus())


@pytest.fixture
def windows() -> nvdecode.Windows:
  native_or_skip()
  return build_or_skip("nvImageCodec (the gpu extra)", _windows, NoExtra)


def batches(data_dir, split: str, n: int, on: str = "device", state=None, **keywords) -> list:
  keywords.setdefault("performance", dict(num_workers=0, num_threads=2))
  it = iter(make_dataset(data_dir, split, decoding=dict(on=on, dct_scaling=False), **keywords))
  if state is not None:
    it.set_state(state)
  return [next(it) for _ in range(n)]


def test_a_window_is_the_full_decode_cut_to_it(windows, photos_dir):
  """Region decode gives the whole image's pixels inside the window (PIL's libjpeg-turbo decode of
  the whole JPEG, cut), to the bit on the CPU backend."""
  if windows.gpus:
    pytest.skip("on a GPU nvJPEG's IDCT differs; bench/device_check.sh measures it")
  photos = sorted((photos_dir.parent / "raw").rglob("*.jpg"))[:6]
  rng = np.random.default_rng(0)
  for path in photos:
    data = path.read_bytes()
    whole = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    h, w = whole.shape[:2]
    for _ in range(4):
      ch, cw = int(rng.integers(h // 4, h)), int(rng.integers(w // 4, w))
      y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
      (got,) = windows.decode([data], [(y, x, ch, cw)])
      np.testing.assert_array_equal(got, whole[y : y + ch, x : x + cw])


@pytest.mark.parametrize("split", ["train", "validation"])
def test_batches_match_the_host_decoders_within_its_crop_edges(windows, photos_dir, split):
  """Same keys, shapes, dtypes, labels and masks as the C decoder's batches, each image from the
  same window and flip: per image at most 0.05 grey levels apart on average. What differs is the
  C decoder's window edge: libjpeg's cropped decode upsamples chroma at a window's left and right
  edge as at the image's, so where an edge splits a chroma pair that column moves (up to ~20
  levels on the test photos before the resize; the device windows equal the whole decode's)."""
  train = split == "train"
  keywords = dict(batch_size=8, image_size=64, train=train, seed=5)
  ours = batches(photos_dir, split, 2, **keywords)
  host = batches(photos_dir, split, 2, on="host", **keywords)
  for a, b in zip(ours, host):
    assert a.keys() == b.keys() == ({"image", "label"} | ({"mask"} if not train else set()))
    for key in a:
      assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype
    np.testing.assert_array_equal(a["label"], b["label"])
    if not train:
      np.testing.assert_array_equal(a["mask"], b["mask"])
    diff = np.abs(a["image"].astype(np.int16) - b["image"].astype(np.int16))
    per_image = diff.reshape(len(diff), -1).mean(1)
    if windows.gpus:  # nvJPEG's IDCT and upsampling: within a grey level, not measured in CI
      assert per_image.max() < 1.0, per_image
    else:
      assert per_image.max() < 0.05, per_image


def test_resume_gives_the_same_batches(windows, photos_dir):
  keywords = dict(batch_size=8, image_size=48, seed=2)
  it = iter(make_dataset(photos_dir, "train", decoding=dict(on="device"), **keywords))
  next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(3)]
  resumed = batches(photos_dir, "train", 3, state=state, **keywords)
  for a, b in zip(expected, resumed):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_a_broken_jpeg_is_named_as_on_the_host(windows, tmp_path, write_dataset):
  good = [records.encode(jpeg(i), i % 2) for i in range(6)]
  truncated = jpeg(9)[:300]
  recs = good[:3] + [records.encode(truncated, 0)] + good[3:]
  data = write_dataset(tmp_path / "bad", recs)
  keywords = dict(batch_size=7, train=False, image_size=32)
  messages = []
  for on in ("host", "device"):
    with pytest.raises(BadRecordError, match=r"train\.array_record-00000-of-00001 record 3") as e:
      batches(data, "train", 1, on=on, **keywords)
    messages.append(str(e.value))
  assert messages[0] == messages[1] and "\n" not in messages[1]


def test_skipped_records_and_other_formats_as_on_the_host(windows, tmp_path, write_dataset):
  """A PNG takes the host's path; a broken JPEG is skipped under on_error="skip" and masked."""
  png = io.BytesIO()
  Image.fromarray(np.full((40, 50, 3), 200, np.uint8)).save(png, "PNG")
  recs = [records.encode(jpeg(i), i % 2) for i in range(5)]
  recs += [records.encode(png.getvalue(), 1), records.encode(jpeg(7)[:300], 0)]
  data = write_dataset(tmp_path / "mixed", recs)
  keywords = dict(batch_size=8, train=False, image_size=32, on_error="skip")
  (ours,), (host,) = (batches(data, "train", 1, on=on, **keywords) for on in ("device", "host"))
  np.testing.assert_array_equal(ours["mask"], host["mask"])
  assert ours["mask"].sum() == 6
  np.testing.assert_array_equal(ours["image"][5], host["image"][5])  # the PNG, decoded alike


def test_the_plan_line_says_where_windows_are_decoded(windows, photos_dir, capfd):
  """Chosen for the host (performance={}): the process that owns the devices decodes, no workers."""
  batches(photos_dir, "train", 1, batch_size=8, image_size=32, performance={})
  where = "nvImageCodec on GPU" if windows.gpus else "nvImageCodec's CPU backend"
  line = r"pipeline: no worker processes, \d+ decode threads \(windows decoded by "
  assert re.search(line + re.escape(where), capfd.readouterr().err)


@pytest.mark.parametrize(
  "keywords, message",
  [
    (dict(performance=dict(num_workers=2)), "set performance.num_workers=0 or None, got 2"),
    (dict(decoding=dict(on="device", cache_mb=64.0)), "set decoding.cache_mb=0"),
    (dict(decoding=dict(on="device", fast_dct=True)), "decoding.fast_dct is the C decoder's"),
    (dict(decoding=dict(on="gpu")), "decoding.on must be one of ('host', 'device'), got 'gpu'"),
  ],
)
def test_settings_it_cannot_honour_are_refused_in_one_line(photos_dir, keywords, message):
  if nvdecode.available() or "on must be" in message:
    keywords = {"decoding": dict(on="device"), **keywords}
  else:
    message = "decoding.on='device' needs nvImageCodec"
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
    make_dataset(photos_dir, "train", batch_size=8, **keywords)
  assert "\n" not in str(e.value)


def test_region_decode_is_not_dct_scaled(windows, photos_dir):
  """With dct_scaling on (the default), the host decodes large windows at 1/2..1/8 and the device
  at full size: at 32 px the two differ by DCT scaling's amount (`pipeline.Decoding`)."""
  keywords = dict(batch_size=8, image_size=32, seed=1, performance=dict(num_workers=0))
  ours = next(iter(make_dataset(photos_dir, "train", decoding=dict(on="device"), **keywords)))
  scaled = next(iter(make_dataset(photos_dir, "train", **keywords)))
  exact = batches(photos_dir, "train", 1, on="host", **keywords)[0]
  far = np.abs(ours["image"].astype(int) - scaled["image"].astype(int)).mean()
  near = np.abs(ours["image"].astype(int) - exact["image"].astype(int)).mean()
  assert near < 0.05 and far > 1.0, (near, far)


def test_pipeline_input_takes_it_as_one_setting(windows, photos_dir):
  """`pipeline.input` feeds the devices from it: jax.Arrays of the host path's shapes and labels."""
  import jax

  import pipeline

  fed = {
    on: pipeline.input(
      photos_dir, "train", global_batch_size=8, image_size=32, decoding=dict(on=on)
    )
    for on in ("device", "host")
  }
  ours, host = next(fed["device"]), next(fed["host"])
  assert isinstance(ours["image"], jax.Array) and ours["image"].shape == host["image"].shape
  np.testing.assert_array_equal(np.asarray(ours["label"]), np.asarray(host["label"]))
  for it in fed.values():
    it.close()
