"""Shard plans and writing: TFDS-style names, byte-sized shards, atomic and resumable writes.

Records go to shards by a plan fixed before any work starts (the ordered inputs and their
sizes), so the output is byte-identical whatever the worker count or completion order.

A conversion never touches the dataset already in OUT until it is complete. It holds a lock
on OUT and builds in `OUT/.convert-build/` (tagged with the job's fingerprint: the source
listing and every argument): each shard is written under a temporary name and renamed when
complete, and a done marker (count, sha256, crc32c, size, skipped files) lets a re-run after a crash
keep it. At the end the new manifest is written to the build folder (the commit point) and
swapped in: the shards are renamed into OUT, then manifest.json is replaced in one rename.
Should a new shard take the name of a file already in OUT, the old manifest.json is removed
first, so a reader sees the old dataset, no dataset, or the new one, never a mix.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import itertools
import json
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import shutil
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import google_crc32c
import numpy as np
import tqdm
from array_record.python import array_record_module

from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.host import light

OPTIONS = "group_size:1,uncompressed"  # random access; JPEG payloads are not compressed again
DEFAULT_SHARD_SIZE_MB = 128
BUILD_DIR = manifest_lib.BUILD_DIR
LOCK_FILE = ".convert.lock"
_PLAN_FILE = "plan.json"  # the fingerprint of the job the build folder belongs to
_SWAP_FILE = "swap.json"  # the finished manifest and the old shards to remove: the commit
_OLD_PROGRESS_DIR = ".convert-progress"  # resume state of earlier versions, inside OUT
# What `manifest.save` and earlier versions' shard writers leave behind when killed.
_TEMPORARY = re.compile(r"\.(manifest\.json|[\w-]+\.array_record-\d+-of-\d+)\.tmp-\d+")
_TASK_BYTES = 4 << 20  # work sent to a worker at a time
_TASK_ITEMS = 256
_WORKER_MODULES = [
  "pipeline.convert.builtin",
  "pipeline.convert.images",
  "pipeline.convert.tfrecord",
  "pipeline.convert.verify",
]

# What a worker returns per input: (serialized record or None, skipped entry or None,
# re-encoded entry or None); entries are {"path": ..., "reason": ...}.
Outcome = tuple[bytes | None, dict[str, str] | None, dict[str, str] | None]


class ConversionError(ValueError):
  """A conversion refused before it changes anything (clobbering, a busy OUT, no records)."""


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """One output shard: its split, file name and the work items whose records it holds."""

  split: str
  name: str
  items: tuple[Any, ...]
  sizes: tuple[int, ...]


@dataclasses.dataclass
class ShardResult:
  """A finished shard, as recorded in its done marker."""

  name: str
  num_records: int
  sha256: str
  size: int
  skipped: list[dict[str, str]]
  reencoded: list[dict[str, str]]
  crc32c: str | None = None  # markers of earlier versions lack it: their shards are rewritten


def shard_name(split: str, index: int, count: int) -> str:
  return f"{split}.array_record-{index:05d}-of-{count:05d}"


def shard_bytes(shard_size_mb: float) -> int:
  """The target shard size in bytes; anything but a positive number is a ValueError."""
  if (
    isinstance(shard_size_mb, bool)
    or not isinstance(shard_size_mb, (int, float))
    or not math.isfinite(shard_size_mb)
    or shard_size_mb <= 0
  ):
    raise ValueError(f"shard_size_mb must be a positive number of MiB, got {shard_size_mb!r}")
  return max(1, int(shard_size_mb * (1 << 20)))


def check_workers(workers: int | None) -> None:
  if workers is not None and (
    isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
  ):
    raise ValueError(f"workers must be a positive integer, got {workers!r}")


def check_split_name(split: str) -> None:
  """Split names become file name prefixes: letters, digits, '_' and '-', not leading '-'."""
  if not isinstance(split, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", split):
    raise ValueError(f"split name {split!r} must be letters, digits, '_' or '-'")


def plan_split(
  split: str, items: Sequence[Any], sizes: Sequence[int], shard_bytes: int
) -> list[ShardPlan]:
  """Cuts a split's items, in order, into contiguous shards of about `shard_bytes` each."""
  if not items:
    return []
  cum = np.cumsum(np.asarray(sizes, dtype=np.int64))
  count = max(1, min(len(items), math.ceil(int(cum[-1]) / shard_bytes)))
  cuts = [0]
  for k in range(1, count):
    cut = int(np.searchsorted(cum, cum[-1] * k / count, side="left")) + 1
    cuts.append(min(max(cut, cuts[-1] + 1), len(items) - (count - k)))
  cuts.append(len(items))
  return [
    ShardPlan(split, shard_name(split, i, count), tuple(items[a:b]), tuple(sizes[a:b]))
    for i, (a, b) in enumerate(itertools.pairwise(cuts))
  ]


