"""Conversion where the data lives: sources read from, and datasets written to, gs://.

Reading: a source folder is listed once (`list_files`: names, sizes and generations, for the
same plan as a local folder of the same files); a worker fetches its task's files (up to 256,
4 MiB) concurrently (`read_many`); TFRecords are read through gcsfs with 8 MiB read-ahead.

Writing (`BucketTarget`): the plan and the bytes are the local converter's. Each shard is
written to a local temporary folder (at most one shard per worker at a time), uploaded as it
finishes to `OUT/.convert-build/NAME`, checked against the CRC32C GCS computed of the object, and
removed locally; a done marker beside it (the job's fingerprint, records, size, sha256,
crc32c, generation) lets a re-run of the same job keep it. At the end `swap.json` (the new
manifest: the commit point) is written to the build folder, the shards are copied into OUT
inside the bucket (no download), and manifest.json is written last, in one request; should
a new shard take the name of an object in OUT, the old manifest.json is removed first. So a
reader sees the old dataset, no dataset, or the new one. The manifest records each shard's
CRC32C and its object's generation in OUT, which readers check (`manifest.checked_shards`;
the generations in OUT only, not in a copy of the dataset); they pin the generation at open.
A lock object (`locked`, created only if absent) refuses a second conversion into OUT.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

from etils import epath

from pipeline.catalog import manifest as manifest_lib
from pipeline.convert import shards
from pipeline.storage import backend, remote

T = TypeVar("T")
_PLAN = "plan.json"
_SWAP = "swap.json"
_STAGE = "pipeline-convert-"  # + pid: the local temporary folder of a conversion


class ObjectStat(NamedTuple):
  """What a listing says of an object, named as `os.stat_result` names it (the generation
  stands in for the mtime: it changes whenever the object is written)."""

  st_size: int
  st_mtime_ns: int


def is_url(path) -> bool:
  return remote.scheme(os.fspath(path)) is not None


def join(url: str, *names: str) -> str:
  return "/".join([url.rstrip("/"), *names])


def _fs(url: str):
  from etils.epath.backend import fsspec_backend

  return fsspec_backend.fs(url)


def _writing(fn: Callable[[], T], what: str) -> T:
  """`fn()`, a write to a bucket; an error is `RemoteStorageError`, one line naming `what`."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001 - gcsfs, aiohttp and google-auth raise their own
    raise remote.RemoteStorageError(f"cannot write {what}: {remote.explain(e)}") from None


def check(url: str) -> None:
  """One line at once if this host cannot use `url` (gs:// only: no gcsfs, no credentials,
  no network)."""
  backend.check(url)


def read_bytes(path: str) -> bytes:
  """A source file's bytes: a local file, or an object read with a deadline and retries."""
  if not is_url(path):
    with open(path, "rb") as f:
      return f.read()
  return remote.call(epath.Path(path).read_bytes, path)


async def _cat_all(fs, paths: Sequence[str]) -> list:
  return await asyncio.gather(*(fs._cat_file(p) for p in paths), return_exceptions=True)


def read_many(paths: Sequence[str]) -> list[bytes | OSError]:
  """The bytes of objects in one bucket, fetched concurrently (one round trip for a worker's
  task rather than one per file): a missing one is its `FileNotFoundError`; any other error
  fails the whole read, retried as `remote.call` does."""
  if not paths:
    return []
  from fsspec.asyn import sync

  fs = _fs(paths[0])

  def fetch() -> list:
    found = sync(fs.loop, _cat_all, fs, list(paths))
    for i, e in enumerate(found):
      if isinstance(e, FileNotFoundError):
        found[i] = FileNotFoundError(errno.ENOENT, "No such object", paths[i])
      elif isinstance(e, BaseException):
        raise e
    return found

  return remote.call(fetch, f"{paths[0].rsplit('/', 1)[0]}/ ({len(paths)} files)")


def open_file(path: str):
  """A source file opened for binary reads: local, or an object (read ahead in 8 MiB blocks)."""
  if not is_url(path):
    return open(path, "rb")
  return remote.call(lambda: _fs(path).open(path, "rb", block_size=8 << 20), path)


