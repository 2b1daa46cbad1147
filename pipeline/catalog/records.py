"""Record schema: serialized `tf.train.Example` protos, written and parsed without TensorFlow.

The proto is the TF-free copy that tensorflow-datasets ships, so TFRecord shards and
TFDS-prepared data read as they are. It is imported with this module, never on first use:
tensorflow_datasets' import swaps the interpreter's `__import__` for etils' lazy one while it
runs, which broke another thread's import at that moment (tensorboardX's, in the trainer,
while the decode threads parsed the first records). Feature keys are configurable through
`Keys`.
"""

from __future__ import annotations

import dataclasses

from tensorflow_datasets.proto import tf_example_pb2


class RecordError(ValueError):
  """A record that cannot be parsed; the message names the key and, where known, the place."""


@dataclasses.dataclass(frozen=True)
class Keys:
  """Feature keys of an image record. Defaults are ours; `TFDS_KEYS`, `KNOWN_KEYS`: others."""

  image: str = "image/encoded"
  label: str = "image/class/label"
  filename: str = "image/filename"


DEFAULT_KEYS = Keys()
TFDS_KEYS = Keys(image="image", label="label", filename="file_name")
KNOWN_KEYS = (DEFAULT_KEYS, TFDS_KEYS, Keys(image="data", label="category", filename="name"))
UNLABELED = -1  # TFDS's label of an example without one (ImageNet's test split)


def example_class() -> type:
  """`tf.train.Example`, as tensorflow-datasets ships it."""
  return tf_example_pb2.Example


def encode(image: bytes, label: int, filename: str = "", keys: Keys = DEFAULT_KEYS) -> bytes:
  """Serializes one image record as a `tf.train.Example`."""
  example = example_class()()
  feature = example.features.feature
  feature[keys.image].bytes_list.value.append(image)
  feature[keys.label].int64_list.value.append(int(label))
  if filename:
    feature[keys.filename].bytes_list.value.append(filename.encode("utf-8"))
  return example.SerializeToString(deterministic=True)


def parse(record: bytes, keys: Keys = DEFAULT_KEYS) -> tuple[bytes, int, str]:
  """Returns (image bytes, label, filename) of a serialized Example; raises `RecordError`."""
  try:
    feature = example_class().FromString(record).features.feature
  except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
    raise RecordError(f"not a tf.train.Example ({type(e).__name__}: {e})") from None
  if keys.image not in feature or not feature[keys.image].bytes_list.value:
    raise RecordError(f"missing bytes feature {keys.image!r} (has: {sorted(feature)})")
  if keys.label not in feature or not feature[keys.label].int64_list.value:
    raise RecordError(f"missing int64 feature {keys.label!r} (has: {sorted(feature)})")
  filename = ""
  if keys.filename in feature and feature[keys.filename].bytes_list.value:
    filename = feature[keys.filename].bytes_list.value[0].decode("utf-8", "replace")
  return (
    feature[keys.image].bytes_list.value[0],
    int(feature[keys.label].int64_list.value[0]),
    filename,
  )


def detect_keys(record: bytes) -> Keys:
  """Guesses which known schema a record uses (ours, TFDS's or data/category/name)."""
  try:
    feature = example_class().FromString(record).features.feature
  except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
    raise RecordError(f"not a tf.train.Example ({type(e).__name__}: {e})") from None
  for keys in KNOWN_KEYS:
    if keys.image in feature and keys.label in feature:
      return keys
  raise RecordError(f"unknown record schema; features: {sorted(feature)}; pass explicit keys")