def sha256_file(path: str | os.PathLike) -> str:
  return digests(path)[0]


def digests(path: str | os.PathLike) -> tuple[str, str]:
  """(sha256, crc32c) of a file in one pass, as hex; the CRC32C is what GCS keeps of every
  object, so a reader checks a gs:// shard against it with one metadata request."""
  h, crc = hashlib.sha256(), google_crc32c.Checksum()
  with open(path, "rb") as f:
    while block := f.read(1 << 22):
      h.update(block)
      crc.update(block)
  return h.hexdigest(), crc.hexdigest().decode()


def fingerprint(*parts: Any) -> str:
  """A digest of everything that determines the output (plan, options, version)."""
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def build_dir(out: str) -> str:
  return os.path.join(out, BUILD_DIR)


class AtomicShard:
  """An ArrayRecord shard written under a temporary name and renamed by `commit`."""

  def __init__(self, directory: str, name: str):
    self.path = os.path.join(directory, name)
    self.tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    self.num_records = 0
    self._writer = array_record_module.ArrayRecordWriter(self.tmp, OPTIONS)

  def write(self, record: bytes) -> None:
    self._writer.write(record)
    self.num_records += 1

  def commit(self) -> tuple[int, str, int, str]:
    """Closes and renames the shard; returns (num_records, sha256, size in bytes, crc32c)."""
    self._writer.close()
    (sha256, crc32c), size = digests(self.tmp), os.path.getsize(self.tmp)
    os.replace(self.tmp, self.path)
    return self.num_records, sha256, size, crc32c


def _write_json(path: str, data: Any) -> None:
  tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(data, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _read_json(path: str) -> Any:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _marker_path(out: str, name: str) -> str:
  return os.path.join(build_dir(out), name + ".done")


def _load_done(out: str, name: str, fp: str) -> ShardResult | None:
  """The shard's done marker if it belongs to this plan and the shard file is intact."""
  marker = _read_json(_marker_path(out, name))
  if not isinstance(marker, dict) or marker.get("fingerprint") != fp:
    return None
  result = ShardResult(**marker["result"])
  path = os.path.join(build_dir(out), name)
  intact = os.path.isfile(path) and os.path.getsize(path) == result.size
  return result if intact and result.crc32c is not None else None


def _mark_done(out: str, result: ShardResult, fp: str) -> None:
  _write_json(
    _marker_path(out, result.name), {"fingerprint": fp, "result": dataclasses.asdict(result)}
  )


@contextlib.contextmanager
def locked(out: str) -> Iterator[None]:
  """Holds an exclusive lock on OUT (a second conversion into it is refused in one line).

  The lock file is removed when done; a process that opened it just before checks, once it
  holds the lock, that the file is still the one in OUT, else it tries again.
  """
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConversionError(f"{out} exists and is not a folder")
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, LOCK_FILE)
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise ConversionError(
          f"{out} is being converted by another process (pid {holder}); "
          "wait for it to finish or stop it"
        ) from None
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        raise
      warnings.warn(
        f"{out}: this file system has no locks; make sure no other conversion "
        "writes into it at the same time",
        stacklevel=3,
      )
      yield
      return
    try:
      same = os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
      same = False
    if same:
      break
    os.close(fd)
  try:
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    yield
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)
    os.close(fd)


def _tasks(plan: ShardPlan) -> Iterator[tuple[Any, ...]]:
  """Splits a shard's items into worker tasks of bounded bytes, in order."""
  start, nbytes = 0, 0
  for i, size in enumerate(plan.sizes):
    nbytes += size
    if nbytes >= _TASK_BYTES or i + 1 - start >= _TASK_ITEMS:
      yield plan.items[start : i + 1]
      start, nbytes = i + 1, 0
  if start < len(plan.items):
    yield plan.items[start:]


