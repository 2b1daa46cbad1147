"""Image folders (`SRC/CLASS/IMAGE`, the ImageNet layout) to ArrayRecord shards.

Classes are the class folders, numbered in sorted order or by a label map; hidden and tool
folders, the output folder and other converted datasets are not classes, and no file gets
two labels through links. A flat folder with a labels CSV (ImageNet's `val/`) works too.
Files are split (per class, seeded) and put in a seeded shuffled order so every shard mixes
classes; the shard plan is fixed from that order and the file sizes, so output bytes do not
depend on `workers`.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from pipeline import __version__
from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.convert import bucket, checks, shards

VALIDATION = "validation"  # the split `val_fraction` makes
TOOL_FOLDERS = frozenset(
  {"__MACOSX", "@eaDir", "$RECYCLE.BIN", "System Volume Information", "lost+found"}
)


class LabelMapError(ValueError):
  """A label map that does not number the classes 0..N-1, or a folder missing from it."""


class LabelsError(ValueError):
  """A labels file (FILE,CLASS rows) that cannot be read or labels a file twice."""


def load_label_map(label_map: str | os.PathLike | Mapping[str, int] | Sequence[str]) -> list[str]:
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
    manifest_lib.check_classes(list(label_map), source)
    label_map = {name: i for i, name in enumerate(label_map)}
  classes: list[str | None] = [None] * len(label_map)
  for name, label in label_map.items():
    if not isinstance(label, int) or isinstance(label, bool):
      raise LabelMapError(f"{source}: label of class {name!r} is {label!r}, not an integer")
    if not 0 <= label < len(label_map):
      raise LabelMapError(
        f"{source}: label {label} of class {name!r} is out of range [0, {len(label_map)})"
      )
    if classes[label] is not None:
      raise LabelMapError(f"{source}: label {label} used by both {classes[label]!r} and {name!r}")
    classes[label] = name
  return classes  # every slot is filled: N distinct labels in [0, N)


def _inside(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _ignored(name: str) -> bool:
  """Hidden entries and the folders tools leave behind are never classes or images."""
  return name.startswith(".") or name in TOOL_FOLDERS


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


def load_labels(path: str | os.PathLike) -> dict[str, str]:
  """{file: class} from CSV rows FILE,CLASS[...]; the class is the first word of the second
  column, so ImageNet's LOC_val_solution.csv reads as is. A file may omit its extension."""
  labels: dict[str, str] = {}
  with open(path, newline="") as f:
    for line, row in enumerate(csv.reader(f), 1):
      if not any(cell.strip() for cell in row):
        continue
      if len(row) < 2 or not row[0].strip() or not row[1].split():
        raise LabelsError(
          f"labels file {os.fspath(path)} line {line}: wants FILE,CLASS, got {','.join(row)[:80]!r}"
        )
      name, cls = row[0].strip(), row[1].split()[0]
      if labels.setdefault(name, cls) != cls:
        raise LabelsError(
          f"labels file {os.fspath(path)} line {line}: {name} is labelled "
          f"both {labels[name]!r} and {cls!r}"
        )
  return labels


NOT_UTF8 = "file name is not UTF-8: rename it (records and the manifest hold UTF-8 names)"


