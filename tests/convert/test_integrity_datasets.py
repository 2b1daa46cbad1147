"""Datasets are built, never clobbered: refusals, added splits, atomic overwrites, locks.

Every conversion here is real (real JPEGs, real shards, `python -m pipeline.convert` in its
own process where it is killed or stopped). A "reader" is what the loader does at open:
`manifest.load` then `manifest.checked_shards`; here with the full sha256 check.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from pipeline.catalog import manifest, records
from pipeline.convert import __main__ as cli_main
from pipeline.convert import images, shards, verify
from tests.conftest import run_command
from tests.convert.test_images import read_shard

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLASSES = ["astronaut", "chelsea", "coffee", "rocket"]


def cli(*args) -> subprocess.CompletedProcess:
  return run_command([sys.executable, "-m", "pipeline.convert", *args])


def main(capsys, *args) -> subprocess.CompletedProcess:
  """The command line in this process (quicker to start than a new one)."""
  try:
    code = cli_main.main([str(a) for a in args])
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return subprocess.CompletedProcess(args, code, out, err)


def start_cli(*args) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-m", "pipeline.convert", *map(str, args)],
    cwd=ROOT,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def one_line(stderr: str) -> str:
  assert "Traceback" not in stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1, stderr
  return lines[0]


def labelled(out) -> dict[str, str] | None:
  """What a reader gets from OUT: {file: class} after the full check, or None if OUT is
  refused (no manifest). Fails if a check fails or a record is labelled off its folder."""
  try:
    m = manifest.load(out)
  except FileNotFoundError:
    return None
  got = {}
  for split in m.splits:
    for path in manifest.checked_shards(out, m, split, verify="sha256"):
      for r in read_shard(path):
        _, label, filename = records.parse(r, m.keys)
        got[filename] = m.classes[label]
  assert all(cls == f.split("/")[-2] for f, cls in got.items()), "a record under another label"
  return got


def wait_for_done_shards(out: pathlib.Path, child: subprocess.Popen, count: int) -> None:
  build = out / shards.BUILD_DIR
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and child.poll() is None:
    if build.is_dir() and len(list(build.glob("*.done"))) >= count:
      return
    time.sleep(0.002)
  raise AssertionError("the conversion ended before it was interrupted")


@pytest.fixture
def reversed_map(tmp_path) -> pathlib.Path:
  path = tmp_path / "reversed.txt"
  path.write_text("\n".join(reversed(CLASSES)) + "\n")
  return path


def val_folder(photos_raw, root: pathlib.Path, classes=CLASSES, per_class=2) -> pathlib.Path:
  """An ImageNet-style `val/` folder: the same classes, other files."""
  for cls in classes:
    (root / cls).mkdir(parents=True)
    pool = sorted((photos_raw / (cls if cls in CLASSES else CLASSES[0])).glob("*.jpg"))
    for i in range(per_class):
      shutil.copy(pool[i], root / cls / f"val_{i}.jpg")
  return root


def test_converting_into_another_dataset_is_refused_and_changes_nothing(
  photos_raw, tmp_path, reversed_map, capsys
):
  out = tmp_path / "out"
  images.convert(images.Request(photos_raw, out), workers=1, progress=False)
  before = snapshot(out)
  refused = cli("images", photos_raw, out, "--label-map", reversed_map, "--no-progress")
  assert refused.returncode == 2
  line = one_line(refused.stderr)
  assert str(out) in line and "already holds split(s) ['train']" in line and "--overwrite" in line
  assert snapshot(out) == before

  done = main(
    capsys,
    "images",
    photos_raw,
    out,
    "--label-map",
    reversed_map,
    "--overwrite",
    "--no-progress",
    "--workers",
    "1",
  )
  assert done.returncode == 0, done.stderr
  assert manifest.load(out).classes == CLASSES[::-1]
  assert len(labelled(out)) == 64
  assert sorted(p.name for p in out.iterdir()) == sorted(
    ["manifest.json"] + [s.file for s in manifest.load(out).splits["train"].shards]
  )


def test_imagenet_layout_train_then_val_adds_a_validation_split(photos_raw, tmp_path, capsys):
  out, val = tmp_path / "out", val_folder(photos_raw, tmp_path / "val")
  images.convert(images.Request(photos_raw, out, shard_size_mb=1), workers=1, progress=False)
  train = {n: b for n, b in snapshot(out).items() if n.startswith("train.")}
  added = main(
    capsys, "images", val, out, "--split", "validation", "--no-progress", "--workers", "1"
  )
  assert added.returncode == 0, added.stderr
  assert "train: 64 records" in added.stdout and "validation: 8 records" in added.stdout
  m = manifest.load(out)
  assert list(m.splits) == ["train", "validation"] and m.classes == CLASSES
  assert {n: b for n, b in snapshot(out).items() if n.startswith("train.")} == train
  got = labelled(out)
  assert sorted(f for f in got if f.startswith(tuple(CLASSES)) and "/val_" in f) == sorted(
    f"{c}/val_{i}.jpg" for c in CLASSES for i in range(2)
  )
  assert m.created_by["source"] == str(photos_raw)
  assert m.created_by["added"][0]["source"] == str(val)
  assert verify.verify(out, workers=1, progress=False).ok

  stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
  again = images.convert(images.Request(val, out, split="validation"), workers=1, progress=False)
  assert again == m  # the same command again: nothing to do, nothing rewritten
  assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_a_split_whose_classes_differ_is_refused_naming_the_difference(
  photos_raw, tmp_path, capsys
):
  out = tmp_path / "out"
  images.convert(images.Request(photos_raw, out), workers=1, progress=False)
  before = snapshot(out)
  val = val_folder(
    photos_raw, tmp_path / "val", classes=["astronaut", "chelsea", "coffee", "zebra"]
  )
  refused = main(capsys, "images", val, out, "--split", "validation", "--no-progress")
  assert refused.returncode == 2
  line = one_line(refused.stderr)
  assert "cannot add split(s) ['validation']" in line and "classes differ" in line
  assert "only in this conversion: ['zebra']" in line and "only in the dataset: ['rocket']" in line
  assert snapshot(out) == before


def test_an_overwrite_killed_midway_leaves_the_old_dataset_whole(
  big_src, tmp_path, reversed_map, capsys
):
  out = tmp_path / "out"
  args = ["--shard-size-mb", "0.5", "--workers", "1", "--no-progress"]
  images.convert(images.Request(big_src, out, shard_size_mb=0.5), workers=1, progress=False)
  old = labelled(out)
  child = start_cli("images", big_src, out, "--label-map", reversed_map, "--overwrite", *args)
  wait_for_done_shards(out, child, 3)
  child.send_signal(signal.SIGKILL)
  child.wait()
  assert labelled(out) == old  # every check passes and no record changed its label
  assert manifest.load(out).classes == CLASSES  # the old dataset, untouched

  rerun = main(capsys, "images", big_src, out, *args)  # the original command: done at once
  assert rerun.returncode == 0 and "train: 384 records" in rerun.stdout, rerun.stderr
  assert labelled(out) == old
  assert not any(p.name.startswith(".") for p in out.iterdir())  # the other plan's work

  images.convert(
    images.Request(big_src, out, label_map=reversed_map, shard_size_mb=0.5, overwrite=True),
    workers=1,
    progress=False,
  )
  assert manifest.load(out).classes == CLASSES[::-1] and len(labelled(out)) == 384


def reached(out: pathlib.Path, point: str) -> bool:
  build = out / shards.BUILD_DIR
  if point == "planned":
    return build.is_dir()
  if point == "writing":
    return len(list(build.glob("*.done"))) >= 20
  return (build / "swap.json").exists()  # committed: the swap into OUT has begun


@pytest.mark.parametrize("point", ["planned", "writing", "swapping"])
def test_readers_see_the_old_dataset_or_none_or_the_new_one_at_any_kill(
  big_src, tmp_path, reversed_map, point
):
  out = tmp_path / "out"
  images.convert(images.Request(big_src, out, shard_size_mb=0.5), workers=2, progress=False)
  old = labelled(out)
  child = start_cli(
    "images",
    big_src,
    out,
    "--label-map",
    reversed_map,
    "--overwrite",
    "--shard-size-mb",
    "0.5",
    "--workers",
    "2",
    "--no-progress",
  )
  deadline = time.monotonic() + 240
  while child.poll() is None and not reached(out, point) and time.monotonic() < deadline:
    time.sleep(0.001)
  child.send_signal(signal.SIGKILL)  # at that point, or after the end if it came first
  child.wait()
  seen = labelled(out)  # fails if a check fails or a record is labelled off its folder
  assert seen is None or seen == old
  images.convert(
    images.Request(big_src, out, label_map=reversed_map, shard_size_mb=0.5, overwrite=True),
    workers=2,
    progress=False,
  )
  assert manifest.load(out).classes == CLASSES[::-1] and labelled(out) == old
  assert not any(p.name.startswith(".") for p in out.iterdir())


def test_a_rerun_with_other_arguments_never_reuses_shards_of_another_plan(
  big_src, tmp_path, reversed_map
):
  out, clean = tmp_path / "out", tmp_path / "clean"
  child = start_cli(
    "images", big_src, out, "--shard-size-mb", "0.5", "--workers", "1", "--no-progress"
  )
  wait_for_done_shards(out, child, 3)
  child.send_signal(signal.SIGKILL)
  child.wait()
  other = {"label_map": reversed_map, "shard_size_mb": 1}
  images.convert(images.Request(big_src, out, **other), workers=1, progress=False)
  images.convert(images.Request(big_src, clean, **other), workers=1, progress=False)
  assert snapshot(out) == snapshot(clean)  # no stale shard, marker or temporary file left


def test_a_second_conversion_into_the_same_folder_is_refused_while_the_first_runs(
  big_src, tmp_path
):
  out, clean = tmp_path / "out", tmp_path / "clean"
  args = ["--shard-size-mb", "0.5", "--workers", "1", "--no-progress"]
  first = start_cli("images", big_src, out, *args)
  try:
    wait_for_done_shards(out, first, 1)
    first.send_signal(signal.SIGSTOP)  # holds the lock, mid-conversion
    second = cli("images", big_src, out, *args)
    assert second.returncode == 2
    line = one_line(second.stderr)
    assert f"{out} is being converted by another process (pid {first.pid})" in line
  finally:
    first.send_signal(signal.SIGCONT)
  assert first.wait(timeout=300) == 0
  images.convert(images.Request(big_src, clean, shard_size_mb=0.5), workers=1, progress=False)
  assert snapshot(out) == snapshot(clean)


def test_a_killed_conversion_does_not_keep_the_folder_locked(big_src, tmp_path):
  out = tmp_path / "out"
  child = start_cli(
    "images", big_src, out, "--shard-size-mb", "0.5", "--workers", "1", "--no-progress"
  )
  wait_for_done_shards(out, child, 1)
  child.send_signal(signal.SIGKILL)
  child.wait()
  assert (out / shards.LOCK_FILE).exists()
  images.convert(images.Request(big_src, out, shard_size_mb=0.5), workers=1, progress=False)
  assert not (out / shards.LOCK_FILE).exists()


def test_files_that_are_not_a_dataset_are_not_replaced_without_overwrite(
  photos_raw, tmp_path, capsys
):
  out = tmp_path / "out"
  out.mkdir()
  (out / "train.array_record-00000-of-00001").write_bytes(b"someone else's file")
  refused = main(capsys, "images", photos_raw, out, "--no-progress")
  assert refused.returncode == 2 and "--overwrite" in one_line(refused.stderr)
  assert (out / "train.array_record-00000-of-00001").read_bytes() == b"someone else's file"
  (out / manifest.FILENAME).write_text('{"classes": ["a"], "splits": {"train": {"num_rec')
  refused = main(capsys, "images", photos_raw, out, "--no-progress")
  assert refused.returncode == 2
  assert "holds a damaged dataset" in one_line(refused.stderr)


def test_files_skipped_for_one_reason_are_counted_once_with_the_first_ones_hint(tmp_path):
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  (tmp_path / "src" / "a").mkdir(parents=True)
  for i in range(50):
    (outside / f"{i}.jpg").write_bytes(b"\xff\xd8\xff")
    (tmp_path / "src" / "a" / f"{i}.jpg").symlink_to(outside / f"{i}.jpg")
  with pytest.raises(shards.ConversionError) as refused:
    images.convert(
      images.Request(tmp_path / "src", tmp_path / "out", label_map=["a"]), workers=1, progress=False
    )
  assert str(refused.value) == (
    "split 'train' would hold no records (skipped 51: 1 empty class folder, "
    "50 symlink outside the source folder "
    f"(first: to {outside / '0.jpg'}; see --follow-symlinks))"
  )


def test_zero_records_is_an_error_and_writes_no_dataset(tmp_path, capsys):
  src = tmp_path / "src"
  (src / "b").mkdir(parents=True)
  (src / "b" / "notes.txt").write_text("not an image")
  (src / "b" / "empty.jpg").write_bytes(b"")
  with pytest.raises(
    shards.ConversionError,
    match="split 'train' would hold no records \\(skipped 2: 1 empty file, 1 not an image\\)",
  ):
    images.convert(images.Request(src, tmp_path / "out"), workers=1, progress=False)
  assert not (tmp_path / "out" / manifest.FILENAME).exists()
  (src / "b" / "empty.jpg").unlink()
  refused = main(capsys, "images", src, tmp_path / "out", "--no-progress")
  assert refused.returncode == 2
  assert "split 'train' would hold no records" in one_line(refused.stderr)
  assert not (tmp_path / "out" / manifest.FILENAME).exists()


@pytest.mark.parametrize(
  "bad, message",
  [
    (["--shard-size-mb", "0"], "--shard-size-mb: 0 is outside (0, inf)"),
    (["--shard-size-mb", "nan"], "--shard-size-mb: nan is outside"),
    (["--workers", "0"], "--workers: 0 is outside"),
    (["--val-fraction", "1"], "--val-fraction: 1 is outside [0, 1)"),
    (["--max-size", "-5"], "--max-size: -5 is outside"),
    (["--split", "../x"], "split name '../x' must be"),
    (["--split", "validation", "--val-fraction", "0.2"], "split 'validation' is the name"),
    (["--seed", "x"], "--seed: invalid int value"),
  ],
)
def test_bad_arguments_are_one_line_with_exit_status_2(photos_raw, tmp_path, capsys, bad, message):
  result = main(capsys, "images", photos_raw, tmp_path / "out", "--no-progress", *bad)
  assert result.returncode == 2
  assert message in one_line(result.stderr)
  assert not (tmp_path / "out" / manifest.FILENAME).exists()


def test_the_library_refuses_bad_arguments_too(photos_raw, tmp_path):
  for kwargs, workers, message in [
    ({"shard_size_mb": 0}, None, "shard_size_mb must be a positive"),
    ({}, 0, "workers must be a positive"),
    ({"max_pixels": 0}, None, "max_pixels must be a positive"),
  ]:
    with pytest.raises(ValueError, match=message):
      images.convert(images.Request(photos_raw, tmp_path / "out", **kwargs), workers, False)


def test_every_converter_records_each_shards_size(photos_dir, tmp_path):
  from pipeline.convert import tfrecord
  from tests.convert.test_tfrecord import photos_tfrecord

  source = photos_tfrecord(photos_dir, tmp_path)
  tfrecord.convert(
    tfrecord.Request(source, tmp_path / "tf", num_classes=4, shard_size_mb=1),
    workers=1,
    progress=False,
  )
  for out in (photos_dir, tmp_path / "tf"):
    data = json.loads((out / manifest.FILENAME).read_text())
    for split in data["splits"].values():
      for shard in split["shards"]:
        assert shard["bytes"] == (out / shard["file"]).stat().st_size


def test_a_flat_val_folder_with_a_labels_csv_adds_the_validation_split(
  photos_raw, tmp_path, capsys
):
  out, val = tmp_path / "out", tmp_path / "val"
  images.convert(images.Request(photos_raw, out), workers=1, progress=False)
  val.mkdir()
  rows = ["ImageId,PredictionString"]  # ImageNet's LOC_val_solution.csv: header, boxes
  for i, cls in enumerate(CLASSES * 2):
    shutil.copy(sorted((photos_raw / cls).glob("*.jpg"))[i // 4], val / f"val_{i:05d}.JPEG")
    rows.append(f"val_{i:05d},{cls} 10 20 110 120 {cls} 5 5 50 50")
  rows.append("val_99999,rocket 1 2 3 4")  # a row whose file is not there
  shutil.copy(sorted((photos_raw / "rocket").glob("*.jpg"))[0], val / "unlabelled.JPEG")
  (tmp_path / "val.csv").write_text("\n".join(rows) + "\n")
  added = main(
    capsys,
    "images",
    val,
    out,
    "--split",
    "validation",
    "--labels",
    tmp_path / "val.csv",
    "--workers",
    "1",
    "--no-progress",
  )
  assert added.returncode == 0, added.stderr
  m = manifest.load(out)
  assert m.splits["validation"].num_records == 8 and m.classes == CLASSES
  assert {
    "path": "unlabelled.JPEG",
    "reason": "not in the labels file",
    "split": "validation",
  } in m.skipped
  got = {}
  for path in manifest.checked_shards(out, m, "validation", verify="sha256"):
    for r in read_shard(path):
      _, label, filename = records.parse(r, m.keys)
      got[filename] = m.classes[label]
  assert got == {f"val_{i:05d}.JPEG": cls for i, cls in enumerate(CLASSES * 2)}

  for text, message in [
    (
      "val_00000,rocket\nx,coffee\nval_00000,chelsea\n",
      "line 3: val_00000 is labelled both 'rocket' and 'chelsea'",
    ),
    ("val_00000,rocket\nval_00000.JPEG,coffee\n", "labels val_00000.JPEG both coffee and rocket"),
  ]:
    (tmp_path / "twice.csv").write_text(text)
    refused = main(capsys, "images", val, tmp_path / "x", "--labels", tmp_path / "twice.csv")
    assert refused.returncode == 2 and message in one_line(refused.stderr)


def test_temporary_files_of_killed_runs_are_removed_and_nothing_else(photos_raw, tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  leftovers = [
    ".manifest.json.tmp-4242",
    ".train.array_record-00000-of-00003.tmp-77",
    ".convert-progress/train.array_record-00000-of-00003.json",
  ]
  for name in leftovers:
    (out / name).parent.mkdir(exist_ok=True)
    (out / name).write_text("left by a killed run")
  (out / ".notes.tmp-mine").write_text("the user's")
  images.convert(images.Request(photos_raw, out), workers=1, progress=False)
  assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".notes.tmp-mine"]