def stat(path: str) -> os.stat_result | ObjectStat:
  """A source file's size and mtime (an object's generation), one request for an object."""
  if not is_url(path):
    return os.stat(path)
  fs = _fs(path)
  fs.invalidate_cache(path)
  info = remote.call(lambda: fs.info(path), path)
  return ObjectStat(int(info["size"]), int(info.get("generation") or 0))


def glob(pattern: str) -> list[str]:
  """The objects matching a glob `pattern` (gs://bucket/dir/*.tfrecord), sorted URLs."""
  check(pattern.rsplit("/", 1)[0])
  scheme, bare = pattern.split("://", 1)
  fs = _fs(pattern)
  fs.invalidate_cache()
  found = remote.call(lambda: fs.glob(bare), pattern)
  return sorted(f"{scheme}://{p}" for p in found)


def list_files(src: str) -> list[tuple[str, ObjectStat]]:
  """Every object under the folder `src` (one listing): (path relative to `src`, its stat),
  in the order a walk of a local folder visits them (names sorted per folder)."""
  fs, root = _fs(src), src.rstrip("/")
  bare = root.split("://", 1)[1]
  fs.invalidate_cache()
  try:
    found = remote.call(lambda: fs.find(bare, detail=True), root)
  except FileNotFoundError:
    found = {}
  files = []
  for key, info in found.items():
    rel = key[len(bare) :].lstrip("/")
    if rel and not rel.endswith("/") and info.get("type", "file") == "file":
      files.append((rel, ObjectStat(int(info["size"]), int(info.get("generation") or 0))))
  return sorted(files, key=lambda f: f[0].split("/"))


# --- writing a dataset into a bucket -------------------------------------------------------


def _names(url: str) -> set[str]:
  """Names of the objects directly in the folder `url` (one listing, fresh)."""
  fs = _fs(url)
  fs.invalidate_cache()
  try:
    listed = remote.call(lambda: fs.ls(url.split("://", 1)[1], detail=False), url)
  except FileNotFoundError:
    return set()
  return {p.rstrip("/").rsplit("/", 1)[-1] for p in listed}


def _generations(url: str) -> dict[str, str]:
  """{name: generation} of the objects directly in the folder `url` (one listing, fresh)."""
  fs = _fs(url)
  fs.invalidate_cache()
  listed = remote.call(lambda: fs.ls(url.split("://", 1)[1], detail=True), url)
  return {
    i["name"].rstrip("/").rsplit("/", 1)[-1]: str(i["generation"])
    for i in listed
    if i.get("type") == "file" and i.get("generation")
  }


def _objects(url: str) -> dict[str, dict[str, Any]]:
  """{name: metadata} of every object under the folder `url` (one listing, fresh)."""
  fs = _fs(url)
  fs.invalidate_cache()
  bare = url.split("://", 1)[1].rstrip("/")
  try:
    found = remote.call(lambda: fs.find(bare, detail=True), url)
  except FileNotFoundError:
    return {}
  return {k[len(bare) :].lstrip("/"): v for k, v in found.items()}


def _crc32c(info: dict[str, Any]) -> str | None:
  crc = info.get("crc32c")
  return base64.b64decode(crc).hex() if crc else None


def _read_json(url: str) -> Any:
  try:
    return json.loads(remote.call(epath.Path(url).read_bytes, url))
  except (FileNotFoundError, ValueError):
    return None


def _write_json(url: str, data: Any) -> None:
  fs = _fs(url)
  _writing(lambda: fs.pipe_file(url, json.dumps(data).encode()), url)


def _remove(url: str, recursive: bool = False) -> None:
  """Removes an object (or, `recursive`, a folder); one that is not there is no error."""
  fs = _fs(url)

  def rm() -> None:
    try:
      fs.rm(url, recursive=recursive)
    except FileNotFoundError:
      pass

  _writing(rm, url)


