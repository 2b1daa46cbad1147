"""Image folders (`SRC/CLASS/IMAGE`, the ImageNet layout) to ArrayRecord shards.

Classes are numbered in sorted order or by a label map. Files are split (per class, seeded)
and put in a seeded shuffled order so every shard mixes classes; the shard plan is fixed
from that order and the file sizes, so output bytes do not depend on `workers`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

from pipeline import __version__, records
from pipeline import manifest as manifest_lib
from pipeline.convert import checks, shards


class LabelMapError(ValueError):
  """A label map that does not number the classes 0..N-1, or a folder missing from it."""


def load_label_map(label_map: str | os.PathLike | Mapping[str, int] | Sequence[str]
                   ) -> list[str]:
  """Class names in label order from a JSON {name: label} file, a names-per-line file,
  a mapping or a list; labels must be exactly 0..N-1."""
  source = "label map"
  if isinstance(label_map, (str, os.PathLike)):
    source = f"label map {os.fspath(label_map)}"
    with open(label_map) as f:
      text = f.read()
    try:
      label_map = json.loads(text)
    except ValueError:
      label_map = [line.strip() for line in text.splitlines() if line.strip()]
  if not isinstance(label_map, Mapping):
    label_map = {name: i for i, name in enumerate(label_map)}
  classes: list[str | None] = [None] * len(label_map)
  for name, label in label_map.items():
    if not isinstance(label, int) or isinstance(label, bool):
      raise LabelMapError(f"{source}: label of class {name!r} is {label!r}, not an integer")
    if not 0 <= label < len(label_map):
      raise LabelMapError(f"{source}: label {label} of class {name!r} is out of range "
                          f"[0, {len(label_map)})")
    if classes[label] is not None:
      raise LabelMapError(f"{source}: label {label} used by both {classes[label]!r} "
                          f"and {name!r}")
    classes[label] = name
  return classes  # every slot is filled: N distinct labels in [0, N)


def _inside(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _link_problem(entry: os.DirEntry, root: str, follow_symlinks: bool) -> str | None:
  """Why a symlink is not followed (broken, or leading outside SRC unless asked), or None."""
  if not entry.is_symlink():
    return None
  target = os.path.realpath(entry.path)
  if not os.path.exists(target):
    return "broken symlink"
  if not follow_symlinks and not _inside(target, root):
    return f"symlink outside the source folder (to {target}; see --follow-symlinks)"
  return None


def scan(src: str, follow_symlinks: bool = False
         ) -> tuple[dict[str, list[str]], list[dict[str, str]]]:
  """Lists image files per class folder (sorted relative paths) and what was left out."""
  root = os.path.realpath(src)
  by_class: dict[str, list[str]] = {}
  skipped: list[dict[str, str]] = []
  visited = {root}

  def walk(path: str, rel: str, files: list[str]) -> None:
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
      rel_path = os.path.join(rel, entry.name)
      if problem := _link_problem(entry, root, follow_symlinks):
        skipped.append({"path": rel_path, "reason": problem})
      elif entry.is_dir():
        if (real := os.path.realpath(entry.path)) in visited:
          skipped.append({"path": rel_path, "reason": "symlink loop: folder already listed"})
        else:
          visited.add(real)
          walk(entry.path, rel_path, files)
      elif entry.is_file():
        files.append(rel_path)
      else:
        skipped.append({"path": rel_path, "reason": "not a regular file"})

  for entry in sorted(os.scandir(src), key=lambda e: e.name):
    if problem := _link_problem(entry, root, follow_symlinks):
      skipped.append({"path": entry.name, "reason": problem})
    elif entry.is_dir():
      visited.add(os.path.realpath(entry.path))
      by_class[entry.name] = []
      walk(entry.path, entry.name, by_class[entry.name])
    else:
      skipped.append({"path": entry.name, "reason": "not in a class folder"})
  return by_class, skipped


def process(task: tuple[tuple[str, int], ...], *, src: str, keys: records.Keys,
            max_size: int | None, max_pixels: int) -> list[shards.Outcome]:
  """Worker: reads, checks and encodes each (relative path, label) of a task."""
  outcomes: list[shards.Outcome] = []
  for rel, label in task:
    try:
      with open(os.path.join(src, rel), "rb") as f:
        payload, why = checks.prepare(f.read(), max_size=max_size, max_pixels=max_pixels)
    except (checks.BadImage, OSError) as e:
      outcomes.append((None, {"path": rel, "reason": str(e)}, None))
      continue
    record = records.encode(payload, label, rel, keys)
    outcomes.append((record, None, {"path": rel, "reason": why} if why else None))
  return outcomes


def _split_files(by_class: dict[str, list[str]], label_of: dict[str, int],
                 val_fraction: float, seed: int, split: str
                 ) -> dict[str, list[tuple[str, int]]]:
  """Per-class seeded split into (train, validation), then a seeded shuffle of each split."""
  rng = np.random.default_rng(seed)
  out: dict[str, list[tuple[str, int]]] = {split: []}
  if val_fraction > 0:
    out["validation"] = []
  for name in sorted(by_class):
    files = [(f, label_of[name]) for f in by_class[name]]
    order = rng.permutation(len(files))
    num_val = round(len(files) * val_fraction) if val_fraction > 0 else 0
    if num_val:
      out["validation"] += [files[i] for i in sorted(order[:num_val])]
    out[split] += [files[i] for i in sorted(order[num_val:])]
  for items in out.values():
    items[:] = [items[i] for i in rng.permutation(len(items))]
  return out


def plan(src: str | os.PathLike, out: str | os.PathLike, *, split: str = "train",
         val_fraction: float = 0.0, seed: int = 0,
         label_map: str | os.PathLike | Mapping[str, int] | Sequence[str] | None = None,
         shard_size_mb: float = shards.DEFAULT_SHARD_SIZE_MB, max_size: int | None = None,
         max_pixels: int = checks.MAX_PIXELS, follow_symlinks: bool = False,
         keys: records.Keys = records.DEFAULT_KEYS) -> shards.Job:
  """Scans `src`, numbers its classes, splits and orders its files and plans the shards."""
  src, out = os.fspath(src), os.fspath(out)
  if not os.path.isdir(src):
    raise FileNotFoundError(f"image folder {src} not found")
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
  by_class, skipped = scan(src, follow_symlinks)
  if label_map is not None:
    classes = load_label_map(label_map)
    unknown = sorted(set(by_class) - set(classes))
    if unknown:
      raise LabelMapError(f"class folders {unknown} in {src} are not in the label map "
                          f"(it has {len(classes)} classes)")
  else:
    classes = sorted(by_class)
  if not classes:
    raise ValueError(f"no class folders in {src} (expected SRC/CLASS/IMAGE)")
  skipped += [{"path": name + "/", "reason": "empty class folder"}
              for name in sorted(by_class) if not by_class[name]]
  label_of = {name: i for i, name in enumerate(classes)}
  split_items = _split_files(by_class, label_of, val_fraction, seed, split)
  shard_bytes = int(shard_size_mb * (1 << 20))
  plans, inputs = [], []
  for name, items in split_items.items():
    stats = [os.stat(os.path.join(src, rel)) for rel, _ in items]
    plans += shards.plan_split(name, items, [s.st_size for s in stats], shard_bytes)
    inputs.append([name, [(rel, label, s.st_size, s.st_mtime_ns)
                          for (rel, label), s in zip(items, stats)]])
  args = {"split": split, "val_fraction": val_fraction, "seed": seed,
          "label_map": None if label_map is None else str(label_map),
          "shard_size_mb": shard_size_mb, "max_size": max_size, "max_pixels": max_pixels,
          "follow_symlinks": follow_symlinks}
  return shards.Job(
      out=out, plans=plans,
      process=functools.partial(process, src=src, keys=keys, max_size=max_size,
                                max_pixels=max_pixels),
      fp=shards.fingerprint(__version__, args, classes, keys, inputs), classes=classes,
      splits=list(split_items), keys=keys, skipped=skipped,
      created_by={"tool": "pipeline.convert images", "version": __version__, "args": args,
                  "source": os.path.abspath(src)})


def convert(src: str | os.PathLike, out: str | os.PathLike, *, split: str = "train",
            val_fraction: float = 0.0, seed: int = 0,
            label_map: str | os.PathLike | Mapping[str, int] | Sequence[str] | None = None,
            shard_size_mb: float = shards.DEFAULT_SHARD_SIZE_MB, workers: int | None = None,
            max_size: int | None = None, max_pixels: int = checks.MAX_PIXELS,
            follow_symlinks: bool = False, keys: records.Keys = records.DEFAULT_KEYS,
            progress: bool = True) -> manifest_lib.Manifest:
  """Converts an image folder to ArrayRecord shards and manifest.json in `out`.

  With `val_fraction` > 0 it writes splits `split` and "validation" (split per class).
  Re-running after an interruption keeps finished shards; the result is the same.
  """
  job = plan(src, out, split=split, val_fraction=val_fraction, seed=seed, label_map=label_map,
             shard_size_mb=shard_size_mb, max_size=max_size, max_pixels=max_pixels,
             follow_symlinks=follow_symlinks, keys=keys)
  name = os.path.basename(os.path.normpath(os.fspath(src)))
  return shards.run(job, workers=workers, progress=progress, desc=f"convert {name}")
