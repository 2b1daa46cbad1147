"""Built-in datasets made from images that installed packages ship (no downloads).

`digits`: scikit-learn's 1797 handwritten digits (10 classes) upscaled to 32x32 RGB JPEGs,
small enough for MobileNet to learn on a CPU in minutes. `photos`: ImageNet-like JPEGs
(about 470x390 px, ~100 KB, quality 90) cut from the sample photos of scikit-learn and
scikit-image by random crops, scales, flips and colour jitter; one class per source photo.
DATA may be a gs:// URL: the raw images are then made in a local cache folder and only the
datasets are written into the bucket, as `convert images` writes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import sys
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter

from pipeline.catalog import manifest as manifest_lib
from pipeline.convert import bucket, images, shards
from pipeline.convert.shards import Progress

DIGITS_SIZE = 32
PHOTO_SIZE = (470, 390)  # width, height: the mean of ImageNet's training images is ~400x350
PHOTO_QUALITY = 90
VAL_FRACTION = 0.2
SHARD_SIZE_MB = 8  # the 90 MB of photos make 12 shards: parallel readers get their own


def _sklearn_sample(name: str) -> Callable[[], np.ndarray]:
  def load() -> np.ndarray:
    from sklearn.datasets import load_sample_image

    return load_sample_image(name)

  return load


def _skimage(name: str) -> Callable[[], np.ndarray]:
  def load() -> np.ndarray:
    import skimage.data

    return getattr(skimage.data, name)()

  return load


# Colour photos only; the order fixes which classes a `num_classes` subset gets.
PHOTO_SOURCES: dict[str, Callable[[], np.ndarray]] = {
  "astronaut": _skimage("astronaut"),
  "chelsea": _skimage("chelsea"),
  "coffee": _skimage("coffee"),
  "rocket": _skimage("rocket"),
  "china": _sklearn_sample("china.jpg"),
  "flower": _sklearn_sample("flower.jpg"),
  "hubble": _skimage("hubble_deep_field"),
  "immunohistochemistry": _skimage("immunohistochemistry"),
  "retina": _skimage("retina"),
}


def make_digits(
  directory: str | os.PathLike, num_images: int | None = None, progress: bool = False
) -> int:
  """Writes scikit-learn's digits as DIR/DIGIT/NNNN.jpg (32x32 RGB); returns the count."""
  from sklearn.datasets import load_digits

  digits = load_digits()
  count = len(digits.images) if num_images is None else min(num_images, len(digits.images))
  with Progress(count, "make digits", "image", progress) as bar:
    for i in range(count):
      pixels = (digits.images[i] * (255.0 / 16.0)).round().astype(np.uint8)
      im = Image.fromarray(pixels).resize((DIGITS_SIZE, DIGITS_SIZE), Image.BICUBIC)
      folder = os.path.join(directory, str(digits.target[i]))
      os.makedirs(folder, exist_ok=True)
      im.convert("RGB").save(os.path.join(folder, f"{i:04d}.jpg"), quality=95)
      bar.update(1)
  return count


def _builtin_size(rng: np.random.Generator) -> tuple[int, int]:
  """The built-in photos' (width, height): PHOTO_SIZE +- 40 px."""
  return PHOTO_SIZE[0] + int(rng.integers(-40, 41)), PHOTO_SIZE[1] + int(rng.integers(-40, 41))