def upload(out: str, path: str, result: shards.ShardResult, fp: str) -> shards.ShardResult:
  """Uploads a finished local shard into OUT's build folder, checks the object's CRC32C and
  size, removes the local file and writes the shard's done marker."""
  fs, obj = _fs(out), join(out, shards.BUILD_DIR, result.name)
  _writing(lambda: fs.put_file(path, obj), obj)
  fs.invalidate_cache(obj)
  info = remote.call(lambda: fs.info(obj), obj)
  crc = _crc32c(info)
  if int(info["size"]) != result.size or (crc is not None and crc != result.crc32c):
    raise remote.RemoteStorageError(
      f"cannot write {obj}: it arrived as {info['size']} bytes with crc32c {crc}, not "
      f"{result.size} bytes with crc32c {result.crc32c}: run the same command again"
    )
  os.unlink(path)
  marker = {"fingerprint": fp, "result": dataclasses.asdict(result)}
  _write_json(obj + ".done", {**marker, "generation": str(info.get("generation"))})
  return result


def _uploaded(job: shards.Job) -> dict[str, shards.ShardResult]:
  """Shards an interrupted run of this very job uploaded (marker, size and CRC32C agree)."""
  build = join(job.out, shards.BUILD_DIR)
  objects, done = _objects(build), {}
  for p in job.plans:
    if p.name not in objects or p.name + ".done" not in objects:
      continue
    marker = _read_json(join(build, p.name + ".done"))
    if not isinstance(marker, dict) or marker.get("fingerprint") != job.fp:
      continue
    result = shards.ShardResult(**marker["result"])
    info = objects[p.name]
    if int(info["size"]) == result.size and _crc32c(info) in (None, result.crc32c):
      done[p.name] = result
  return done


def swap_in(out: str) -> None:
  """Moves a committed build into OUT (copies inside the bucket, then manifest.json); safe to
  repeat after a crash at any point."""
  build, fs = join(out, shards.BUILD_DIR), _fs(out)
  swap = _read_json(join(build, _SWAP))
  if swap is None:
    _remove(build, recursive=True)
    return
  m = manifest_lib.from_json(swap["manifest"], join(build, _SWAP))
  files = [sh.file for s in m.splits.values() for sh in s.shards]
  built, there = _objects(build), _names(out)
  moving = [f for f in files if f in built]
  if any(f in there for f in moving):  # the old manifest may name them
    _remove(join(out, manifest_lib.FILENAME))
  for f in moving:
    _writing(lambda f=f: fs.copy(join(build, f), join(out, f)), join(out, f))
  generations = _generations(out)
  for s in m.splits.values():
    s.shards = [dataclasses.replace(sh, generation=generations.get(sh.file)) for sh in s.shards]
  m.written_to = out.rstrip("/")
  text = manifest_lib.dumps(m).encode()
  _writing(lambda: fs.pipe_file(join(out, manifest_lib.FILENAME), text), join(out, "manifest"))
  for f in swap["remove"]:
    if f not in files and f in there:
      _remove(join(out, f))
  _remove(build, recursive=True)


def _create(url: str, data: bytes) -> bool:
  """Writes the object `url` only if there is none (the precondition ifGenerationMatch=0);
  False if there is one."""
  fs = _fs(url)

  def create() -> bool:
    try:
      fs.pipe_file(url, data, mode="create")
    except FileExistsError:
      return False
    return True

  return _writing(create, url)


def _alive(pid: Any) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (OSError, TypeError, ValueError):  # another user's process, or no pid
    return True
  return True


@contextlib.contextmanager
def locked(out: str) -> Iterator[None]:
  """Holds OUT's lock object, created only if absent: a second conversion into OUT is refused
  in one line. A lock left by a killed conversion on this host (its pid is gone) is taken
  over; one from another host is named, for a person to remove."""
  path, host = join(out, shards.LOCK_FILE), socket.gethostname()
  mine = json.dumps({"host": host, "pid": os.getpid()}).encode()
  for _ in range(2):
    if _create(path, mine):
      break
    holder = _read_json(path)
    holder = holder if isinstance(holder, dict) else {}
    if holder.get("host") != host or _alive(holder.get("pid")):
      raise shards.ConversionError(
        f"{out} is being converted by another process (pid {holder.get('pid', '?')} on "
        f"{holder.get('host', '?')}); wait for it to finish or stop it (if it is gone: "
        f"remove {path})"
      )
    _remove(path)  # left by a killed conversion on this host
  else:
    raise shards.ConversionError(f"{out} is being converted by another process; try again")
  try:
    yield
  finally:
    _remove(path)