def _utf8(name: str) -> bool:
  """False for a name with bytes that are not UTF-8 (Python holds them as lone surrogates)."""
  try:
    name.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def _printable(name: str) -> str:
  """`name` with its undecodable bytes written as \\xNN, for the skipped list."""
  return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _scan(
  src: str, follow_symlinks: bool, exclude: Sequence[str], labels: Mapping[str, str] | None = None
) -> tuple[dict[str, list[tuple[str, os.stat_result]]], list[dict[str, str]]]:
  """Image files per class (sorted relative paths and their stat) and what was left out.

  Classes are SRC's folders, or with `labels` ({file: class}) every file under SRC gets
  its class from there. Each file (by inode) gets one label: a link or hard link into
  another class is skipped, and a class folder linking to another folder of SRC is not a
  class."""
  root = os.path.realpath(src)
  excluded = {os.path.realpath(p) for p in exclude}
  by_class: dict[str, list[tuple[str, os.stat_result]]] = {}
  skipped: list[dict[str, str]] = []
  found: list[tuple[str, str, os.stat_result, bool]] = []  # class, path, stat, not via a link

  def walk(path: str, rel: str, name: str, canonical: bool) -> None:
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
      rel_path = os.path.join(rel, entry.name)
      if not _utf8(entry.name):
        skipped.append({"path": _printable(rel_path), "reason": NOT_UTF8})
      elif _ignored(entry.name):
        skipped.append({"path": rel_path, "reason": "hidden or tool file or folder"})
      elif problem := _link_problem(entry, root, follow_symlinks):
        skipped.append({"path": rel_path, "reason": problem})
      elif entry.is_dir():
        real = os.path.realpath(entry.path)
        if real in excluded:
          continue
        if real in visited:
          skipped.append({"path": rel_path, "reason": "symlink to a folder already listed"})
        elif _is_dataset(entry.path):
          skipped.append({"path": rel_path, "reason": "a converted dataset"})
        else:
          visited.add(real)
          walk(entry.path, rel_path, name, canonical and not entry.is_symlink())
      elif entry.is_file():
        found.append((name, rel_path, entry.stat(), canonical and not entry.is_symlink()))
      else:
        skipped.append({"path": rel_path, "reason": "not a regular file"})

  visited = {root}
  if labels is not None:
    walk(src, "", "", True)
    found[:] = _labelled(found, labels, skipped)
    by_class.update((name, []) for name in sorted({name for name, *_ in found}))
  else:
    for entry in _class_folders(src, root, excluded, visited, follow_symlinks, skipped):
      by_class[entry.name] = []
      walk(entry.path, entry.name, entry.name, not entry.is_symlink())

  _one_label(src, found, by_class, skipped)
  return by_class, skipped


def _one_label(
  src: str,
  found: list[tuple[str, str, os.stat_result, bool]],
  by_class: dict[str, list[tuple[str, os.stat_result]]],
  skipped: list[dict[str, str]],
) -> None:
  """Puts each found file in its class, once per file (by inode, real files before links):
  another path to the same file, in another class, is skipped."""

  def identity(rel: str, st: os.stat_result) -> tuple[int, int] | str:
    return (st.st_dev, st.st_ino) if st.st_ino else os.path.realpath(os.path.join(src, rel))

  owner: dict[tuple[int, int] | str, tuple[str, str]] = {}
  for name, rel, st, _ in sorted(found, key=lambda f: not f[3]):  # real files first
    owner.setdefault(identity(rel, st), (name, rel))
  for name, rel, st, _ in found:
    first_class, first = owner[identity(rel, st)]
    if first_class == name:
      by_class[name].append((rel, st))
    else:
      skipped.append(
        {
          "path": rel,
          "reason": f"same file as {first} in class {first_class}; an image gets one label",
        }
      )


def _scan_bucket(
  src: str, exclude: Sequence[str], labels: Mapping[str, str] | None = None
) -> tuple[dict[str, list[tuple[str, bucket.ObjectStat]]], list[dict[str, str]]]:
  """`_scan` of a folder in a bucket (one listing): objects have no links, so what is left
  out is hidden and tool entries, converted datasets, `exclude` and files outside a class."""
  root = src.rstrip("/")
  inside = (os.fspath(p).rstrip("/") for p in exclude)
  excluded = {p[len(root) + 1 :] for p in inside if p.startswith(root + "/")}
  files = bucket.list_files(src)
  datasets = set()
  for rel, _ in files:
    parts = rel.split("/")
    if parts[-1] == manifest_lib.FILENAME:
      datasets.add("/".join(parts[:-1]))
    if manifest_lib.BUILD_DIR in parts[:-1]:
      datasets.add("/".join(parts[: parts.index(manifest_lib.BUILD_DIR)]))
  skipped: list[dict[str, str]] = []
  found: list[tuple[str, str, bucket.ObjectStat, bool]] = []
  said: set[str] = set()

  def skip(path: str, reason: str) -> None:
    if path not in said:
      said.add(path)
      skipped.append({"path": path, "reason": reason})

  for rel, st in files:
    parts, ok = rel.split("/"), True
    for k, name in enumerate(parts):
      path, top, folder = "/".join(parts[: k + 1]), k == 0 and labels is None, k < len(parts) - 1
      if path in excluded:
        ok = False
      elif _ignored(name):
        skip(path, "hidden or tool folder, not a class" if top else "hidden or tool file or folder")
      elif folder and path in datasets:
        skip(path, "a converted dataset, not a class" if top else "a converted dataset")
      elif top and not folder:
        skip(path, "not in a class folder")
      else:
        continue
      ok = False
      break
    if ok:
      found.append(("" if labels is not None else parts[0], rel, st, True))
  if labels is not None:
    found = _labelled(found, labels, skipped)
  by_class: dict[str, list[tuple[str, bucket.ObjectStat]]] = {
    name: [] for name in sorted({name for name, *_ in found})
  }
  for name, rel, st, _ in found:
    by_class[name].append((rel, st))
  return by_class, skipped