def _context() -> multiprocessing.context.BaseContext:
  """Workers fork from a server that imported the converters once: fast to start, and safe
  in processes that run JAX (forking those directly can deadlock); light (`host.light`):
  JAX never loads in them, nor does the main script that called the converter."""
  ctx = light.context("forkserver")
  ctx.set_forkserver_preload(_WORKER_MODULES)
  return ctx


def ordered_map(process: Callable[[Any], Any], tasks: list, workers: int) -> Iterator[Any]:
  """Yields process(task) in task order, computed by `workers` processes (bounded queue)."""
  if workers <= 1:
    yield from map(process, tasks)
    return
  ctx = _context()
  # Ctrl-C reaches the whole process group: the server the workers fork from starts with
  # SIGINT ignored, as they do (ignored here too for the few ms that takes, and blocked, so
  # that one arriving then waits instead of being dropped), and this process answers it once
  # the pool is whole (a traceback from each half-started worker otherwise).
  main, interrupted = threading.current_thread() is threading.main_thread(), []
  if main:
    multiprocessing.resource_tracker.ensure_running()  # its start unblocks SIGINT: first
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
      multiprocessing.forkserver.ensure_running()
    finally:
      signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
      signal.pthread_sigmask(signal.SIG_SETMASK, mask)
  try:
    pool = ctx.Pool(workers)
  finally:
    if main:
      signal.signal(signal.SIGINT, old)
  with pool:
    if interrupted:
      raise KeyboardInterrupt
    pending = collections.deque()
    for task in tasks:
      pending.append(pool.apply_async(process, (task,)))
      if len(pending) >= 4 * workers:
        yield pending.popleft().get()
    while pending:
      yield pending.popleft().get()


@dataclasses.dataclass
class Job:
  """A planned conversion: shards to write, the worker function, and manifest contents."""

  out: str
  plans: list[ShardPlan]
  process: Callable[[tuple[Any, ...]], list[Outcome]]  # picklable: runs in workers
  fp: str
  classes: list[str]
  splits: list[str]
  keys: records.Keys
  created_by: dict[str, Any]
  skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)


def _provenance(m: manifest_lib.Manifest) -> list[dict[str, Any]]:
  """Who made which splits, oldest first: `created_by`, then its `added` entries; each
  entry's "splits" lists the splits it still provides."""
  top = {k: v for k, v in m.created_by.items() if k != "added"}
  added = [dict(e) for e in m.created_by.get("added", []) if isinstance(e, dict)]
  claimed = {s for e in added for s in e.get("splits", [])}
  top.setdefault("splits", [s for s in m.splits if s not in claimed])
  return [top] + added


def split_fingerprints(m: manifest_lib.Manifest) -> dict[str, str]:
  """The fingerprint of the conversion that made each split of `m`."""
  return {s: e.get("fingerprint") for e in _provenance(m) for s in e.get("splits", [])}


def _load_existing(out: str, overwrite: bool) -> manifest_lib.Manifest | None:
  try:
    return manifest_lib.load(out)
  except FileNotFoundError:
    return None
  except manifest_lib.ManifestError as e:
    if overwrite:
      return None
    raise ConversionError(
      f"{out} holds a damaged dataset ({e}); pass --overwrite to replace it"
    ) from None


def _intact(out: str, m: manifest_lib.Manifest, splits: Sequence[str]) -> bool:
  try:
    for s in splits:
      manifest_lib.checked_shards(out, m, s, verify="size")
  except (manifest_lib.ManifestError, OSError):
    return False
  return True


def _differences(ours: Sequence[str], theirs: Sequence[str]) -> str:
  only_ours = [c for c in ours if c not in set(theirs)]
  only_theirs = [c for c in theirs if c not in set(ours)]
  if not only_ours and not only_theirs:
    return "the same names in another order (label map?)"
  return f"only in this conversion: {only_ours[:10]}; only in the dataset: {only_theirs[:10]}"