def _remove_stale_stages() -> None:
  """Removes the local temporary folders of killed conversions (their process is gone)."""
  root = tempfile.gettempdir()
  for entry in os.scandir(root):
    match = re.fullmatch(rf"{_STAGE}(\d+)-\w+", entry.name)
    if not match or not entry.is_dir(follow_symlinks=False):
      continue
    try:
      os.kill(int(match[1]), 0)
    except ProcessLookupError:
      shutil.rmtree(entry.path, ignore_errors=True)
    except OSError:  # alive, another user's
      pass


def local_shard(
  plan: shards.ShardPlan, done: Callable[[shards.ShardResult, str], shards.ShardResult]
) -> shards.ShardWriter:
  """A writer of `plan` in a new local temporary folder, removed when the writer is closed
  (those of killed conversions first); `done(result, path)` sends the finished file away."""
  _remove_stale_stages()
  stage = tempfile.mkdtemp(prefix=f"{_STAGE}{os.getpid()}-")
  return shards.ShardWriter(
    plan, stage, done, cleanup=lambda: shutil.rmtree(stage, ignore_errors=True)
  )


class BucketTarget(shards.Target):
  """OUT a folder in a bucket: a lock object, shards written locally (at most one per worker
  at a time) and uploaded to `OUT/.convert-build/`, copied into OUT inside the bucket."""

  def locked(self, out: str) -> contextlib.AbstractContextManager[None]:
    check(out)  # no gcsfs, credentials or network: one line, before anything is written
    return locked(out)

  def start(self, job: shards.Job, overwrite: bool) -> manifest_lib.Manifest | None:
    """Finishes a committed swap, checks OUT (`shards.check_target`) and removes another
    plan's build folder."""
    build = join(job.out, shards.BUILD_DIR)
    if _SWAP in _names(build):
      swap_in(job.out)
    there = None

    def exists(name: str) -> bool:
      nonlocal there
      there = _names(job.out) if there is None else there
      return name in there

    if (m := shards.check_target(job, overwrite, exists)) is not None:
      _remove(build, recursive=True)
      return m
    plan = _read_json(join(build, _PLAN))
    if not isinstance(plan, dict) or plan.get("fingerprint") != job.fp:
      _remove(build, recursive=True)
      _write_json(join(build, _PLAN), {"fingerprint": job.fp})
    return None

  def written(self, job: shards.Job) -> dict[str, shards.ShardResult]:
    return _uploaded(job)

  def open_shard(self, job: shards.Job, plan: shards.ShardPlan) -> shards.ShardWriter:
    return local_shard(plan, lambda result, path: upload(job.out, path, result, job.fp))

  def finish(self, job: shards.Job, results: Sequence[shards.ShardResult]) -> manifest_lib.Manifest:
    try:
      m, remove = shards.manifest_of(job, results, shards._load_existing(job.out, overwrite=True))
    except shards.ConversionError:
      _remove(join(job.out, shards.BUILD_DIR), recursive=True)
      raise
    build = join(job.out, shards.BUILD_DIR)
    _write_json(join(build, _SWAP), {"manifest": m.to_json(), "remove": remove})
    swap_in(job.out)
    return m


def target(out: str | os.PathLike) -> shards.Target:
  """The target of a conversion into `out`: a bucket's or a local folder's."""
  return BucketTarget() if is_url(out) else shards.LocalTarget()


def convert(plan: Callable, request, workers: int | None, progress: bool, desc: str):
  """`plan(request)`'s job written into `request.out`, a bucket's or a local folder's target
  (checked first: no gcsfs, credentials or network is one line, at once)."""
  shards.check_workers(workers)
  if is_url(request.out):
    check(os.fspath(request.out))
  job = plan(request)
  return shards.run(
    job, target(job.out), workers=workers, progress=progress, desc=desc, overwrite=request.overwrite
  )