def _class_folders(
  src: str,
  root: str,
  excluded: set[str],
  visited: set[str],
  follow_symlinks: bool,
  skipped: list[dict[str, str]],
) -> list[os.DirEntry]:
  """SRC's folders that are classes (their real paths join `visited`); the rest is skipped."""
  classes = []
  for entry in sorted(os.scandir(src), key=lambda e: e.name):
    real = os.path.realpath(entry.path)
    if real in excluded:
      continue
    if not _utf8(entry.name):
      skipped.append({"path": _printable(entry.name), "reason": NOT_UTF8})
    elif _ignored(entry.name):
      skipped.append({"path": entry.name, "reason": "hidden or tool folder, not a class"})
    elif problem := _link_problem(entry, root, follow_symlinks):
      skipped.append({"path": entry.name, "reason": problem})
    elif entry.is_dir() and entry.is_symlink() and _inside(real, root):
      skipped.append(
        {
          "path": entry.name,
          "reason": f"symlink to {os.path.relpath(real, root)} "
          "in the source folder, whose images are listed there once",
        }
      )
    elif entry.is_dir() and real in visited:
      skipped.append({"path": entry.name, "reason": "symlink to a folder already listed"})
    elif entry.is_dir() and _is_dataset(entry.path):
      skipped.append({"path": entry.name, "reason": "a converted dataset, not a class"})
    elif entry.is_dir():
      visited.add(real)
      classes.append(entry)
    else:
      skipped.append({"path": entry.name, "reason": "not in a class folder"})
  return classes


def _is_dataset(path: str) -> bool:
  return any(
    os.path.lexists(os.path.join(path, name))
    for name in (manifest_lib.FILENAME, manifest_lib.BUILD_DIR)
  )


def _labelled(
  found: list[tuple[str, str, os.stat_result, bool]],
  labels: Mapping[str, str],
  skipped: list[dict[str, str]],
) -> list[tuple[str, str, os.stat_result, bool]]:
  """Gives each found file its class from `labels` (by path, or path without extension)."""
  out = []
  for _, rel, st, canonical in found:
    names = {labels.get(rel), labels.get(os.path.splitext(rel)[0])} - {None}
    if len(names) > 1:
      raise LabelsError(f"the labels file labels {rel} both {' and '.join(sorted(names))}")
    name = names.pop() if names else None
    if name is None:
      skipped.append({"path": rel, "reason": "not in the labels file"})
    else:
      out.append((name, rel, st, canonical))
  return out


def scan(
  src: str, follow_symlinks: bool = False, exclude: Sequence[str] = ()
) -> tuple[dict[str, list[str]], list[dict[str, str]]]:
  """Lists image files per class folder (sorted relative paths) and what was left out."""
  by_class, skipped = _scan(src, follow_symlinks, exclude)
  return {name: [rel for rel, _ in files] for name, files in by_class.items()}, skipped


def process(
  task: tuple[tuple[str, int], ...],
  *,
  src: str,
  keys: records.Keys,
  max_size: int | None,
  max_pixels: int,
  read_many: Callable[[list[str]], list[bytes | OSError]] | None = None,
) -> list[shards.Outcome]:
  """Worker: reads, checks and encodes each (relative path, label) of a task. `read_many`
  (paths to bytes, or the OSError of each) reads the files, e.g. through Beam's FileSystems;
  by default a bucket's are fetched together and local files one at a time."""
  outcomes: list[shards.Outcome] = []
  if read_many is None and bucket.is_url(src):
    read_many = bucket.read_many
  fetched = None if read_many is None else read_many([os.path.join(src, rel) for rel, _ in task])
  for i, (rel, label) in enumerate(task):
    try:
      if fetched is None:
        data = bucket.read_bytes(os.path.join(src, rel))
      elif isinstance(data := fetched[i], OSError):
        raise data
      payload, why = checks.prepare(data, max_size=max_size, max_pixels=max_pixels)
    except (checks.BadImage, OSError) as e:
      outcomes.append((None, {"path": rel, "reason": str(e)}, None))
      continue
    record = records.encode(payload, label, rel, keys)
    outcomes.append((record, None, {"path": rel, "reason": why} if why else None))
  return outcomes


