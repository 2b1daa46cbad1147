"""`manifest.json` read and written (its schema: `pipeline.catalog.schema`), and the checks a reader
makes of the files it lists, through their storage backend (`pipeline.storage.backend`).

`checked_shards` is what a reader calls at open: it refuses a dataset whose files do not
match the manifest (missing, not regular files, another size, counts that do not add up, and
for gs:// objects another CRC32C than the shard's: GCS keeps every object's CRC32C, so one
metadata request per shard checks its content; and, in the folder a conversion into a bucket
wrote, another generation than the one recorded). `pinned_shards` also returns each shard's
pin (`pipeline.storage.backend.pin`), taken by the same stat or request, which keeps a reader
on the files it checked. Manifests written before shards had a "crc32c" still open, with the
size check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

from etils import epath

from pipeline.catalog import tfds_folder

# The schema's names, where they were before `pipeline.catalog.schema` held them.
from pipeline.catalog.schema import (  # noqa: F401
  FILENAME,
  FORMAT,
  Manifest,
  ManifestError,
  Shard,
  Split,
  check_classes,
  from_json,
  splits_from_json,
)
from pipeline.storage import backend

BUILD_DIR = ".convert-build"  # where a conversion into the folder writes until it is done
VERIFY_LEVELS = ("none", "size", "sha256")


def load(data_dir, deadline_s: float | None = None) -> Manifest:
  """Reads `data_dir/manifest.json`; a missing one is `FileNotFoundError`, a damaged one
  `ManifestError`, each naming the file; a bucket this host cannot read (no gcsfs, no
  credentials) is one `RemoteStorageError` line (`pipeline.storage.backend.check`), a mount
  that does not answer within `deadline_s` too. A TFDS ArrayRecord build (its version folder,
  or tfds://name[:version]) has none: `pipeline.catalog.tfds_folder` makes its Manifest."""
  if tfds_folder.is_uri(data_dir):
    return tfds_folder.load(data_dir, deadline_s)
  backend.check(data_dir)
  path, missing = epath.Path(data_dir) / FILENAME, False
  storage = backend.of(path)
  try:
    size = storage.size(path, deadline_s)
  except FileNotFoundError:
    missing = True
  except NotADirectoryError:
    raise NotADirectoryError(f"{data_dir} is a file, not a dataset folder") from None
  info = epath.Path(data_dir) / tfds_folder.INFO  # a TFDS build's, maybe elsewhere (a link)
  if missing and backend.of(info).guard(lambda: tfds_folder.is_build(data_dir), info, deadline_s):
    return tfds_folder.load(data_dir, deadline_s)
  if missing:
    building = os.path.join(os.fspath(data_dir), BUILD_DIR)
    if storage.scheme is None and storage.guard(lambda: os.path.isdir(building), path, deadline_s):
      raise FileNotFoundError(
        f"{path} not found: a conversion into {data_dir} is running or was interrupted; "
        "re-run it to finish"
      ) from None
    raise FileNotFoundError(
      f"{path} not found: convert the dataset first (python -m pipeline.convert --help)"
      + storage.guard(lambda: tfds_folder.hint(data_dir), path, deadline_s)
    ) from None
  if size is None:
    raise ManifestError(f"{path} is not a regular file")
  text = storage.guard(path.read_bytes, path, deadline_s)
  try:
    data = json.loads(text)
  except (ValueError, UnicodeDecodeError) as e:
    raise ManifestError(f"{path} is not valid JSON (truncated or damaged?): {e}") from None
  except RecursionError:
    raise ManifestError(f"{path} is nested too deeply to be a manifest") from None
  return from_json(data, os.fspath(path))


def dumps(manifest: Manifest) -> str:
  """The text of manifest.json."""
  return json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n"


def save(manifest: Manifest, data_dir) -> None:
  """Writes the manifest atomically (temporary name, then rename over the old one)."""
  path = epath.Path(data_dir) / FILENAME
  tmp = path.parent / f".{FILENAME}.tmp-{os.getpid()}"
  tmp.write_text(dumps(manifest))
  tmp.replace(path)


def _sha256(path: epath.Path, deadline_s: float | None = None) -> str:
  """The file's digest; on a mount its open and each read of 4 MiB wait at most `deadline_s`."""
  h, storage = hashlib.sha256(), backend.of(path)
  f = storage.guard(lambda: path.open("rb"), path, deadline_s)
  with f:
    while block := storage.guard(lambda: f.read(1 << 22), path, deadline_s):
      h.update(block)
  return h.hexdigest()


def _checked(
  data_dir, meta: Manifest, split: str, verify: str, deadline_s: float | None = None
) -> tuple[list[epath.Path], list]:
  """`checked_shards`, plus the pin of each shard taken by the same stat or request
  (`pipeline.storage.backend.look`)."""
  if verify not in VERIFY_LEVELS:
    raise ValueError(f"verify must be one of {VERIFY_LEVELS}, not {verify!r}")
  where = epath.Path(data_dir) / meta.read_from
  if split not in meta.splits:
    raise ManifestError(f"split {split!r} not in {where}; it has {sorted(meta.splits)}")
  s = meta.splits[split]
  total = sum(sh.num_records for sh in s.shards)
  if s.num_records != total:
    raise ManifestError(
      f"{where}: split {split!r} says {s.num_records} records but its shards hold {total}"
    )
  paths = [epath.Path(data_dir) / sh.file for sh in s.shards]
  here = written_here(data_dir, meta)
  pins = []
  if verify == "none":  # but never a FIFO or device a reader would block on (local: one stat)
    for path in paths:
      pinned, storage = None, backend.of(path)
      if storage.scheme is None:
        with contextlib.suppress(FileNotFoundError):  # missing: the reader says so at open
          if not (pinned := storage.look(path, deadline_s)[1]):
            raise ManifestError(f"shard {path} is not a regular file")
      pins.append(pinned)
    return paths, pins
  for path, sh in zip(paths, s.shards):
    try:
      size, pinned, crc = backend.look(path, deadline_s)
    except FileNotFoundError:
      raise ManifestError(f"shard {path} is missing") from None
    if size is None:
      raise ManifestError(f"shard {path} is not a regular file")
    if sh.generation is not None and here and pinned and pinned[1] != sh.generation:
      raise ManifestError(
        f"shard {path} is generation {pinned[1]}, {where} says {sh.generation}: the object was "
        "replaced after conversion"
      )
    if sh.bytes is not None and size != sh.bytes:
      raise ManifestError(
        f"shard {path} has {size} bytes, {where} says {sh.bytes}: it changed after conversion"
      )
    if crc is not None and sh.crc32c is not None and crc != sh.crc32c:
      raise ManifestError(
        f"shard {path} has crc32c {crc}, {where} says {sh.crc32c}: it changed after conversion"
      )
    if verify == "sha256" and not sh.sha256:
      raise ManifestError(f"{where} records no sha256 of {path.name}: use verify='size'")
    if verify == "sha256" and (digest := _sha256(path, deadline_s)) != sh.sha256:
      raise ManifestError(
        f"shard {path} has sha256 {digest[:12]}..., {where} says "
        f"{sh.sha256[:12]}...: it changed after conversion"
      )
    pins.append(pinned)
  return paths, pins


def written_here(data_dir, meta: Manifest) -> bool:
  """Whether `data_dir` is the bucket folder a conversion wrote `meta` into, whose objects' its
  shard generations are (not a copy of the dataset elsewhere)."""
  here = os.fspath(data_dir).rstrip("/")
  return meta.written_to == here and backend.of(here).scheme is not None


def checked_shards(data_dir, meta: Manifest, split: str, verify: str = "size") -> list[epath.Path]:
  """The split's shard paths after checking them against the manifest, for a reader to open.

  Always: the split exists and its `num_records` is the sum of its shards' counts.
  verify="size" (cheap: one stat, or for gs:// one metadata request, per shard): each shard is
  a regular file of the recorded size (manifests without sizes skip the size check), and a
  gs:// object has the recorded CRC32C and generation (`written_here`); "sha256": also its
  full digest; "none": no per-file checks but, where local, that each is a regular file (a
  reader would block forever on a FIFO). Raises `ManifestError` naming the file.
  """
  return _checked(data_dir, meta, split, verify)[0]


def pinned_shards(
  data_dir, meta: Manifest, split: str, verify: str = "size", deadline_s: float | None = None
):
  """`checked_shards`, plus each shard's `pin`, taken while `meta` is still the manifest in
  `data_dir` (a conversion swaps shards in only after removing or replacing it); on a mount
  each stat and read waits at most `deadline_s`."""
  paths, pins = _checked(data_dir, meta, split, verify, deadline_s)
  try:
    still = load(data_dir, deadline_s) == meta
  except (FileNotFoundError, ManifestError):
    still = False
  if not still:
    raise ManifestError(
      f"{epath.Path(data_dir) / FILENAME} changed while the dataset was being opened "
      "(a conversion into it?): open it again"
    )
  return paths, pins