def _photo(
  source: np.ndarray,
  rng: np.random.Generator,
  size_of: Callable[[np.random.Generator], tuple[int, int]] = _builtin_size,
  noise: float = 14.0,
) -> Image.Image:
  """A random crop (8-100% of the area, aspect 3:4-4:3), scaled to `size_of(rng)` (width,
  height), flipped, jittered, sharpened and given Gaussian noise of std `noise`."""
  height, width = source.shape[:2]
  for _ in range(10):
    area = height * width * rng.uniform(0.08, 1.0)
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    w, h = round(float(np.sqrt(area * aspect))), round(float(np.sqrt(area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      break
  else:
    w, h = width, height
  x, y = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
  size = size_of(rng)
  im = Image.fromarray(source[y : y + h, x : x + w]).resize(size, Image.BICUBIC)
  if rng.random() < 0.5:
    im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
  for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
    im = enhance(im).enhance(rng.uniform(0.7, 1.3))
  # Sharpening and sensor-like noise: upscaled crops are smoother than camera photos, and
  # JPEG size (hence decode cost) follows detail; this brings them to ~100 KB.
  im = im.filter(ImageFilter.UnsharpMask(radius=2, percent=120, threshold=2))
  noisy = np.asarray(im, np.float32) + rng.normal(0.0, noise, (size[1], size[0], 3))
  return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


@functools.cache
def _source(name: str) -> np.ndarray:
  return np.ascontiguousarray(PHOTO_SOURCES[name]()[..., :3])


def _write_photos(
  task: tuple[int, ...], *, directory: str, names: tuple[str, ...], seed: int
) -> int:
  """Worker: writes photos number `task`; each has its own seeded generator."""
  for i in task:
    name = names[i % len(names)]
    im = _photo(_source(name), np.random.default_rng([seed, i]))
    im.save(os.path.join(directory, name, f"{name}_{i:05d}.jpg"), quality=PHOTO_QUALITY)
  return len(task)


def make_photos(
  directory: str | os.PathLike,
  num_images: int = 1000,
  seed: int = 0,
  num_classes: int | None = None,
  workers: int | None = None,
  progress: bool = False,
) -> int:
  """Writes ImageNet-like JPEGs as DIR/SOURCE/SOURCE_NNNNN.jpg; image i is class i % C.

  The files are the same whatever `workers` is (default: all cores).
  """
  names = tuple(PHOTO_SOURCES)[:num_classes]
  for name in names:
    os.makedirs(os.path.join(directory, name), exist_ok=True)
  tasks = [tuple(range(a, min(a + 25, num_images))) for a in range(0, num_images, 25)]
  work = functools.partial(_write_photos, directory=os.fspath(directory), names=names, seed=seed)
  workers = min(workers or os.cpu_count() or 1, len(tasks))
  with Progress(num_images, "make photos", "image", progress) as bar:
    for done in shards.ordered_map(work, tasks, workers):
      bar.update(done)
  return num_images


def _make_once(directory: str, make: Callable[[str], int]) -> None:
  """Builds a raw folder under a temporary name and renames it, so a half-built one is redone."""
  if os.path.isdir(directory):
    return
  tmp = directory + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  make(tmp)
  os.rename(tmp, directory)


def build(
  data_dir: str | os.PathLike, *, workers: int | None = None, progress: bool = True
) -> dict[str, manifest_lib.Manifest]:
  """Creates DATA/raw/{digits,photos} and converts them to DATA/digits and DATA/photos
  (splits train and validation); work already done is skipped, and datasets made from the
  same raw folders by an earlier version are rebuilt. A second build of the same DATA at
  once (two `make train` in a fresh clone) waits for the first, then finds its work done.
  For DATA in a bucket the raw folders are `raw_folder(DATA)`, on this machine."""
  data_dir = os.fspath(data_dir)
  if bucket.is_url(data_dir):
    bucket.check(data_dir)
  elif os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise NotADirectoryError(f"{data_dir} is a file, not a folder for the built-in datasets")
  raw = raw_folder(data_dir)
  with _exclusive(data_dir, raw if bucket.is_url(data_dir) else data_dir):
    return _build(data_dir, raw, workers=workers, progress=progress)


def raw_folder(data_dir: str) -> str:
  """Where the raw images of DATA are made: DATA/raw, or for DATA in a bucket the local
  cache folder $XDG_CACHE_HOME/pipeline/builtin-raw (default ~/.cache)."""
  if not bucket.is_url(data_dir):
    return os.path.join(data_dir, "raw")
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(cache, "pipeline", "builtin-raw")


@contextlib.contextmanager
def _exclusive(data_dir: str, folder: str):
  """Holds FOLDER/.builtin.lock (flock: released if the process dies) for one build."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, ".builtin.lock"), "a") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      print(
        f"convert builtin: another process is building {data_dir}; waiting for it to finish",
        file=sys.stderr,
        flush=True,
      )
      fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _build(
  data_dir: str, raw_dir: str, *, workers: int | None, progress: bool
) -> dict[str, manifest_lib.Manifest]:
  makers = {"digits": make_digits, "photos": functools.partial(make_photos, workers=workers)}
  manifests = {}
  for name, make in makers.items():
    raw, out = os.path.join(raw_dir, name), os.path.join(data_dir, name)
    _make_once(raw, functools.partial(make, progress=progress))
    request = images.Request(
      raw,
      out,
      val_fraction=VAL_FRACTION,
      seed=0,
      shard_size_mb=SHARD_SIZE_MB,
      overwrite=_made_from(out, raw),
    )
    manifests[name] = images.convert(request, workers=workers, progress=progress)
  return manifests


def _made_from(out: str, raw: str) -> bool:
  """Whether `out` holds a dataset converted from `raw` (one this command made before, which
  it may rebuild), rather than something else it must not replace."""
  try:
    return manifest_lib.load(out).created_by.get("source") == os.path.abspath(raw)
  except (FileNotFoundError, manifest_lib.ManifestError):
    return False