def _split_files(
  by_class: dict[str, list[tuple[str, os.stat_result]]],
  label_of: dict[str, int],
  val_fraction: float,
  seed: int,
  split: str,
) -> dict[str, list[tuple[str, int, os.stat_result]]]:
  """Per-class seeded split into (train, validation), then a seeded shuffle of each split."""
  rng = np.random.default_rng(seed)
  out: dict[str, list[tuple[str, int, os.stat_result]]] = {split: []}
  if val_fraction > 0:
    out[VALIDATION] = []
  for name in sorted(by_class):
    files = [(f, label_of[name], st) for f, st in by_class[name]]
    order = rng.permutation(len(files))
    num_val = round(len(files) * val_fraction) if val_fraction > 0 else 0
    if num_val:
      out[VALIDATION] += [files[i] for i in sorted(order[:num_val])]
    out[split] += [files[i] for i in sorted(order[num_val:])]
  for items in out.values():
    items[:] = [items[i] for i in rng.permutation(len(items))]
  return out


@dataclasses.dataclass(frozen=True)
class Request:
  """An image folder `src` to convert into `out`, and how (`convert images`' flags).

  With `val_fraction` > 0 it writes splits `split` and "validation" (split per class).
  With `labels`, a CSV of FILE,CLASS rows, `src` is a flat folder (ImageNet's `val/`).
  Splits of another conversion already in `out` are replaced only with `overwrite`.
  """

  src: str | os.PathLike
  out: str | os.PathLike
  _: dataclasses.KW_ONLY
  split: str = "train"
  val_fraction: float = 0.0
  seed: int = 0
  label_map: str | os.PathLike | Mapping[str, int] | Sequence[str] | None = None
  shard_size_mb: float = shards.DEFAULT_SHARD_SIZE_MB
  max_size: int | None = None
  max_pixels: int = checks.MAX_PIXELS
  follow_symlinks: bool = False
  keys: records.Keys = records.DEFAULT_KEYS
  labels: str | os.PathLike | None = None
  overwrite: bool = False


def _check_arguments(request: Request) -> None:
  shards.check_split_name(request.split)
  split, val_fraction = request.split, request.val_fraction
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
  if val_fraction > 0 and split == VALIDATION:
    raise ValueError(
      f"split {split!r} is the name of the split val_fraction makes; choose another --split"
    )
  if request.max_size is not None and request.max_size < 1:
    raise ValueError(f"max_size must be a positive number of pixels, got {request.max_size}")
  if request.max_pixels < 1:
    raise ValueError(f"max_pixels must be a positive number of pixels, got {request.max_pixels}")


def _list(request: Request) -> tuple[dict[str, list], list[dict[str, str]]]:
  """The image files per class of SRC (a folder here or in a bucket) and what was left out;
  a missing SRC, or OUT being SRC itself, is an error."""
  src, out = os.fspath(request.src), os.fspath(request.out)
  in_bucket = bucket.is_url(src)
  if in_bucket:
    bucket.check(src)
  elif os.path.exists(src) and not os.path.isdir(src):
    raise NotADirectoryError(f"{src} is a file, not an image folder")
  elif not os.path.isdir(src):
    raise FileNotFoundError(f"image folder {src} not found")
  same = out.rstrip("/") == src.rstrip("/")
  if same or (not in_bucket and os.path.realpath(out) == os.path.realpath(src)):
    raise ValueError(f"the output folder must not be the image folder {src} itself")
  labelled = None if request.labels is None else load_labels(request.labels)
  if not in_bucket:
    return _scan(src, request.follow_symlinks, [out], labelled)
  by_class, skipped = _scan_bucket(src, [out], labelled)
  if not by_class and not skipped:
    raise FileNotFoundError(f"image folder {src} not found (no objects under it)")
  return by_class, skipped


