"""Extra features: specs, batch arrays, and values read from real ArrayRecord records."""

import io

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader
from PIL import Image
from tensorflow_datasets.proto import tf_example_pb2

import pipeline
from pipeline import Feature
from pipeline.catalog import records
from pipeline.catalog.records import RecordError
from pipeline.pp import features

SHARD = "train.array_record-00000-of-00001"


def jpeg(value: int) -> bytes:
  out = io.BytesIO()
  Image.new("RGB", (16, 12), (value, 0, 255 - value)).save(out, "JPEG")
  return out.getvalue()


def example(i: int, **extra) -> bytes:
  """An image record (as the converter writes it) plus extra features: lists by type."""
  proto = tf_example_pb2.Example.FromString(records.encode(jpeg(i), i % 2, f"img{i}.jpg"))
  feature = proto.features.feature
  for key, values in extra.items():
    key = key.replace("__", "/")
    if values and isinstance(values[0], bytes):
      feature[key].bytes_list.value.extend(values)
    elif values and isinstance(values[0], float):
      feature[key].float_list.value.extend(values)
    else:
      feature[key].int64_list.value.extend(values)
  return proto.SerializeToString()


def rich(i: int) -> bytes:
  """Record i: an id, a box, a variable number of objects (i % 3) with labels and boxes."""
  return example(
    i,
    image__id=[1000 + i],
    image__key=[f"key-{i}".encode()],
    image__bbox=[0.1 * i, 0.2, 0.5, 0.5 + 0.1 * i],
    objects__label=list(range(i % 3)),
    objects__bbox=[float(i)] * 4 * (i % 3),
  )


@pytest.fixture
def shard(tmp_path, write_dataset):
  """Six rich records written to an ArrayRecord shard and read back as stored."""
  path = write_dataset(tmp_path / "ds", [rich(i) for i in range(6)])
  reader = ArrayRecordReader(f"{path}/{SHARD}")
  recs = reader.read(list(range(6)))
  reader.close()
  return recs


SPECS = {
  "id": "image/id",
  "key": Feature("image/key", dtype="bytes", max_bytes=16),
  "box": Feature("image/bbox", dtype="float32", shape=(4,)),
  "objects": Feature("objects/label", dtype="int32", max_length=3),
  "object_boxes": {"key": "objects/bbox", "dtype": "float32", "shape": [4], "max_length": 3},
}


def test_specs_take_record_keys_features_or_config_dicts(shard):
  specs = features.parse_specs(SPECS, sample=shard[0])
  assert specs["id"] == Feature("image/id", dtype="int32")  # the sample's type, jax-friendly
  assert specs["object_boxes"] == Feature("objects/bbox", "float32", (4,), max_length=3)
  sized = features.parse_specs({"box": "image/bbox", "key": "image/key"}, sample=shard[0])
  assert sized["box"] == Feature("image/bbox", dtype="float32", shape=(4,))
  assert sized["key"].dtype == "bytes"


def test_batch_arrays_have_one_row_per_example():
  specs = features.parse_specs({k: v for k, v in SPECS.items() if k != "id"})
  arrays = features.allocate(specs, 5)
  assert {k: (v.dtype.str, v.shape) for k, v in arrays.items()} == {
    "key": ("|O", (5,)),
    "box": ("<f4", (5, 4)),
    "objects": ("<i4", (5, 3)),
    "objects_length": ("<i4", (5,)),
    "object_boxes": ("<f4", (5, 3, 4)),
    "object_boxes_length": ("<i4", (5,)),
  }
  assert not any(v.any() for v in arrays.values())


def test_fill_writes_each_records_values_into_its_row(shard):
  specs = features.parse_specs(SPECS, sample=shard[0])
  arrays = features.allocate(specs, 6)
  arrays["objects"][:] = 7  # rows are fully rewritten, padding included
  for slot, record in enumerate(reversed(shard)):
    features.fill(specs, record, arrays, slot)
  ids = [1005, 1004, 1003, 1002, 1001, 1000]
  assert arrays["id"].tolist() == ids
  assert arrays["key"].tolist() == [f"key-{i - 1000}".encode() for i in ids]
  np.testing.assert_allclose(arrays["box"][5], [0.0, 0.2, 0.5, 0.5])
  np.testing.assert_allclose(arrays["box"][0], [0.5, 0.2, 0.5, 1.0])
  counts = [(i - 1000) % 3 for i in ids]
  assert arrays["objects_length"].tolist() == counts == arrays["object_boxes_length"].tolist()
  assert arrays["objects"].tolist()[:3] == [[0, 1, 0], [0, 0, 0], [0, 0, 0]]
  np.testing.assert_array_equal(arrays["object_boxes"][0], [[5] * 4, [5] * 4, [0] * 4])
  # The image path reads the same records as before.
  assert records.parse(shard[3])[1:] == (1, "img3.jpg")


def test_fill_accepts_an_already_parsed_example(shard):
  specs = features.parse_specs({"id": Feature("image/id", "int64")})
  arrays = features.allocate(specs, 1)
  features.fill(specs, tf_example_pb2.Example.FromString(shard[2]), arrays, 0)
  assert arrays["id"].tolist() == [1002] and arrays["id"].dtype == np.int64


