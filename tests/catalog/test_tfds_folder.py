"""A TFDS ArrayRecord build read in place: `make_dataset`, `pipeline.input` and the trainer take
its version folder (or tfds://name) and serve the batches its `convert tfds` copy serves,
without writing a byte into the folder; what cannot be read so is refused in one line.

The builds are real: small `GeneratorBasedBuilder`s prepared here with
`file_format="array_record"` (TFDS writes those without TensorFlow).
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

import pipeline
from pipeline import dataset
from pipeline.catalog import manifest, records
from pipeline.convert import __main__ as convert_cli
from pipeline.convert import tfds as convert_tfds
from pipeline.convert import verify
from pipeline.stages import errors
from tests import stage_chain
from tests.conftest import assert_same_batches
from tests.convert.test_tfds import Builder, UnlabeledShapes, jpeg_feature
from tests.faults import test_stalled_exit as stalled
from tests.leftovers import clean_mount
from tests.storage.test_gcs import gcs, needs_emulator, run  # noqa: F401 - gcs is a fixture

REPO = pathlib.Path(__file__).resolve().parents[2]
CLASSES = ["cat", "dog", "fox"]


def _jpeg(rng) -> io.BytesIO:
  """A random JPEG of a random size (TFDS would encode arrays with TensorFlow)."""
  h, w = rng.integers(24, 64, 2)
  out = io.BytesIO()
  Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(out, "JPEG")
  out.seek(0)
  return out


class TinyPets(Builder):
  """JPEGs of three classes in splits train (40) and validation (9); 1.1.0 has other images
  under the same file names."""

  SUPPORTED_VERSIONS = [tfds.core.Version("1.1.0")]

  def features(self):
    labels = tfds.features.ClassLabel(names=CLASSES)
    return {"image": jpeg_feature(), "label": labels, "file_name": tfds.features.Text()}

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(40, 1), "validation": self._generate_examples(9, 2)}

  def _generate_examples(self, n, seed):
    rng = np.random.default_rng([seed, self.version.minor])
    for i in range(n):
      yield i, {"image": _jpeg(rng), "label": i % 3, "file_name": f"pet{seed}_{i}.jpg"}


class DepthPets(Builder):
  """16-bit PNGs: an image the decoder cannot serve as it is."""

  def features(self):
    image = tfds.features.Image(shape=(None, None, 1), dtype=np.uint16)
    return {"image": image, "label": tfds.features.ClassLabel(names=CLASSES)}

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    png = io.BytesIO()
    Image.fromarray(np.full((8, 8), 4000, np.uint16)).save(png, "PNG")
    for i in range(3):
      png.seek(0)
      yield i, {"image": io.BytesIO(png.read()), "label": i}


class CountPets(Builder):
  """A label that is an integer, not a ClassLabel: no class names."""

  def features(self):
    return {"image": jpeg_feature(), "label": tfds.features.Scalar(dtype=np.int64)}

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    rng = np.random.default_rng(0)
    for i in range(3):
      yield i, {"image": _jpeg(rng), "label": i}


# TFDS finds the code of builders defined in packages through the optional
# `importlib_resources` backport; a top-level module name takes its plain-file route.
for _builder in (TinyPets, DepthPets, CountPets):
  _builder.__module__ = _builder.name


def build(builder_class, data_dir, version=None, **download) -> pathlib.Path:
  """Prepares the dataset with ArrayRecord files; returns its version folder."""
  builder = builder_class(data_dir=str(data_dir), version=version, file_format="array_record")
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(**download))
  return pathlib.Path(builder.data_dir)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory) -> pathlib.Path:
  """The TFDS data dir holding tiny_pets/1.0.0, each split in 3 shards (its convert tfds copy
  has one per split)."""
  data_dir = tmp_path_factory.mktemp("tfds")
  build(TinyPets, data_dir, num_shards=3)
  return data_dir


@pytest.fixture(scope="module")
def folder(tfds_dir) -> pathlib.Path:
  return tfds_dir / "tiny_pets" / "1.0.0"


@pytest.fixture(scope="module")
def converted(tfds_dir, tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("converted") / "tiny_pets"
  convert_tfds.convert(
    convert_tfds.Request("tiny_pets", out, data_dir=tfds_dir), workers=1, progress=False
  )
  return out


def snapshot(folder) -> dict:
  """Every file under `folder`: (size, mtime in ns)."""
  return {
    os.path.relpath(os.path.join(root, name), folder): (
      os.stat(os.path.join(root, name)).st_size,
      os.stat(os.path.join(root, name)).st_mtime_ns,
    )
    for root, _, names in os.walk(folder)
    for name in names
  }


def first_batches(data_dir, split, n, **kwargs) -> list[dict]:
  ds = pipeline.make_dataset(
    data_dir, split, batch_size=8, image_size=24, shard_index=0, shard_count=1, **kwargs
  )
  it = iter(ds)
  try:
    return [next(it) for _ in range(n)]
  finally:
    it.close()


def test_the_manifest_comes_from_what_tfds_wrote(folder):
  m = pipeline.load_manifest(folder)
  assert m.classes == CLASSES
  assert m.keys == records.Keys(image="image", label="label", filename="file_name")
  assert {s: m.splits[s].num_records for s in m.splits} == {"train": 40, "validation": 9}
  train = m.splits["train"].shards
  assert [s.file for s in train] == [
    f"tiny_pets-train.array_record-0000{i}-of-00003" for i in (0, 1, 2)
  ]
  info = json.loads((folder / "dataset_info.json").read_text())
  (lengths,) = [s["shardLengths"] for s in info["splits"] if s["name"] == "train"]
  assert [s.num_records for s in train] == [int(n) for n in lengths]
  assert all(s.sha256 == "" and s.bytes is None for s in train)  # TFDS records neither
  assert m.read_from == "dataset_info.json"
  assert "read_from" not in m.to_json()


def test_batches_in_place_equal_the_converted_copys_and_the_folder_is_untouched(
  folder, converted, tfds_dir, monkeypatch
):
  before = snapshot(folder)
  train = first_batches(folder, "train", 6)  # 48 records: the shards' ends and an epoch's
  assert_same_batches(train, first_batches(converted, "train", 6))
  evaluation = first_batches(folder, "validation", 2, train=False)
  assert_same_batches(evaluation, first_batches(converted, "validation", 2, train=False))
  monkeypatch.setenv("TFDS_DATA_DIR", str(tfds_dir))
  assert pipeline.load_manifest("tfds://tiny_pets") == pipeline.load_manifest(folder)
  assert_same_batches(first_batches("tfds://tiny_pets:1.0.0", "train", 2), train[:2])
  fed = pipeline.input("tfds://tiny_pets", "validation", global_batch_size=8)
  assert (fed.num_examples, fed.classes, fed.steps_per_epoch) == (9, CLASSES, 2)
  np.testing.assert_array_equal(np.asarray(next(fed)["label"]), evaluation[0]["label"])
  fed.close()
  assert snapshot(folder) == before


def test_a_shard_that_is_not_what_tfds_recorded_is_refused(folder, tmp_path):
  copy = shutil.copytree(folder, tmp_path / "1.0.0")
  shard = copy / "tiny_pets-train.array_record-00001-of-00003"
  shutil.copy(copy / "tiny_pets-validation.array_record-00000-of-00003", shard)
  recorded = pipeline.load_manifest(copy).splits["train"].shards[1].num_records
  with pytest.raises(OSError, match=f"holds 3 records, the manifest {recorded}"):
    first_batches(copy, "train", 3)
  shard.unlink()
  with pytest.raises(manifest.ManifestError, match=f"shard {shard} is missing"):
    first_batches(copy, "train", 1)


def test_a_shard_tfds_lists_with_0_records_is_opened_and_refused_if_it_holds_any(folder, tmp_path):
  copy = shutil.copytree(folder, tmp_path / "1.0.0")
  info = json.loads((copy / "dataset_info.json").read_text())
  (train,) = [s for s in info["splits"] if s["name"] == "train"]
  held, train["shardLengths"][1] = train["shardLengths"][1], "0"
  (copy / "dataset_info.json").write_text(json.dumps(info))
  shard = copy / "tiny_pets-train.array_record-00001-of-00003"
  with pytest.raises(OSError, match=f"^shard {shard} holds {held} records, the manifest 0"):
    first_batches(copy, "train", 1)


def test_the_record_cache_tells_versions_with_the_same_shard_names_apart(folder, tmp_path):
  other = build(TinyPets, tmp_path / "tfds", version="1.1.0", num_shards=3)
  assert sorted(os.listdir(other)) == sorted(os.listdir(folder))
  perf = dict(record_cache_mb=0, record_cache_dir=str(tmp_path / "cache"), num_workers=0)

  def read_all(data_dir):
    stages = stage_chain.stages(data_dir, image_size=24, train=False, performance=perf)
    return stages, list(dataset.chain(stages))

  read_all(folder)
  stages, got = read_all(other)
  assert stages.read.stats.reads == 40  # none served from 1.0.0's entries
  assert_same_batches(got, first_batches(other, "train", 5, train=False))
  assert len(os.listdir(tmp_path / "cache")) == 2


def test_on_slow_storage_a_build_gets_the_record_cache_sized_by_its_records(storage_rig, folder):
  with storage_rig.mount(folder, latency_ms=5) as m:
    st = stage_chain.stages(m.path)
    st.read.source.close()  # the shard it opened: else the rig cannot unmount
  local = stage_chain.stages(folder)
  records_bytes = sum(len(r) for r in local.read.source.read(list(range(40))))
  assert st.read.cache is not None  # TFDS records no shard sizes: the records' are estimated
  assert records_bytes / 2 < st.read.cache.ram_bytes < records_bytes * 2


def test_verify_reads_every_record_of_a_build_and_says_there_is_no_digest(folder, tmp_path, capsys):
  before = snapshot(folder)
  assert convert_cli.main(["verify", str(folder), "--no-progress", "--workers", "2"]) == 0
  assert capsys.readouterr().out == (
    f"{folder}: train: 40, validation: 9 records; OK (dataset_info.json records no sha256: "
    "no digest compared)\n"
  )
  assert snapshot(folder) == before
  copy = shutil.copytree(folder, tmp_path / "1.0.0")
  shard = copy / "tiny_pets-train.array_record-00001-of-00003"
  shutil.copy(copy / "tiny_pets-validation.array_record-00000-of-00003", shard)
  assert verify.verify(copy, workers=1, progress=False).problems == [
    f"{shard.name}: 3 records, dataset_info.json says 14"
  ]


def _tfrecord_build(folder, tmp_path, file_format) -> pathlib.Path:
  """The build as TFDS lays out another file format: its dataset_info.json says so (made
  here from the ArrayRecord build: TFDS writes TFRecords only through TensorFlow)."""
  copy = shutil.copytree(folder, tmp_path / "tiny_pets" / "1.0.0")
  info = json.loads((copy / "dataset_info.json").read_text())
  if file_format is None:  # builds of TFDS before file formats: TFRecord
    del info["fileFormat"]
  else:
    info["fileFormat"] = file_format
  (copy / "dataset_info.json").write_text(json.dumps(info))
  return copy


@pytest.mark.parametrize("file_format", ["tfrecord", None])
def test_a_tfrecord_build_is_refused_with_the_convert_command(folder, tmp_path, file_format):
  copy = _tfrecord_build(folder, tmp_path, file_format)
  with pytest.raises(manifest.ManifestError) as e:
    pipeline.make_dataset(copy, "train", batch_size=4)
  assert str(e.value) == (
    f"{copy}/dataset_info.json: a tfrecord build, which cannot be read in place (no random "
    f"access): convert it once: python -m pipeline.convert tfds tiny_pets:1.0.0 OUT "
    f"--data-dir {tmp_path}"
  )


def test_refusals_are_one_line_naming_the_file_and_what_to_do(folder, tmp_path, monkeypatch):
  def refusal(call, error=ValueError) -> str:
    with pytest.raises(error) as e:
      call()
    assert "\n" not in str(e.value)
    return str(e.value)

  assert refusal(lambda: first_batches(folder, "test", 1), manifest.ManifestError) == (
    f"split 'test' not in {folder}/dataset_info.json; it has ['train', 'validation']"
  )
  assert refusal(lambda: first_batches(folder, "train", 1, verify="sha256")) == (
    f"{folder}/dataset_info.json records no sha256 of "
    "tiny_pets-train.array_record-00000-of-00003: use verify='size'"
  )
  assert refusal(lambda: pipeline.load_manifest(folder.parent), FileNotFoundError) == (
    f"{folder.parent}/manifest.json not found: convert the dataset first (python -m "
    f"pipeline.convert --help); {folder.parent} holds TFDS builds: pass a version folder, "
    f"e.g. {folder}"
  )
  damaged = shutil.copytree(folder, tmp_path / "damaged")
  (damaged / "dataset_info.json").write_text('{"name": "tiny_pets", "splits": [')
  assert refusal(lambda: pipeline.load_manifest(damaged)).startswith(
    f"{damaged}/dataset_info.json: not a readable TFDS build (ParseError: "
  )
  depth = build(DepthPets, tmp_path / "depth")
  assert refusal(lambda: pipeline.load_manifest(depth)) == (
    f"{depth}/features.json: image 'image' is uint16 of shape (None, None, 1); the decoder "
    "serves uint8 images of 1 or 3 channels: store 8-bit RGB or grayscale and rebuild"
  )
  counts = build(CountPets, tmp_path / "counts")
  assert refusal(lambda: pipeline.load_manifest(counts)) == (
    f"{counts}/features.json: no ClassLabel feature (image: Image, label: Scalar); the "
    "pipeline needs class labels: declare the label as tfds.features.ClassLabel(names=...) "
    "and rebuild"
  )
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
  assert refusal(lambda: pipeline.load_manifest("tfds://nope:2.0.0"), FileNotFoundError) == (
    f"tfds://nope:2.0.0: no TFDS build of 'nope:2.0.0' in {tmp_path} (set TFDS_DATA_DIR): run "
    "`tfds build nope --file_format=array_record`, or pass its version folder"
  )


def edited(folder, tmp_path, change) -> pathlib.Path:
  """A copy of the build whose dataset_info.json `change` edited."""
  copy = shutil.copytree(folder, tmp_path / "edited" / "1.0.0")
  info = json.loads((copy / "dataset_info.json").read_text())
  change({s["name"]: s for s in info["splits"]})
  (copy / "dataset_info.json").write_text(json.dumps(info))
  return copy


SHARD = "tiny_pets-train.array_record-00000-of-00003"


@pytest.mark.parametrize(
  "change, message",
  [
    (
      lambda s: s["train"].update(shardLengths=["13", "-14", "13"]),
      "split 'train' has shardLengths [13, -14, 13]: -14 is not a count of records",
    ),
    (
      lambda s: s["validation"].update(
        filepathTemplate="{DATASET}-train.{FILEFORMAT}-{SHARD_X_OF_Y}"
      ),
      f"shard '{SHARD}' is listed twice (split 'train' shard 0 and split 'validation' shard 0)",
    ),
    (
      lambda s: s["train"].update(filepathTemplate="{SPLIT}"),
      "shard 'train' is listed twice (split 'train' shard 0 and split 'train' shard 1)",
    ),
  ],
  ids=["a negative shard length", "two splits share shards", "a template without numbers"],
)
def test_dataset_info_is_checked_as_strictly_as_a_manifest_in_place_and_by_convert(
  folder, tmp_path, change, message
):
  copy = edited(folder, tmp_path, change)
  with pytest.raises(manifest.ManifestError) as e:
    pipeline.load_manifest(copy)
  assert str(e.value) == f"{copy}/dataset_info.json: {message}"
  with pytest.raises(manifest.ManifestError) as e:
    convert_tfds.convert(
      convert_tfds.Request("tiny_pets", tmp_path / "out", data_dir=copy), progress=False
    )
  assert str(e.value) == f"{copy}/dataset_info.json: {message}"
  assert not (tmp_path / "out").exists()


def test_a_class_named_twice_in_the_label_file_is_refused(folder, tmp_path):
  copy = shutil.copytree(folder, tmp_path / "1.0.0")
  (copy / "label.labels.txt").write_text("cat\ncat\nfox\n")
  with pytest.raises(manifest.ManifestError) as e:
    pipeline.load_manifest(copy)
  refusal = f"{copy}/label.labels.txt: class 'cat' is named twice (labels 0 and 1)"
  assert str(e.value) == refusal
  with pytest.raises(manifest.ManifestError) as e:
    convert_tfds.convert(
      convert_tfds.Request("tiny_pets", tmp_path / "out", data_dir=copy), progress=False
    )
  assert str(e.value) == refusal
  assert not (tmp_path / "out").exists()


def test_a_missing_version_names_the_versions_there_are(tfds_dir, monkeypatch):
  missing = tfds_dir / "tiny_pets" / "9.9.9"
  with pytest.raises(FileNotFoundError) as e:
    pipeline.load_manifest(missing)
  assert str(e.value) == (
    f"{missing}/manifest.json not found: convert the dataset first (python -m pipeline.convert "
    f"--help); {tfds_dir}/tiny_pets holds TFDS builds of versions 1.0.0, not 9.9.9"
  )
  monkeypatch.setenv("TFDS_DATA_DIR", str(tfds_dir))
  with pytest.raises(FileNotFoundError) as e:
    pipeline.load_manifest("tfds://tiny_pets:9.9.9")
  assert str(e.value) == (
    f"tfds://tiny_pets:9.9.9: no TFDS build of 'tiny_pets:9.9.9' in {tfds_dir}: it holds "
    "tiny_pets 1.0.0"
  )


def test_a_split_without_labels_is_refused_at_its_first_batch_saying_so(tmp_path):
  version = build(UnlabeledShapes, tmp_path / "tfds")
  assert set(first_batches(version, "train", 1, train=False)[0]["label"]) == {0, 1, 2}
  with pytest.raises(errors.BadRecordError) as e:
    first_batches(version, "test", 1, train=False)
  assert str(e.value) == (
    "unlabeled_shapes-test.array_record-00000-of-00001 record 0: label -1 outside [0, 3) of "
    "the manifest's classes; -1 is TFDS's 'no label': this split is unlabeled, read a labeled one"
  )


@needs_emulator
def test_a_build_in_a_bucket_reads_in_place_as_it_does_from_disk(gcs, folder):  # noqa: F811
  code = textwrap.dedent(
    """
    import sys
    import gcsfs
    import numpy as np
    import pipeline

    local, url = sys.argv[1], "gs://bkt/tfds/tiny_pets/1.0.0"
    fs = gcsfs.GCSFileSystem(token="anon")
    fs.put(local, url[len("gs://"):], recursive=True)
    listing = lambda: sorted((o["name"], o["size"], o["generation"]) for o in
                             fs.ls("bkt/tfds/tiny_pets/1.0.0", detail=True, refresh=True))
    before = listing()
    there, here = pipeline.load_manifest(url), pipeline.load_manifest(local)
    assert (there.splits, there.classes, there.keys) == (here.splits, here.classes, here.keys)

    def batches(data_dir, **order):
      ds = pipeline.make_dataset(data_dir, "train", batch_size=8, image_size=24,
                                 shard_index=0, shard_count=1, **order)
      it = iter(ds)
      out = [next(it) for _ in range(6)]
      it.close()
      return out

    # a bucket reads in block order by default; local disk only when asked
    for g, w in zip(batches(url), batches(local, order="blocks")):
      for key in w:
        np.testing.assert_array_equal(g[key], w[key])
    assert listing() == before, (listing(), before)
    print("same batches; bucket unchanged:", len(before), "objects")
    """
  )
  p = run(code, env=gcs, args=[str(folder)])
  assert p.returncode == 0, p.stderr[-3000:]
  assert "same batches" in p.stdout


@pytest.mark.slow
def test_the_trainer_trains_on_a_tfds_build(folder, tmp_path):
  before = snapshot(folder)
  cmd = [
    sys.executable,
    "-m",
    "train",
    "--config",
    str(REPO / "configs/default.py"),
    "--workdir",
    str(tmp_path / "work"),
    f"--config.input.data_dir={folder}",
    "--config.batch_size=8",
    "--config.num_steps=2",
    "--config.log_every=1",
    "--config.eval_every_steps=1000",
    "--config.synthetic_steps=2",
  ]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  env["PYTHONPATH"] = str(REPO)
  p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  summary = json.loads((tmp_path / "work" / "summary.json").read_text())
  assert summary["steps"] == 2
  assert snapshot(folder) == before


@pytest.mark.parametrize("how", ["tfds://", "a folder linking to it"])
def test_a_build_on_a_mount_that_stops_answering_ends_the_process_at_open(
  storage_rig, tfds_dir, tmp_path, how
):
  """tfds:// looked up in a $TFDS_DATA_DIR that does not answer, or a build's metadata read
  there, waits at most the read deadline: one line, then the process is gone."""
  script = tmp_path / "open.py"
  script.write_text(
    "import sys, pipeline\n"
    "if __name__ == '__main__':\n"
    "  pipeline.make_dataset(sys.argv[1], batch_size=4, shard_count=1, shard_index=0,\n"
    f"    performance=dict(read_deadline_s={stalled.DEADLINE_S}, num_workers=0))\n"
  )
  with clean_mount(storage_rig.mount(tfds_dir, latency_ms=1)) as m, m.stall():
    os.environ["TFDS_DATA_DIR"] = str(m.path)  # the process started next inherits it
    try:
      if how == "tfds://":
        data_dir, named = "tfds://tiny_pets", m.path
      else:  # the manifest's absence answers at once, the build's files wait
        data_dir = tmp_path / "linked"
        data_dir.mkdir()
        for name in os.listdir(tfds_dir / "tiny_pets" / "1.0.0"):
          (data_dir / name).symlink_to(m.path / "tiny_pets" / "1.0.0" / name)
        named = data_dir / "dataset_info.json"
      proc = stalled.start([sys.executable, str(script), str(data_dir)])
    finally:
      del os.environ["TFDS_DATA_DIR"]
    code, lines = stalled.ended(proc)
  assert code == 1, lines[-20:]
  stalled.no_answer(lines, str(named))
