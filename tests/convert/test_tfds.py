"""`pipeline.convert.tfds`: a locally prepared TFDS dataset becomes our shards, bytes copied."""

from __future__ import annotations

import io
import os
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
from array_record.python import array_record_module
from PIL import Image

from pipeline.catalog import manifest, records
from pipeline.convert import __main__ as cli
from pipeline.convert import tfds as convert_tfds


def jpeg_feature() -> tfds.features.Image:
  """An RGB image stored as the JPEG file given."""
  return tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg")


class Builder(tfds.core.GeneratorBasedBuilder):
  """A small builder of these tests, version 1.0.0: its examples hold its `features()`."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(self.features()))


class TinyShapes(Builder):
  """Three classes of small random JPEG images, prepared without TensorFlow."""

  def features(self):
    return {
      "image": jpeg_feature(),
      "label": tfds.features.ClassLabel(names=["circle", "square", "star"]),
      "file_name": tfds.features.Text(),
    }

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(12), "test": self._generate_examples(5)}

  def _generate_examples(self, n):
    rng = np.random.default_rng(n)
    for i in range(n):
      jpeg = io.BytesIO()  # encoded here: TFDS would encode arrays with TensorFlow
      Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(jpeg, "JPEG")
      jpeg.seek(0)
      yield i, {"image": jpeg, "label": i % 3, "file_name": f"img{i}.jpg"}


class UnlabeledShapes(TinyShapes):
  """TinyShapes whose test split has no labels: TFDS stores -1, as for ImageNet's test."""

  def _generate_examples(self, n):
    for key, example in super()._generate_examples(n):
      yield key, {**example, "label": -1 if n == 5 else example["label"]}


# TFDS looks up the code path of builders defined in packages through the optional
# `importlib_resources` backport; a top-level module name takes its plain-file route.
TinyShapes.__module__ = "tiny_shapes"
UnlabeledShapes.__module__ = "unlabeled_shapes"


def prepared(builder_class, data_dir) -> pathlib.Path:
  """Prepares the dataset with ArrayRecord files; returns its version folder."""
  builder = builder_class(data_dir=str(data_dir), file_format="array_record")
  builder.download_and_prepare()
  return pathlib.Path(builder.data_dir)


def tfds_records(builder, split) -> list[bytes]:
  """The serialized examples TFDS stored, read straight from its files in order."""
  out = []
  for path in builder.info.splits[split].filepaths:
    if builder.info.file_format.value == "array_record":
      reader = array_record_module.ArrayRecordReader(str(path))
      out += reader.read_all()
      reader.close()
    else:
      from pipeline.convert import tfrecord

      with open(path, "rb") as f:
        out += [
          tfrecord.read_record(f, str(path), i, *span)
          for i, span in enumerate(tfrecord.scan(str(path)))
        ]
  return out


@pytest.mark.parametrize(
  "file_format",
  [
    "array_record",
    # Slow only where TensorFlow is installed: TFDS then writes TFRecords through it.
    pytest.param("tfrecord", marks=pytest.mark.slow),
  ],
)
def test_prepared_tfds_dataset_converts_with_its_classes_and_keys(tmp_path, file_format):
  if file_format == "tfrecord":
    pytest.importorskip(
      "tensorflow", reason="TFDS writes TFRecord datasets only through TensorFlow (extra: peers)"
    )
  builder = TinyShapes(data_dir=str(tmp_path / "tfds"), file_format=file_format)
  builder.download_and_prepare()
  m = convert_tfds.convert(
    convert_tfds.Request("tiny_shapes", tmp_path / "out", data_dir=tmp_path / "tfds"),
    workers=1,
    progress=False,
  )
  assert m.classes == ["circle", "square", "star"]
  assert m.keys == records.Keys(image="image", label="label", filename="file_name")
  assert {s: m.splits[s].num_records for s in m.splits} == {"train": 12, "test": 5}
  for split in ("train", "test"):
    stored = []
    for path in m.shard_paths(tmp_path / "out", split):
      reader = array_record_module.ArrayRecordReader(str(path))
      stored += reader.read_all()
      reader.close()
    assert stored == tfds_records(builder, split)
    assert [s.bytes for s in m.splits[split].shards] == [
      os.path.getsize(p) for p in m.shard_paths(tmp_path / "out", split)
    ]
    assert sorted(records.parse(r, m.keys)[2] for r in stored) == sorted(
      f"img{i}.jpg" for i in range(len(stored))
    )
  one = convert_tfds.convert(
    convert_tfds.Request("tiny_shapes", tmp_path / "one", data_dir=tmp_path / "tfds", split="test"),
    workers=1,
    progress=False,
  )
  assert list(one.splits) == ["test"]
  with pytest.raises(KeyError, match="split 'nope' not in"):
    convert_tfds.convert(
      convert_tfds.Request("tiny_shapes", tmp_path / "x", data_dir=tmp_path / "tfds", split="nope"),
      progress=False,
    )
  assert manifest.load(tmp_path / "out").created_by["tool"] == "pipeline.convert tfds"