@pytest.mark.parametrize(
  "spec, record, message",
  [
    (Feature("image/id", "int32"), example(0), r"missing feature 'image/id' \(batch key 'f'"),
    (
      Feature("image/key", "float32"),
      rich(0),
      "'image/key' is a bytes_list, expected a float_list for dtype float32",
    ),
    (Feature("image/bbox", "float32", (3,)), rich(0), "has 4 values, expected 3"),
    (Feature("objects/label", "int32", max_length=1), rich(2), "2 items, more than its max"),
    (Feature("objects/bbox", "float32", (3,), max_length=4), rich(1), "not a multiple"),
    (Feature("image/id", "int8"), rich(0), "1000..1000 does not fit int8"),
    (Feature("image/key", "bytes", max_bytes=3), rich(0), "5 bytes, more than its max_bytes"),
  ],
)
def test_fill_names_the_key_of_a_bad_feature(spec, record, message):
  specs = features.parse_specs({"f": spec})
  with pytest.raises(RecordError, match=message):
    features.fill(specs, record, features.allocate(specs, 1), 0)


def test_a_missing_feature_takes_its_default_or_has_no_items():
  specs = features.parse_specs(
    {"weight": Feature("w", "float32", default=1.0), "tags": Feature("tags", "bytes", max_length=2)}
  )
  arrays = features.allocate(specs, 1)
  features.fill(specs, example(0), arrays, 0)
  assert arrays["weight"].tolist() == [1.0] and arrays["tags_length"].tolist() == [0]


@pytest.mark.parametrize(
  "mapping, message",
  [
    ({"id": "image/id"}, "give its dtype"),
    ({"label": Feature("image/id", "int32")}, "'label' is already taken"),
    (
      {"n": Feature("a", "int32", max_length=2), "n_length": Feature("b", "int32")},
      "'n_length' is already taken",
    ),
    ({"x": Feature("a", "complex64")}, "dtype must be an integer, bool or float"),
    ({"x": Feature("a", "nonsense")}, "unknown dtype 'nonsense'"),
    ({"x": Feature("a", "float32", shape=(0,))}, "shape must be a tuple of positive ints"),
    ({"x": {"key": "a", "dtype": "int32", "length": 3}}, r"unknown field\(s\) \['length'\]"),
    ({"x": 3}, "expected a record key"),
    ({"x": Feature("a", "int8", default=300)}, "default 300 does not fit"),
    ({"x": Feature("a", "int8", max_length=2, default=0)}, "has no default"),
    (["image/id"], "features must map batch keys"),
  ],
)
def test_bad_specs_are_refused_with_the_feature_named(mapping, message):
  with pytest.raises(ValueError, match=message):
    features.parse_specs(mapping)


def test_a_bare_key_must_be_in_the_sample_record():
  with pytest.raises(ValueError, match=r"'image/id' has no values in the sample record \(it has"):
    features.parse_specs({"id": "image/id"}, sample=example(0))


def test_bytes_features_round_trip_exactly_trailing_nul_bytes_included(tmp_path, write_dataset):
  # numpy's fixed-width "S" dtype strips trailing NULs: b"\x07\x00" would come back b"\x07",
  # and a float32 array's bytes would be cut. Values come back exactly as stored.
  floats = np.array([1.5, 0.0], np.float32).tobytes()  # ends in four NUL bytes
  values = [b"\x07\x00", floats, b"", b"\x00\x00\x00", b"plain"]
  recs = [example(i, blob=[v], tags=[v, b"\x00"]) for i, v in enumerate(values)]
  path = write_dataset(tmp_path / "ds", recs)
  reader = ArrayRecordReader(f"{path}/{SHARD}")
  stored = reader.read(list(range(len(recs))))
  reader.close()
  specs = features.parse_specs(
    {"blob": Feature("blob", "bytes", max_bytes=8), "tags": Feature("tags", "bytes", max_length=3)}
  )
  arrays = features.allocate(specs, len(recs))
  for slot, record in enumerate(stored):
    features.fill(specs, record, arrays, slot)
  assert arrays["blob"].tolist() == values
  assert np.frombuffer(arrays["blob"][1], np.float32).tolist() == [1.5, 0.0]
  assert arrays["tags"].tolist() == [[v, b"\x00", b""] for v in values]
  assert arrays["tags_length"].tolist() == [2] * len(values)


def blobs(write_dataset, folder, values: list[bytes], **kwargs):
  """An eval dataset, written to `folder` by the `write_dataset` fixture, whose
  record i holds values[i] as the bytes feature "blob" (at most 8 bytes)."""
  path = write_dataset(folder, [example(i, blob=[v]) for i, v in enumerate(values)])
  blob = Feature("blob", "bytes", max_bytes=8)
  return pipeline.make_dataset(
    path, "train", train=False, image_size=8, features={"blob": blob}, **kwargs
  )


def test_bytes_features_arrive_exactly_through_the_dataset_and_device_feeding(
  tmp_path, write_dataset
):
  values = [b"\x07\x00", np.array([2.0, 0.0], np.float32).tobytes()] + [
    b"%d\x00" % i for i in range(7)
  ]
  host = blobs(write_dataset, tmp_path / "ds", values, batch_size=8)
  batches = list(pipeline.device_prefetch(host, remainder="pad", batch_size=8))
  got = [v for b in batches for v, m in zip(b["blob"], b["mask"]) if m]
  assert got == values
  assert batches[-1]["blob"].tolist() == [b"6\x00"] + [b""] * 7  # padding rows hold b""


def test_bytes_features_arrive_exactly_from_a_worker_process(tmp_path, write_dataset):
  values = [b"\x07\x00", np.array([3.0, 0.0], np.float32).tobytes(), b"", b"z\x00\x00"]
  workers = {"num_workers": 1, "num_threads": 1}
  ds = blobs(write_dataset, tmp_path / "ds", values, batch_size=2, performance=workers)
  it = iter(ds)
  try:
    got = [v for b in it for v in b["blob"].tolist()]
  finally:
    it.close()
  assert got == values