def _classes(request: Request, by_class: dict[str, list]) -> list[str]:
  """The class names in label order: the label map's, or the class folders sorted."""
  src = os.fspath(request.src)
  if request.label_map is not None:
    classes = load_label_map(request.label_map)
    unknown = sorted(set(by_class) - set(classes))
    if unknown:
      raise LabelMapError(
        f"class folders {unknown} in {src} are not in the label map (it has {len(classes)} classes)"
      )
  else:
    classes = sorted(by_class)
  if not classes:
    raise ValueError(
      f"no class folders in {src} (expected SRC/CLASS/IMAGE)"
      if request.labels is None
      else f"no file in {src} is named in the labels file {request.labels}"
    )
  return classes


def _empty_classes(request: Request, by_class: dict[str, list], skipped: list[dict]) -> list[dict]:
  """The skipped entries of class folders with nothing to convert; refuses them without a
  label map: a bucket lists no empty folders, so a copy there would number the rest apart."""
  empty = [name for name in sorted(by_class) if not by_class[name]]
  if empty and request.label_map is None:
    left = next((s for s in skipped if s["path"].startswith(empty[0] + "/")), None)
    why = f" (skipped {left['path']}: {left['reason']})" if left else ""
    raise ValueError(
      f"class folder {os.path.join(os.fspath(request.src), empty[0])} holds no files to convert"
      f"{why}: remove it (a copy in a bucket has no empty folders, so the labels of the classes "
      "after it would differ), or pin every label with --label-map"
    )
  return [{"path": name + "/", "reason": "empty class folder"} for name in empty]


def _arguments(request: Request) -> dict:
  """The arguments that shape the output, as the manifest records them."""
  return {
    "split": request.split,
    "val_fraction": request.val_fraction,
    "seed": request.seed,
    "label_map": None if request.label_map is None else str(request.label_map),
    "shard_size_mb": request.shard_size_mb,
    "max_size": request.max_size,
    "max_pixels": request.max_pixels,
    "follow_symlinks": request.follow_symlinks,
    "labels": None if request.labels is None else str(request.labels),
  }


def plan(request: Request) -> shards.Job:
  """Scans SRC, numbers its classes, splits and orders its files and plans the shards.

  OUT is left out of the scan when it lies inside SRC.
  """
  _check_arguments(request)
  shard_bytes = shards.shard_bytes(request.shard_size_mb)
  by_class, skipped = _list(request)
  classes = _classes(request, by_class)
  skipped += _empty_classes(request, by_class, skipped)
  label_of = {name: i for i, name in enumerate(classes)}
  split_items = _split_files(by_class, label_of, request.val_fraction, request.seed, request.split)
  plans, inputs = [], []
  for name, items in split_items.items():
    plans += shards.plan_split(
      name,
      [(rel, label) for rel, label, _ in items],
      [st.st_size for _, _, st in items],
      shard_bytes,
    )
    inputs.append([name, [(rel, label, st.st_size, st.st_mtime_ns) for rel, label, st in items]])
  src, keys, args = os.fspath(request.src), request.keys, _arguments(request)
  work = functools.partial(
    process, src=src, keys=keys, max_size=request.max_size, max_pixels=request.max_pixels
  )
  return shards.Job(
    out=os.fspath(request.out),
    plans=plans,
    process=work,
    fp=shards.fingerprint(__version__, args, classes, keys, inputs),
    classes=classes,
    splits=list(split_items),
    keys=keys,
    skipped=skipped,
    created_by={
      "tool": "pipeline.convert images",
      "version": __version__,
      "args": args,
      "source": src if bucket.is_url(src) else os.path.abspath(src),
    },
  )


def convert(
  request: Request, workers: int | None = None, progress: bool = True
) -> manifest_lib.Manifest:
  """Converts an image folder to ArrayRecord shards and manifest.json in OUT.

  Into a dataset already in OUT it adds the splits (classes must match). Re-running after
  an interruption keeps finished shards; the result is the same whatever `workers` is.
  """
  name = os.path.basename(os.path.normpath(os.fspath(request.src)))
  return bucket.convert(plan, request, workers, progress, f"convert {name}")