def _check_can_join(job: Job, old: manifest_lib.Manifest, kept: list[str]) -> None:
  """Splits are added to a dataset only if labels and keys mean the same in all of them."""
  where = f"cannot add split(s) {job.splits} to {job.out} beside {kept}"
  if list(job.classes) != list(old.classes):
    raise ConversionError(f"{where}: the classes differ ({_differences(job.classes, old.classes)})")
  if job.keys != old.keys:
    raise ConversionError(f"{where}: the feature keys differ ({job.keys} vs {old.keys})")


def _remove_stale_files(out: str) -> None:
  """Temporary files of killed runs in OUT, and the resume state of earlier versions."""
  for entry in os.scandir(out):
    if _TEMPORARY.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
      os.unlink(entry.path)
  shutil.rmtree(os.path.join(out, _OLD_PROGRESS_DIR), ignore_errors=True)


def _prepare_build(job: Job) -> None:
  """A build folder for this job: another plan's (shards, markers, temporaries) is removed."""
  build = build_dir(job.out)
  plan = _read_json(os.path.join(build, _PLAN_FILE))
  if plan is None or plan.get("fingerprint") != job.fp:
    shutil.rmtree(build, ignore_errors=True)
    os.makedirs(build)
    _write_json(os.path.join(build, _PLAN_FILE), {"fingerprint": job.fp})
  names = {p.name for p in job.plans} | {p.name + ".done" for p in job.plans}
  for entry in os.scandir(build):
    if entry.name not in names and entry.name != _PLAN_FILE:
      if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path)
      else:
        os.unlink(entry.path)


def check_target(
  job: Job, overwrite: bool, exists: Callable[[str], bool]
) -> manifest_lib.Manifest | None:
  """Refuses a job that would clobber OUT (`exists(name)`: a file of that name is in OUT);
  returns OUT's manifest if this very job is already done there.

  Refuses a split without records, another dataset's splits (or files) unless `overwrite`,
  and splits whose classes or keys differ from the dataset's other splits.
  """
  out = job.out
  if empty := [s for s in job.splits if not any(p.split == s for p in job.plans)]:
    raise ConversionError(
      f"split {empty[0]!r} would hold no records (skipped "
      f"{len(job.skipped)}: {_reasons(job.skipped) or 'nothing'})"
    )
  old = _load_existing(out, overwrite)
  if old is not None:
    made = split_fingerprints(old)
    if all(made.get(s) == job.fp for s in job.splits) and _intact(out, old, job.splits):
      return old
    clash = [s for s in job.splits if s in old.splits and made.get(s) != job.fp]
    if clash and not overwrite:
      raise ConversionError(
        f"{out} already holds split(s) {clash} of another conversion; "
        "pass --overwrite to replace them, or convert into another folder"
      )
    if kept := [s for s in old.splits if s not in job.splits]:
      _check_can_join(job, old, kept)
  elif not overwrite:
    names = [p.name for p in job.plans] + [manifest_lib.FILENAME]
    if taken := [n for n in names if exists(n)]:
      raise ConversionError(
        f"{out} holds files this conversion would replace ({taken[0]}, "
        "not part of a dataset); pass --overwrite or choose another folder"
      )
  return None


