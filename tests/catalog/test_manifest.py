"""What a reader checks at open (`manifest.checked_shards`), what `manifest.load` refuses, and
what `verify` reports instead of hanging or saying OK."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import shutil
import subprocess
import sys

import google_crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline
from pipeline.catalog import manifest
from pipeline.convert import shards, verify

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def dataset(photos_dir, tmp_path) -> pathlib.Path:
  """A private copy of the converted photos (train 48, validation 16), safe to damage."""
  return shutil.copytree(photos_dir, tmp_path / "photos")


def shard_of(data_dir, split="train", index=0) -> pathlib.Path:
  return data_dir / manifest.load(data_dir).splits[split].shards[index].file


def edit(data_dir, change) -> None:
  d = json.loads((data_dir / manifest.FILENAME).read_text())
  change(d)
  (data_dir / manifest.FILENAME).write_text(json.dumps(d))


def in_a_process(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
  """Runs `code` in a new process: a call that would block forever fails on the timeout."""
  return subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
  )


def test_a_good_dataset_passes_every_level(dataset):
  m = manifest.load(dataset)
  for level in ("none", "size", "sha256"):
    paths = manifest.checked_shards(dataset, m, "train", verify=level)
    assert [p.name for p in paths] == [s.file for s in m.splits["train"].shards]


def test_a_missing_split_names_the_splits_there(dataset):
  with pytest.raises(
    manifest.ManifestError,
    match=r"split 'test' not in .*manifest.json; "
    r"it has \['train', 'validation'\]",
  ):
    manifest.checked_shards(dataset, manifest.load(dataset), "test")


def test_a_missing_shard_is_named(dataset):
  shard = shard_of(dataset)
  shard.unlink()
  with pytest.raises(manifest.ManifestError, match=f"shard {shard} is missing"):
    manifest.checked_shards(dataset, manifest.load(dataset), "train")
  assert manifest.checked_shards(dataset, manifest.load(dataset), "train", verify="none")


def test_a_fifo_in_place_of_a_shard_is_refused_without_opening_it(dataset):
  shard = shard_of(dataset)
  shard.unlink()
  os.mkfifo(shard)
  result = in_a_process(
    "from pipeline.catalog import manifest\n"
    f"m = manifest.load({str(dataset)!r})\n"
    "try:\n"
    f"  manifest.checked_shards({str(dataset)!r}, m, 'train', verify='sha256')\n"
    "except manifest.ManifestError as e:\n"
    "  print(e)\n"
  )
  assert result.stdout.strip() == f"shard {shard} is not a regular file", result.stderr


def test_a_shard_of_another_size_is_refused(dataset):
  shard = shard_of(dataset)
  with open(shard, "ab") as f:
    f.write(b"\0")
  with pytest.raises(manifest.ManifestError, match=f"shard {shard} has .* bytes, .* says"):
    manifest.checked_shards(dataset, manifest.load(dataset), "train")


def test_changed_bytes_of_the_same_size_are_caught_by_sha256_only(dataset):
  shard = shard_of(dataset)
  data = bytearray(shard.read_bytes())
  data[len(data) // 2] ^= 0xFF
  shard.write_bytes(bytes(data))
  m = manifest.load(dataset)
  assert manifest.checked_shards(dataset, m, "train", verify="size")  # cheap: same size
  with pytest.raises(manifest.ManifestError, match=f"shard {shard} has sha256 .* says"):
    manifest.checked_shards(dataset, m, "train", verify="sha256")


@pytest.mark.parametrize("num_records", [40, 49])
def test_a_split_count_that_is_not_its_shards_sum_is_refused(dataset, num_records):
  edit(dataset, lambda d: d["splits"]["train"].update(num_records=num_records))
  for level in ("none", "size"):
    with pytest.raises(
      manifest.ManifestError,
      match=f"split 'train' says {num_records} records but its shards hold 48",
    ):
      manifest.checked_shards(dataset, manifest.load(dataset), "train", verify=level)


def test_manifests_without_sizes_skip_the_size_check(dataset):
  edit(dataset, lambda d: [s.pop("bytes") for s in d["splits"]["train"]["shards"]])
  with open(shard_of(dataset), "ab") as f:
    f.write(b"\0")
  m = manifest.load(dataset)
  assert all(s.bytes is None for s in m.splits["train"].shards)
  assert manifest.checked_shards(dataset, m, "train")
  with pytest.raises(manifest.ManifestError, match="sha256"):
    manifest.checked_shards(dataset, m, "train", verify="sha256")


def test_an_unknown_level_is_a_value_error(dataset):
  with pytest.raises(ValueError, match="verify must be one of"):
    manifest.checked_shards(dataset, manifest.load(dataset), "train", verify="full")


def test_convert_records_each_shards_crc32c_and_older_manifests_still_open(dataset):
  m = manifest.load(dataset)
  for split in m.splits.values():
    for sh in split.shards:
      crc = google_crc32c.Checksum((dataset / sh.file).read_bytes()).hexdigest().decode()
      assert sh.crc32c == crc  # what GCS keeps of the object, once uploaded
  edit(dataset, lambda d: [sh.pop("crc32c") for s in d["splits"].values() for sh in s["shards"]])
  older = manifest.load(dataset)  # written before issue 31: sizes and counts are checked
  assert all(sh.crc32c is None for s in older.splits.values() for sh in s.shards)
  for split in older.splits:
    assert manifest.checked_shards(dataset, older, split)


def test_a_generation_is_kept_and_a_local_copy_of_a_bucket_dataset_still_opens(dataset):
  """A conversion into a bucket records each shard object's generation (checked there:
  tests/storage/test_gcs.py); files downloaded from it have none, so it is not looked at."""
  edit(dataset, lambda d: d["splits"]["train"]["shards"][0].update(generation="1700000000000001"))
  edit(dataset, lambda d: d.update(written_to="gs://bkt/photos"))
  m = manifest.load(dataset)
  assert m.written_to == "gs://bkt/photos" and not manifest.written_here(dataset, m)
  assert m.splits["train"].shards[0].generation == "1700000000000001"
  assert m.to_json()["splits"]["train"]["shards"][0]["generation"] == "1700000000000001"
  assert "generation" not in m.to_json()["splits"]["validation"]["shards"][0]
  assert manifest.checked_shards(dataset, m, "train")


def test_a_truncated_manifest_is_a_manifest_error_naming_the_file(dataset):
  path = dataset / manifest.FILENAME
  path.write_text(path.read_text()[:200])
  with pytest.raises(manifest.ManifestError, match=f"{path} is not valid JSON"):
    manifest.load(dataset)


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda d: d.pop("splits"), "missing field 'splits'"),
    (lambda d: d["splits"]["train"].update(num_records="48"), "field 'num_records' is '48'"),
    (
      lambda d: d["splits"]["train"]["shards"][0].update(file="../../etc/passwd"),
      "not a file name in the dataset folder",
    ),
    (lambda d: d.update(keys={"picture": "x"}), "keys .* are not image/label/filename"),
    (lambda d: d.update(format="grain-pipeline/9"), "format 'grain-pipeline/9' is not"),
    (
      lambda d: d["splits"]["train"]["shards"][0].update(generation=17),
      "field 'generation' is 17, not a decimal string",
    ),
    (lambda d: d.update(written_to=5), "field 'written_to' is 5, not a URL"),
  ],
)
def test_an_invalid_manifest_is_a_manifest_error_naming_the_file(dataset, change, message):
  edit(dataset, change)
  with pytest.raises(manifest.ManifestError, match=message) as error:
    manifest.load(dataset)
  assert str(dataset / manifest.FILENAME) in str(error.value)
  assert "\n" not in str(error.value)


def test_a_class_named_twice_is_refused_naming_the_file_and_the_name(dataset):
  classes = manifest.load(dataset).classes
  edit(dataset, lambda d: d.update(classes=[classes[0], classes[0], *classes[2:]]))
  with pytest.raises(manifest.ManifestError) as error:
    manifest.load(dataset)
  assert str(error.value) == (
    f"{dataset / manifest.FILENAME}: class {classes[0]!r} is named twice (labels 0 and 1)"
  )


def test_a_fifo_in_place_of_the_manifest_is_refused(dataset):
  (dataset / manifest.FILENAME).unlink()
  os.mkfifo(dataset / manifest.FILENAME)
  result = in_a_process(
    "from pipeline.catalog import manifest\n"
    "try:\n"
    f"  manifest.load({str(dataset)!r})\n"
    "except manifest.ManifestError as e:\n"
    "  print(e)\n"
  )
  assert result.stdout.strip().endswith("manifest.json is not a regular file"), result.stderr


def test_verify_reports_a_fifo_in_place_of_a_shard_and_does_not_hang(dataset):
  shard = shard_of(dataset, "validation")
  shard.unlink()
  os.mkfifo(shard)
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "pipeline.convert",
      "verify",
      str(dataset),
      "--no-progress",
      "--workers",
      "1",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 1
  assert f"{shard.name}: not a regular file" in result.stdout


def test_verify_of_a_dataset_without_records_is_not_ok(dataset):
  edit(dataset, lambda d: d.update(splits={"train": {"num_records": 0, "shards": []}}))
  report = verify.verify(dataset, workers=1, progress=False)
  assert not report.ok
  assert report.problems == ["manifest: split train has no records"]


def test_verify_checks_recorded_sizes(dataset):
  edit(dataset, lambda d: d["splits"]["train"]["shards"][0].update(bytes=1))
  problems = verify.verify(dataset, workers=1, progress=False).problems
  assert problems == [
    f"{shard_of(dataset).name}: {shard_of(dataset).stat().st_size} bytes, manifest.json says 1"
  ]


# --- malformed manifests (issue 31: RecursionError, AttributeError, ValueError, OverflowError) --


def opens_or_refuses_in_one_line(data_dir: pathlib.Path) -> manifest.Manifest | None:
  """Opens the dataset as a reader does (load, then check each split's shards) and reads its
  provenance as `convert` does: every step works, or one `ManifestError` line naming the file
  is raised; nothing else escapes. Returns the manifest, or None if refused."""
  try:
    m = manifest.load(data_dir)
    for split in m.splits:
      manifest.checked_shards(data_dir, m, split)
    shards.summary(m)
    shards.split_fingerprints(m)
  except manifest.ManifestError as e:
    assert "\n" not in str(e) and str(data_dir) in str(e), str(e)
    return None
  return m


DEEP = "[" * 100_000 + "]" * 100_000


MALFORMED = {  # what escaped before issue 31, and where
  "deep": lambda d: DEEP,  # RecursionError in json.loads
  "deep_field": lambda d: json.dumps(d).replace('"keys": ', f'"keys": {DEEP}, "x": ', 1),
  "number_as_feature_key": lambda d: json.dumps({**d, "keys": {"image": 5}}),  # AttributeError
  "list_as_feature_key": lambda d: json.dumps({**d, "keys": {"label": ["l"]}}),
  "surrogate_feature_key": lambda d: json.dumps({**d, "keys": {"label": "\ud800"}}),  # encode()
  "nul_in_file_name": lambda d: json.dumps(d).replace('"file": "', '"file": "\\u0000', 1),
  "newline_in_file_name": lambda d: json.dumps(d).replace('"file": "', '"file": "\\n', 1),
  "count_past_int64": lambda d: json.dumps(d).replace(  # OverflowError in the sampler
    '"num_records": ', '"num_records": 1844674407370955161', 2
  ),
  "skipped_not_objects": lambda d: json.dumps({**d, "skipped": [1]}),  # TypeError in convert
  "skipped_without_reason": lambda d: json.dumps({**d, "skipped": [{"path": "a"}]}),
  "added_not_a_list": lambda d: json.dumps({**d, "created_by": {"added": 5}}),
  "splits_not_a_list": lambda d: json.dumps({**d, "created_by": {"splits": 5}}),
  "reencoded_not_a_list": lambda d: json.dumps({**d, "created_by": {"added": [{"reencoded": 1}]}}),
  "newline_in_split_name": lambda d: json.dumps({**d, "splits": {"a\nb": d["splits"]["train"]}}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_manifest_is_a_manifest_error_in_one_line(dataset, name):
  path = dataset / manifest.FILENAME
  path.write_text(MALFORMED[name](json.loads(path.read_text())))
  assert opens_or_refuses_in_one_line(dataset) is None


JSON = st.recursive(
  st.none()
  | st.booleans()
  | st.integers()
  | st.sampled_from([-1, 2**63, 2**64, 10**40])
  | st.floats()
  | st.text(max_size=6),
  lambda inner: (
    st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
  ),
  max_leaves=8,
)


def _places(value, at=()):
  """Every place in a JSON value: the key path of each object member and list item."""
  yield at
  items = (
    value.items()
    if isinstance(value, dict)
    else enumerate(value)
    if isinstance(value, list)
    else ()
  )
  for key, item in items:
    yield from _places(item, (*at, key))


@st.composite
def mutated_manifests(draw, base: dict) -> dict:
  """`base` with 1-3 values replaced by any JSON, removed, or beside a new member."""
  d = copy.deepcopy(base)
  for _ in range(draw(st.integers(1, 3))):
    place = draw(st.sampled_from([p for p in _places(d) if p]))
    parent = d
    for key in place[:-1]:
      parent = parent[key]
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "replace":
      parent[place[-1]] = draw(JSON)
    elif action == "remove":
      del parent[place[-1]]
    elif isinstance(parent, dict):
      parent[draw(st.text(max_size=6))] = draw(JSON)
    else:
      parent.append(draw(JSON))
  return d


@settings(
  max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_mutation_of_a_manifest_opens_or_is_a_manifest_error(dataset, photos_dir, data):
  base = json.loads((photos_dir / manifest.FILENAME).read_text())
  (dataset / manifest.FILENAME).write_text(json.dumps(data.draw(mutated_manifests(base))))
  opens_or_refuses_in_one_line(dataset)


def test_a_shard_listed_with_0_records_is_opened_and_refused_if_it_holds_any(dataset):
  """No read asks a shard listed with 0 records for anything: make_dataset opens it to check."""
  shard = dataset / "train.array_record-00001-of-00002"
  shutil.copy(shard_of(dataset, "validation"), shard)  # 16 records

  def list_it_with_0_records(d):
    (validation,) = d["splits"]["validation"]["shards"]
    d["splits"]["train"]["shards"].append({**validation, "file": shard.name, "num_records": 0})

  edit(dataset, list_it_with_0_records)
  with pytest.raises(OSError, match=f"^shard {shard} holds 16 records, the manifest 0: it changed"):
    pipeline.make_dataset(dataset, batch_size=8, image_size=16, shard_index=0, shard_count=1)