def test_a_split_without_labels_is_skipped_in_one_line_and_the_others_converted(tmp_path, capsys):
  version = prepared(UnlabeledShapes, tmp_path / "tfds")
  capsys.readouterr()
  out = tmp_path / "out"
  args = ["tfds", "unlabeled_shapes", str(out), "--data-dir", str(tmp_path / "tfds")]
  assert cli.main([*args, "--no-progress"]) == 0
  test = version / "unlabeled_shapes-test.array_record-00000-of-00001"
  assert capsys.readouterr().err.splitlines() == [
    f"convert tfds: skipped split 'test' of unlabeled_shapes/1.0.0: unlabeled (label -1 in "
    f"{test}:0); the pipeline needs class labels"
  ]
  assert list(manifest.load(out).splits) == ["train"]
  assert sorted(os.listdir(out)) == ["manifest.json", "train.array_record-00000-of-00001"]
  only = ["tfds", "unlabeled_shapes", str(tmp_path / "none"), "--data-dir", str(version)]
  assert cli.main([*only, "--split", "test", "--no-progress"]) == 2
  assert capsys.readouterr().err.splitlines()[-1] == (
    "error: unlabeled_shapes/1.0.0: no split with labels among ['test']"
  )
  assert not (tmp_path / "none").exists()


def test_split_repeats_and_data_dir_is_tfds_data_dir_or_a_version_folder(
  tmp_path, capsys, monkeypatch
):
  version = prepared(TinyShapes, tmp_path / "tfds")
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
  assert cli.main(["tfds", "tiny_shapes", str(tmp_path / "all"), "--no-progress"]) == 0
  assert list(manifest.load(tmp_path / "all").splits) == ["train", "test"]
  two = ["--split", "test", "--split", "train", "--data-dir", str(version), "--no-progress"]
  assert cli.main(["tfds", "tiny_shapes:1.0.0", str(tmp_path / "two"), *two]) == 0
  assert manifest.load(tmp_path / "two").splits == manifest.load(tmp_path / "all").splits
  capsys.readouterr()
  assert cli.main(["tfds", "other", str(tmp_path / "x"), "--data-dir", str(version)]) == 2
  assert capsys.readouterr().err == f"error: {version} holds tiny_shapes:1.0.0, not other\n"
  with pytest.raises(SystemExit):
    cli.main(["tfds", "--help"])
  assert "--split SPLIT         a split to convert; repeat for several (default: every" in (
    capsys.readouterr().out
  )


def test_a_missing_version_names_the_versions_there_are(tmp_path, capsys):
  prepared(TinyShapes, tmp_path / "tfds")
  capsys.readouterr()
  args = ["tfds", "tiny_shapes:9.9.9", str(tmp_path / "out"), "--data-dir", str(tmp_path / "tfds")]
  assert cli.main(args) == 2
  assert capsys.readouterr().err == (
    f"error: tiny_shapes:9.9.9: no TFDS build of 'tiny_shapes:9.9.9' in {tmp_path / 'tfds'}: "
    "it holds tiny_shapes 1.0.0\n"
  )


def test_a_missing_data_dir_names_the_dataset_and_how_to_build_it(tmp_path, capsys):
  missing = tmp_path / "no_tfds"
  args = ["tfds", "no_such_ds", str(tmp_path / "out"), "--data-dir", str(missing)]
  assert cli.main(args) == 2
  assert capsys.readouterr().err == (
    f"error: no_such_ds: TFDS data dir {missing} not found: run `tfds build no_such_ds "
    "--file_format=array_record`, or pass --data-dir\n"
  )
  assert not (tmp_path / "out").exists()