class ShardWriter:
  """Collects one shard's outcomes in plan order in `directory`; once complete, commits it
  and hands (result, path) to `done`, which marks it done (or sends it away first)."""

  def __init__(
    self,
    plan: ShardPlan,
    directory: str,
    done: Callable[[ShardResult, str], ShardResult],
    cleanup: Callable[[], None] | None = None,
  ):
    self.plan, self.left = plan, len(plan.items)
    self.shard = AtomicShard(directory, plan.name)
    self.skipped: list[dict[str, str]] = []
    self.reencoded: list[dict[str, str]] = []
    self._done, self._cleanup = done, cleanup

  def add(self, task: tuple[Any, ...], outcomes: list[Outcome]) -> ShardResult | None:
    """Writes a task's outcomes; returns the result once the shard is complete and done."""
    for record, skip, note in outcomes:
      if record is not None:
        self.shard.write(record)
      if skip:
        self.skipped.append(skip)
      if note:
        self.reencoded.append(note)
    self.left -= len(task)
    if self.left:
      return None
    count, sha256, size, crc32c = self.shard.commit()
    result = ShardResult(self.plan.name, count, sha256, size, self.skipped, self.reencoded, crc32c)
    return self._done(result, self.shard.path)

  def close(self) -> None:
    """Runs `cleanup` (a local temporary folder removed), once."""
    cleanup, self._cleanup = self._cleanup, None
    if cleanup is not None:
      cleanup()

  def __enter__(self) -> ShardWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class Target:
  """Where a job's shards go and how OUT takes them: its lock, its build folder (kept shards
  of an interrupted run of the same job), the shards' writers and the swap into OUT.

  `LocalTarget` (a folder), `bucket.BucketTarget` (gs://) and `beam.BeamTarget` (shards
  written by Beam workers) implement it; `run` drives one, so every target writes the same
  bytes and manifest.
  """

  def locked(self, out: str) -> contextlib.AbstractContextManager[None]:
    """Holds OUT's lock for one conversion: a second one into OUT is refused in one line."""
    raise NotImplementedError

  def start(self, job: Job, overwrite: bool) -> manifest_lib.Manifest | None:
    """Readies OUT for `job` (holding the lock): OUT's manifest if this very job is done there,
    else None, the build folder holding no other job's work (`check_target` refuses)."""
    raise NotImplementedError

  def written(self, job: Job) -> dict[str, ShardResult]:
    """The shards of `job` already in the build folder (checked), by name."""
    raise NotImplementedError

  def open_shard(self, job: Job, plan: ShardPlan) -> ShardWriter:
    """A writer of one shard that ends in the build folder beside its done marker."""
    raise NotImplementedError

  def finish(self, job: Job, results: Sequence[ShardResult]) -> manifest_lib.Manifest:
    """Commits the manifest of the shards' `results` (in plan order) and swaps it into OUT."""
    raise NotImplementedError

  def write_shard(self, job: Job, plan: ShardPlan) -> ShardResult:
    """Writes one whole shard in this process (a worker's unit of work)."""
    with self.open_shard(job, plan) as shard:
      for task in _tasks(plan):
        result = shard.add(task, job.process(task))
    return result

  def write(
    self, job: Job, todo: list[ShardPlan], *, workers: int, progress: bool, desc: str
  ) -> dict[str, ShardResult]:
    """Writes the shards `todo` with `workers` processes; their results by name.

    With at least as many shards as workers, each worker writes whole shards (no record
    crosses a process boundary); otherwise workers check records and this process writes
    them in plan order. Either way a shard's bytes follow from the plan alone.
    """
    results = {}
    with Progress(sum(len(p.items) for p in todo), desc, "file", progress) as bar:
      if workers > 1 and len(todo) >= workers:
        write = functools.partial(self.write_shard, dataclasses.replace(job, plans=[]))
        for plan, result in zip(todo, ordered_map(write, todo, workers)):
          results[plan.name] = result
          bar.update(len(plan.items))
        return results
      tasks = [(p, t) for p in todo for t in _tasks(p)]
      outcomes = ordered_map(job.process, [t for _, t in tasks], min(workers, len(tasks)))
      shard = None
      try:
        for (plan, task), found in zip(tasks, outcomes):
          shard = shard or self.open_shard(job, plan)
          if result := shard.add(task, found):
            results[plan.name] = result
            shard.close()
            shard = None
          bar.update(len(task))
      finally:
        if shard is not None:
          shard.close()
    return results


def run(
  job: Job,
  target: Target,
  *,
  workers: int | None = None,
  progress: bool = True,
  desc: str = "convert",
  overwrite: bool = False,
) -> manifest_lib.Manifest:
  """Writes every shard of `job` not already done into `target`, then swaps the result into
  OUT. Finished shards of an interrupted run of the same job are kept."""
  check_workers(workers)
  with target.locked(job.out):
    if (m := target.start(job, overwrite)) is not None:
      return m
    results = target.written(job)
    todo = [p for p in job.plans if p.name not in results]
    workers = workers or os.cpu_count() or 1
    results.update(target.write(job, todo, workers=workers, progress=progress, desc=desc))
    if missing := [p.name for p in job.plans if p.name not in results]:
      raise RuntimeError(f"{job.out}: shards not written: {missing[:5]}...")
    return target.finish(job, [results[p.name] for p in job.plans])


