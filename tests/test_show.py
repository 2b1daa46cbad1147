"""`python -m pipeline.show`: a contact sheet of one augmented training batch, each image
titled with the class it shows, from the real pipeline on a converted 20-class folder."""

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import pipeline
from pipeline import show
from tests.conftest import run_command


def class_colors() -> np.ndarray:
  """The RGB colour of each class of `classes20_dir` (hue k * 12)."""
  hsv = [Image.new("HSV", (1, 1), (k * 12, 200, 220)).convert("RGB") for k in range(20)]
  return np.array([np.array(im)[0, 0] for im in hsv], np.float32)


def test_each_image_is_titled_with_the_class_it_shows(classes20_dir):
  images, titles = show.examples(classes20_dir, batch_size=12, image_size=24, seed=1)
  assert images.shape == (12, 24, 24, 3) and images.dtype == np.uint8
  classes = pipeline.load_manifest(classes20_dir).classes
  means = images.reshape(12, -1, 3).mean(1)
  nearest = np.linalg.norm(means[:, None] - class_colors()[None], axis=-1).argmin(1)
  assert titles == [classes[k] for k in nearest]
  assert len(set(titles)) > 3  # a shuffled batch, not one class
  # The real training stream: the same pixels make_dataset gives for the same seed.
  ds = pipeline.make_dataset(
    classes20_dir, batch_size=12, image_size=24, seed=1, shard_index=0, shard_count=1
  )
  it = iter(ds)
  np.testing.assert_array_equal(next(it)["image"], images)
  it.close()


def test_mixed_labels_of_a_pp_string_are_titled_with_each_class_and_its_weight(classes20_dir):
  pp = (
    "decode_jpeg_and_inception_crop(24)|flip_lr|value_range(-1, 1)"
    "|onehot(num_classes, key='label', key_result='labels')|keep('image', 'labels')|mixup(p=1.0)"
  )
  fig = show.grid(classes20_dir, pp=pp, batch_size=8, columns=4)
  titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
  assert len(titles) == 8 and any(" + " in t for t in titles)
  classes = set(pipeline.load_manifest(classes20_dir).classes)
  for title in titles:
    names = [part.rsplit(" ", 1)[0] if " + " in title else part for part in title.split(" + ")]
    assert set(names) <= classes, title
  images = np.stack([ax.get_images()[0].get_array() for ax in fig.axes if ax.get_images()])
  assert images.dtype == np.uint8 and images.min() == 0 and images.max() == 255  # [-1, 1] shown


def run_show(*args: str) -> subprocess.CompletedProcess:
  return run_command([sys.executable, "-m", "pipeline.show", *args])


@pytest.mark.slow
def test_the_cli_writes_a_grid_png_and_never_replaces_one_unasked(classes20_dir, tmp_path):
  out = tmp_path / "sheets" / "grid.png"
  p = run_show(classes20_dir, "--batch", "12", "--image-size", "32", "--out", out)
  assert p.returncode == 0, p.stderr[-2000:]
  assert f"wrote {out}: 12 images" in p.stdout
  with Image.open(out) as im:
    assert im.format == "PNG" and im.size == (800, 700)  # 4 x 3 images of 2 x 2.2 inches
    pixels = np.asarray(im.convert("HSV"))
  # The images' saturated colours cover a good part of the sheet (a blank one has none).
  assert (pixels[..., 1] > 120).mean() > 0.2
  written = out.read_bytes()
  p = run_show(classes20_dir, "--out", out)
  assert p.returncode == 2 and p.stderr == f"error: {out} exists: pass --overwrite to replace it\n"
  assert out.read_bytes() == written
  p = run_show(classes20_dir, "--batch", "4", "--seed", "3", "--out", out, "--overwrite")
  assert p.returncode == 0, p.stderr[-2000:]
  assert out.read_bytes() != written


@pytest.mark.parametrize(
  "args, line",
  [
    (["{tmp}/none"], "error: {tmp}/none/manifest.json not found: convert the dataset first"),
    (["{data}", "--split", "test"], "error: {data} has no split 'test'; it has train, validation"),
    (["{data}", "--batch", "0"], "error: batch_size must be positive, got 0"),
    (["{data}", "--pp", "nonsense(3)"], "error: "),
    (["{data}", "--batch", "1438"], "error: a sheet shows at most 256 images, not 1438"),
    (["{data}", "--image-size", "100000"], "error: 16 images of 100000 px take 447.0 GiB; "),
  ],
)
def test_bad_input_is_one_line_with_exit_status_2(classes20_dir, tmp_path, args, line):
  fill = {"tmp": tmp_path, "data": classes20_dir}
  p = run_show(*[a.format(**fill) for a in args], "--out", tmp_path / "g.png")
  assert p.returncode == 2
  assert p.stderr.startswith(line.format(**fill)) and p.stderr.count("\n") == 1, p.stderr
  assert not (tmp_path / "g.png").exists()


def test_a_batch_too_large_for_memory_is_one_line(classes20_dir, tmp_path):
  """The loader's memory budget (`performance.memory_mb`) refuses it before anything is read."""
  pp = "decode_jpeg_and_inception_crop(10000000)"  # the size comes from the pp string
  p = run_show(classes20_dir, "--pp", pp, "--out", tmp_path / "g.png")
  assert p.returncode == 2 and "Traceback" not in p.stderr
  assert p.stderr.count("\n") == 1, p.stderr
  assert p.stderr.startswith("error: performance.memory_mb="), p.stderr
  assert "is below the least this loader holds" in p.stderr and "batch_size" in p.stderr
  assert not (tmp_path / "g.png").exists()


def test_the_cli_writes_exactly_the_path_it_names_in_the_type_it_names(classes20_dir, tmp_path):
  out = tmp_path / "sheet.pdf"
  p = run_show(classes20_dir, "--batch", "4", "--image-size", "16", "--out", out)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.startswith(f"wrote {out}: 4 images")
  assert out.read_bytes().startswith(b"%PDF") and list(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize(
  "out, line",
  [
    ("keep", "error: --out {out} does not end in an image type (avif, eps, "),
    ("keep.jsonl", "error: --out {out} does not end in an image type (avif, eps, "),
    ("folder", "error: --out {out} is a folder: name the image file, e.g. {out}/grid.png"),
  ],
)
def test_an_out_path_that_names_no_image_file_is_refused_and_nothing_replaced(
  classes20_dir, tmp_path, out, line
):
  (tmp_path / "keep.png").write_bytes(b"a sheet made earlier")
  (tmp_path / "folder").mkdir()
  before = sorted(tmp_path.iterdir())
  out = tmp_path / out
  p = run_show(classes20_dir, "--out", out, "--overwrite")
  assert p.returncode == 2 and p.stderr.startswith(line.format(out=out)), p.stderr
  assert p.stderr.count("\n") == 1
  assert sorted(tmp_path.iterdir()) == before and not list((tmp_path / "folder").iterdir())
  assert (tmp_path / "keep.png").read_bytes() == b"a sheet made earlier"


def test_help_and_import_pipeline_without_matplotlib():
  p = run_show("--help")
  assert p.returncode == 0 and "--overwrite" in p.stdout and "--pp" in p.stdout
  code = "import sys, pipeline, pipeline.show; print('matplotlib' in sys.modules)"
  p = run_command([sys.executable, "-c", code])
  assert p.stdout.strip() == "False", p.stderr
