"""Shared fixtures: small built-in datasets, converted once per test session.

Where a new test goes: a stage of the data flow (plan, read, decode, finish, hand-off,
stream) in the test_stage_*.py file named after it; a benchmark or the doctor in bench/;
a whole-pipeline guarantee in test_dataset.py, and the trainer in test_train_*.py.

`photos_dir`: 64 ImageNet-like JPEGs (~470x390, 4 classes), splits train (48) and
validation (16). `digits_dir`: 300 scikit-learn digits (32x32 RGB JPEGs, 10 classes),
splits train (240) and validation (60); `classes20_dir`: 120 small JPEGs of 20 classes,
splits train and validation. All are folders holding manifest.json and shards;
the raw image folders are `photos_raw` and `digits_raw`; `big_src` is 384 photos (hard
links) for a conversion to interrupt. `run_command` runs a command line to its end,
`run_python` a Python one from the repository root. `storage_rig` is bench.rig
(latency-injecting FUSE), built once; a machine that cannot run it skips the tests using it,
except in CI (CI=true): there they fail.
`native` (or `native_or_skip()`) is the C extension pipeline/image/_jpeg.c, on the same terms;
`decoder` runs a test with it and again with the Python fallback.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image

from pipeline.catalog import manifest
from pipeline.convert import builtin, images
from pipeline.image import decode
from tests.cluster import free_port  # noqa: F401 - test_train_*.py import it from here

REPO = pathlib.Path(__file__).resolve().parent.parent

_fixture_errors: dict[int, tuple[BaseException, str]] = {}
# Files whose tests run several trainer processes joined into one run (`make test-slow`): under
# pytest-xdist they form one unit of work, so one worker runs them one after another and at most
# one such run compiles beside the other workers' tests on a loaded machine.
TRAINER_CLUSTER_FILES = frozenset(
  f"tests/train/{name}.py"
  for name in ("test_train_multihost", "test_train_multihost_faults", "test_train_elastic")
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` (each file's module-scoped runs in one process), with the files of
  `TRAINER_CLUSTER_FILES` in one unit of work."""
  if config.getoption("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling

  class TrainerClustersTogether(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
      path = super()._split_scope(nodeid)
      return "trainer clusters" if path in TRAINER_CLUSTER_FILES else path

  return TrainerClustersTogether(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """A fixture that failed (a cluster of processes, say) is reported as an error once, at the
  first test that used it; the other tests that share it are skipped, pointing there."""
  report = (yield).get_result()
  if call.when != "setup" or call.excinfo is None or report.skipped:
    return
  error = call.excinfo.value
  first = _fixture_errors.setdefault(id(error), (error, item.nodeid))[1]
  if first != item.nodeid:
    report.outcome = "skipped"
    report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: the error at {first}")


def converted(raw: pathlib.Path, val_fraction: float) -> pathlib.Path:
  """The image folder RAW converted into data/ beside it, `val_fraction` of it validation."""
  out = raw.parent / "data"
  images.convert(
    images.Request(raw, out, val_fraction=val_fraction, seed=0), workers=1, progress=False
  )
  return out


@pytest.fixture(scope="session")
def photos_raw(tmp_path_factory) -> pathlib.Path:
  raw = tmp_path_factory.mktemp("photos") / "raw"
  builtin.make_photos(raw, num_images=64, seed=0, num_classes=4, workers=1)
  return raw


@pytest.fixture(scope="session")
def photos_dir(photos_raw) -> pathlib.Path:
  return converted(photos_raw, val_fraction=0.25)


def linked_photos(photos_raw: pathlib.Path, src: pathlib.Path, copies: int) -> pathlib.Path:
  """SRC holding `copies` hard links of each of the photos (same class folders): a source
  that converts long enough to be interrupted."""
  for i in range(copies):
    for f in photos_raw.rglob("*.jpg"):
      (src / f.parent.name).mkdir(parents=True, exist_ok=True)
      os.link(f, src / f.parent.name / f"{i:02d}_{f.name}")
  return src


@pytest.fixture(scope="session")
def big_src(photos_raw) -> pathlib.Path:
  """384 photos (6 hard links of each of the photos), for conversions to interrupt."""
  return linked_photos(photos_raw, photos_raw.parent / "big_src", copies=6)


@pytest.fixture(scope="session")
def digits_raw(tmp_path_factory) -> pathlib.Path:
  raw = tmp_path_factory.mktemp("digits") / "raw"
  builtin.make_digits(raw, num_images=300)
  return raw


@pytest.fixture(scope="session")
def digits_dir(digits_raw) -> pathlib.Path:
  return converted(digits_raw, val_fraction=0.2)


@pytest.fixture(scope="session")
def classes20_dir(tmp_path_factory) -> pathlib.Path:
  """A converted folder of 20 classes ("class00".."class19", 6 JPEGs of 40x32 each, a hue
  per class): a dataset that is not the 10 digits."""
  raw = tmp_path_factory.mktemp("classes20") / "raw"
  rng = np.random.default_rng(0)
  for k in range(20):
    (raw / f"class{k:02d}").mkdir(parents=True)
    color = np.array(Image.new("HSV", (1, 1), (k * 12, 200, 220)).convert("RGB"))[0, 0]
    for i in range(6):
      noise = rng.integers(-40, 40, size=(32, 40, 3))
      pixels = np.clip(color + noise, 0, 255).astype(np.uint8)
      Image.fromarray(pixels).save(raw / f"class{k:02d}" / f"{i}.jpg", quality=90)
  return converted(raw, val_fraction=0.2)


def build_or_skip(what: str, build, unavailable: type[Exception]):
  """`build()`'s result; a machine that cannot build `what` skips the test with the reason,
  except in CI (CI=true), where the part is expected: there the test fails."""
  try:
    return build()
  except unavailable as e:
    if os.environ.get("CI", "").lower() == "true":
      pytest.fail(f"{what} unavailable in CI: {e}")
    pytest.skip(f"{what} unavailable: {e}")


def native_or_skip():
  """The C extension (`pipeline.image._jpeg`); where it was not built the test is skipped, except in
  CI (CI=true), where it fails."""

  def load():
    if decode.native() is None:
      raise ImportError(decode._missing)
    return decode.native()

  return build_or_skip("the C JPEG decoder (pipeline/image/_jpeg.c)", load, ImportError)


@pytest.fixture
def native():
  return native_or_skip()


@pytest.fixture(params=["libjpeg-turbo extension", "simplejpeg fallback"])
def decoder(request, monkeypatch):
  """Runs a test with the C extension and again as if it had not been built."""
  if request.param == "simplejpeg fallback":
    monkeypatch.setattr(decode, "_jpeg", None)
  else:
    native_or_skip()
  return request.param


@pytest.fixture(scope="session")
def storage_rig():
  """bench.rig with its filesystem built (FUSE 3 installed first if needed and allowed)."""
  from bench import rig

  build_or_skip("storage rig", rig.ensure_built, rig.RigUnavailable)
  return rig


@pytest.fixture
def write_dataset():
  """Writes a one-shard split "train" holding exactly the given records, bypassing the
  converter's checks (for records it would refuse); returns the dataset folder."""

  def write(path: pathlib.Path, recs: list[bytes], classes=("a", "b")) -> str:
    path.mkdir(parents=True, exist_ok=True)
    name = "train.array_record-00000-of-00001"
    writer = ArrayRecordWriter(str(path / name), "group_size:1,uncompressed")
    for r in recs:
      writer.write(r)
    writer.close()
    sha = hashlib.sha256((path / name).read_bytes()).hexdigest()
    split = manifest.Split(len(recs), [manifest.Shard(name, len(recs), sha)])
    manifest.save(manifest.Manifest(list(classes), {"train": split}), path)
    return str(path)

  return write


def run_command(args, cwd=REPO, env=None, input=None, timeout: float = 300):
  """Runs the command line ARGS (str() of each) from `cwd` to its end, a hang failing at
  `timeout`; returns the finished process, its output as text, whatever its exit status.
  `env`, when given, is the whole environment; `input` the text on stdin."""
  args = [str(a) for a in args]
  return subprocess.run(
    args, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=timeout
  )


@pytest.fixture
def run_python():
  """Runs `python ARGS...` in a fresh process from the repository root, as a user would
  (progress bars off); returns the finished process, its output as text, whatever its
  exit status."""

  def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return run_command([sys.executable, *args], env=env, timeout=timeout)

  return run


def jpeg(seed: int, size=(90, 120)) -> bytes:
  """A JPEG of random pixels."""
  rng = np.random.default_rng(seed)
  arr = rng.integers(0, 255, (*size, 3), np.uint8)
  buf = io.BytesIO()
  Image.fromarray(arr).save(buf, "JPEG", quality=90)
  return buf.getvalue()


def take(it, n: int) -> list[dict]:
  """The next `n` batches of an iterator."""
  return [next(it) for _ in range(n)]


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
  """Both lists hold the same batches: same keys, bitwise equal arrays."""
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