class LocalTarget(Target):
  """OUT a folder on this machine: an flock, and shards built in `OUT/.convert-build/`."""

  def locked(self, out: str) -> contextlib.AbstractContextManager[None]:
    return locked(out)

  def start(self, job: Job, overwrite: bool) -> manifest_lib.Manifest | None:
    """Finishes a swap an interrupted run had committed, then checks OUT (`check_target`).
    Another plan's unfinished build is removed, and so is a shard file without its done
    marker (the disk filled up between them): its skipped files are unknown, and writing it
    again then needs no room for a second copy."""
    out = job.out
    if os.path.exists(os.path.join(build_dir(out), _SWAP_FILE)):
      swap_in(out)
    _remove_stale_files(out)
    done = check_target(job, overwrite, lambda name: os.path.lexists(os.path.join(out, name)))
    if done is not None:
      shutil.rmtree(build_dir(out), ignore_errors=True)  # another plan's unfinished work
      return done
    _prepare_build(job)
    for p in job.plans:
      if _load_done(out, p.name, job.fp) is None:
        with contextlib.suppress(FileNotFoundError):
          os.unlink(os.path.join(build_dir(out), p.name))
    return None

  def written(self, job: Job) -> dict[str, ShardResult]:
    found = {p.name: _load_done(job.out, p.name, job.fp) for p in job.plans}
    return {name: r for name, r in found.items() if r is not None}

  def open_shard(self, job: Job, plan: ShardPlan) -> ShardWriter:
    def done(result: ShardResult, path: str) -> ShardResult:
      _mark_done(job.out, result, job.fp)
      return result

    return ShardWriter(plan, build_dir(job.out), done)

  def finish(self, job: Job, results: Sequence[ShardResult]) -> manifest_lib.Manifest:
    """Zero records in a split is an error (and the build is removed)."""
    try:
      m, remove = manifest_of(job, results, _load_existing(job.out, overwrite=True))
    except ConversionError:
      shutil.rmtree(build_dir(job.out), ignore_errors=True)
      raise
    _write_json(
      os.path.join(build_dir(job.out), _SWAP_FILE), {"manifest": m.to_json(), "remove": remove}
    )
    swap_in(job.out)
    return m


def _reasons(skipped: list[dict[str, str]]) -> str:
  """Skipped files counted by kind (a reason up to its ':' or ' ('); a kind's detail in
  parentheses (a hint) is shown once, from its first file."""
  kinds = collections.defaultdict(list)
  for s in skipped:
    kinds[re.split(r":| \(", s["reason"], maxsplit=1)[0]].append(s["reason"])
  parts = []
  for kind, reasons in sorted(kinds.items()):
    hint = reasons[0][len(kind) :].strip()
    hint = f" (first: {hint[1:-1]})" if hint.startswith("(") and hint.endswith(")") else ""
    parts.append(f"{len(reasons)} {kind}{hint}")
  return ", ".join(parts)


def _merge(
  old: manifest_lib.Manifest, kept: list[str], new: manifest_lib.Manifest, entry: dict[str, Any]
) -> manifest_lib.Manifest:
  """`old`'s `kept` splits, plus `new`'s; provenance and skipped files follow their splits."""
  provenance = _provenance(old)
  survivors = []
  for e in provenance:
    if left := [s for s in e.get("splits", []) if s in kept]:
      survivors.append({**e, "splits": left})
  top_kept = any(s in kept for s in provenance[0]["splits"])

  def keep(s: dict[str, str]) -> bool:
    tag = s.get("split")
    return top_kept if tag is None else any(t in kept for t in tag.split(","))

  tag = ",".join(new.splits)
  return manifest_lib.Manifest(
    classes=old.classes,
    splits={**{s: old.splits[s] for s in kept}, **new.splits},
    skipped=[s for s in old.skipped if keep(s)] + [{**s, "split": tag} for s in new.skipped],
    keys=old.keys,
    created_by={**survivors[0], "added": survivors[1:] + [entry]},
  )


