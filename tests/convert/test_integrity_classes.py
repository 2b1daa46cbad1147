"""Classes are what the user meant: folders tools leave behind, an output folder inside the
source, and links never become classes or give one image two labels."""

from __future__ import annotations

import os
import pathlib

import pytest

from pipeline.catalog import manifest, records
from pipeline.convert import images, tfrecord
from tests.convert.test_images import jpeg, read_shard, write
from tests.convert.test_tfrecord import write_tfrecord


def stored(out) -> dict[str, str]:
  """{stored file name: its class} over every split of a converted dataset."""
  m = manifest.load(out)
  got = {}
  for split in m.splits:
    for path in m.shard_paths(out, split):
      for r in read_shard(path):
        _, label, filename = records.parse(r, m.keys)
        assert filename not in got, f"{filename} stored twice"
        got[filename] = m.classes[label]
  return got


def two_classes(src: pathlib.Path) -> None:
  for i in range(3):
    write(src / "cat" / f"c{i}.jpg", jpeg(seed=i))
    write(src / "dog" / f"d{i}.jpg", jpeg(seed=10 + i))


def test_hidden_and_tool_folders_are_not_classes(tmp_path):
  src = tmp_path / "src"
  two_classes(src)
  write(src / ".ipynb_checkpoints" / "c0-checkpoint.jpg", jpeg(seed=0))
  write(src / "__MACOSX" / "cat" / "._c0.jpg", b"\x00\x05\x16\x07 AppleDouble")
  write(src / ".DS_Store", b"\x00\x00\x00\x01Bud1")
  write(src / "cat" / ".ipynb_checkpoints" / "c1-checkpoint.jpg", jpeg(seed=1))
  write(src / "cat" / "._c2.jpg", b"\x00\x05\x16\x07 AppleDouble")
  m = images.convert(images.Request(src, tmp_path / "out"), workers=1, progress=False)
  assert m.classes == ["cat", "dog"]
  assert stored(tmp_path / "out") == {
    **{f"cat/c{i}.jpg": "cat" for i in range(3)},
    **{f"dog/d{i}.jpg": "dog" for i in range(3)},
  }
  skipped = {s["path"]: s["reason"] for s in m.skipped}
  for name in (".ipynb_checkpoints", "__MACOSX"):
    assert skipped[name] == "hidden or tool folder, not a class"
  assert skipped["cat/.ipynb_checkpoints"] == "hidden or tool file or folder"
  assert skipped["cat/._c2.jpg"] == "hidden or tool file or folder"


def test_an_output_folder_inside_the_source_is_not_a_class(tmp_path):
  src = tmp_path / "src"
  two_classes(src)
  first = images.convert(images.Request(src, src / "converted"), workers=1, progress=False)
  stamps = {p.name: p.stat().st_mtime_ns for p in (src / "converted").iterdir()}
  again = images.convert(images.Request(src, src / "converted"), workers=1, progress=False)
  assert again == first and first.classes == ["cat", "dog"]
  assert {p.name: p.stat().st_mtime_ns for p in (src / "converted").iterdir()} == stamps
  elsewhere = images.convert(images.Request(src, tmp_path / "elsewhere"), workers=1, progress=False)
  assert elsewhere.classes == ["cat", "dog"]  # another conversion's output is no class either
  assert {"path": "converted", "reason": "a converted dataset, not a class"} in elsewhere.skipped


def test_a_class_folder_linking_into_the_source_is_not_a_second_class(tmp_path):
  src = tmp_path / "src"
  two_classes(src)
  os.symlink(src / "cat", src / "kitty")
  m = images.convert(images.Request(src, tmp_path / "out"), workers=1, progress=False)
  assert m.classes == ["cat", "dog"]
  assert set(stored(tmp_path / "out").values()) == {"cat", "dog"}
  assert len(stored(tmp_path / "out")) == 6
  reason = {s["path"]: s["reason"] for s in m.skipped}["kitty"]
  assert reason.startswith("symlink to cat in the source folder")


def test_an_image_linked_from_another_class_keeps_its_one_label(tmp_path):
  src = tmp_path / "src"
  two_classes(src)
  write(src / "zebra" / "z0.jpg", jpeg(seed=20))
  os.symlink(src / "cat" / "c0.jpg", src / "dog" / "link_to_cat.jpg")
  os.link(src / "cat" / "c1.jpg", src / "dog" / "hardlink_to_cat.jpg")
  os.symlink(src / "zebra" / "z0.jpg", src / "cat" / "a_link_to_zebra.jpg")  # listed first
  os.symlink(src / "dog", src / "cat" / "more_dogs")
  m = images.convert(images.Request(src, tmp_path / "out"), workers=1, progress=False)
  got = stored(tmp_path / "out")
  assert got == {
    **{f"cat/c{i}.jpg": "cat" for i in range(3)},
    **{f"dog/d{i}.jpg": "dog" for i in range(3)},
    "zebra/z0.jpg": "zebra",
  }
  skipped = {s["path"]: s["reason"] for s in m.skipped}
  assert skipped["dog/link_to_cat.jpg"].startswith("same file as cat/c0.jpg in class cat")
  assert skipped["dog/hardlink_to_cat.jpg"].startswith("same file as cat/c1.jpg in class cat")
  assert skipped["cat/a_link_to_zebra.jpg"].startswith("same file as zebra/z0.jpg")
  assert skipped["cat/more_dogs"] == "symlink to a folder already listed"


def test_a_class_folder_linked_from_outside_is_followed_once(tmp_path):
  src, birds = tmp_path / "src", tmp_path / "elsewhere" / "birds"
  two_classes(src)
  write(birds / "b0.jpg", jpeg(seed=30))
  os.symlink(birds, src / "bird")
  os.symlink(birds, src / "bird_again")
  m = images.convert(
    images.Request(src, tmp_path / "out", follow_symlinks=True), workers=1, progress=False
  )
  assert m.classes == ["bird", "cat", "dog"]
  assert stored(tmp_path / "out")["bird/b0.jpg"] == "bird"
  assert {"path": "bird_again", "reason": "symlink to a folder already listed"} in m.skipped


def test_a_class_named_twice_in_a_label_map_or_classes_file_is_refused(tmp_path):
  src = tmp_path / "src"
  two_classes(src)
  names = tmp_path / "classes.txt"
  names.write_text("cat\ndog\ncat\n")
  with pytest.raises(manifest.ManifestError) as e:
    images.convert(
      images.Request(src, tmp_path / "out", label_map=names), workers=1, progress=False
    )
  assert str(e.value) == f"label map {names}: class 'cat' is named twice (labels 0 and 2)"
  write_tfrecord(tmp_path / "a.tfrecord", [records.encode(jpeg(seed=0), 0, "c0.jpg")])
  with pytest.raises(manifest.ManifestError) as e:
    tfrecord.convert(
      tfrecord.Request(str(tmp_path / "a.tfrecord"), tmp_path / "out", classes=names),
      progress=False,
    )
  assert str(e.value) == f"{names}: class 'cat' is named twice (labels 0 and 2)"
  assert not (tmp_path / "out").exists()