def manifest_of(
  job: Job, results: Sequence[ShardResult], old: manifest_lib.Manifest | None
) -> tuple[manifest_lib.Manifest, list[str]]:
  """The new manifest from the shards' results (merged with `old`'s other splits) and the old
  shard files it no longer names. Zero records in a split is a `ConversionError`."""
  by_split = {s: manifest_lib.Split(0, []) for s in job.splits}
  for plan, r in zip(job.plans, results):
    by_split[plan.split].shards.append(
      manifest_lib.Shard(r.name, r.num_records, r.sha256, r.size, r.crc32c)
    )
    by_split[plan.split].num_records += r.num_records
  skipped = sorted(
    list(job.skipped) + [s for r in results for s in r.skipped],
    key=lambda s: (s["path"], s["reason"]),
  )
  if empty := [s for s, split in by_split.items() if split.num_records == 0]:
    raise ConversionError(
      f"split {empty[0]!r} would hold no records (skipped "
      f"{len(skipped)}: {_reasons(skipped) or 'nothing'})"
    )
  reencoded = sorted((n for r in results for n in r.reencoded), key=lambda s: s["path"])
  entry = {
    **job.created_by,
    "splits": list(job.splits),
    "fingerprint": job.fp,
    "reencoded": reencoded,
  }
  m = manifest_lib.Manifest(
    classes=list(job.classes), splits=by_split, skipped=skipped, keys=job.keys, created_by=entry
  )
  if old is not None and (kept := [s for s in old.splits if s not in job.splits]):
    m = _merge(old, kept, m, entry)
  files = {sh.file for s in m.splits.values() for sh in s.shards}
  remove = (
    [] if old is None else sorted({sh.file for s in old.splits.values() for sh in s.shards} - files)
  )
  return m, remove


def swap_in(out: str) -> None:
  """Moves a committed build into OUT; repeating it after a crash at any point is safe."""
  build = build_dir(out)
  swap = _read_json(os.path.join(build, _SWAP_FILE))
  if swap is None:  # unreadable: the build cannot be trusted
    shutil.rmtree(build)
    return
  m = manifest_lib.from_json(swap["manifest"], os.path.join(build, _SWAP_FILE))
  files = [sh.file for s in m.splits.values() for sh in s.shards]
  moving = [f for f in files if os.path.exists(os.path.join(build, f))]
  if any(os.path.lexists(os.path.join(out, f)) for f in moving):
    # The old manifest may name these files: readers must not see it beside new shards.
    with contextlib.suppress(FileNotFoundError):
      os.unlink(os.path.join(out, manifest_lib.FILENAME))
  for f in moving:
    os.replace(os.path.join(build, f), os.path.join(out, f))
  manifest_lib.save(m, out)
  for f in swap["remove"]:
    if f not in files:
      with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(out, f))
  shutil.rmtree(build)


def summary(m: manifest_lib.Manifest) -> str:
  """One line: records per split, shards, skipped files by reason, re-encoded images."""
  parts = [
    f"{name}: {s.num_records} records in {len(s.shards)} shard{'s' * (len(s.shards) != 1)}"
    for name, s in m.splits.items()
  ]
  reasons = _reasons(m.skipped)
  line = f"{'; '.join(parts)}; {len(m.classes)} classes; skipped {len(m.skipped)}"
  line += f" ({reasons})" if reasons else ""
  reencoded = sum(len(e.get("reencoded", [])) for e in _provenance(m))
  return line + (f"; re-encoded {reencoded}" if reencoded else "")


# Progress of long conversions: a bar on a terminal; when stderr is not a terminal (a log
# file, a pipe), one plain line per tenth of the work instead of carriage returns.
_STEPS = 10


class Progress:
  """Counts work done out of `total`; shows it on stderr unless `enabled` is False."""

  def __init__(self, total: int, desc: str, unit: str, enabled: bool = True):
    self.total, self.desc, self.unit, self.done = total, desc, unit, 0
    on_tty = enabled and sys.stderr.isatty()
    self._bar = tqdm.tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=not on_tty)
    self._lines = enabled and not on_tty and total > 0
    self._step = 0

  def update(self, n: int) -> None:
    self.done += n
    self._bar.update(n)
    step = self.done * _STEPS // self.total if self.total else _STEPS
    if self._lines and step > self._step:
      self._step = step
      print(
        f"{self.desc}: {100 * self.done // self.total}% ({self.done}/{self.total} {self.unit}s)",
        file=sys.stderr,
        flush=True,
      )

  def close(self) -> None:
    self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
