"""Shard plans and writing: TFDS-style names, byte-sized shards, atomic and resumable writes.

Records go to shards by a plan fixed before any work starts (the ordered inputs and their
sizes), so the output is byte-identical whatever the worker count or completion order.
A shard is written under a temporary name and renamed when complete; a done marker
(count, sha256, skipped files) then lets a re-run after a crash keep it and skip its work.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tqdm
from array_record.python import array_record_module

from pipeline import manifest as manifest_lib
from pipeline import records

OPTIONS = "group_size:1,uncompressed"  # random access; JPEG payloads are not compressed again
DEFAULT_SHARD_SIZE_MB = 128
PROGRESS_DIR = ".convert-progress"
_TASK_BYTES = 4 << 20  # work sent to a worker at a time
_TASK_ITEMS = 256
_WORKER_MODULES = ["pipeline.convert.builtin", "pipeline.convert.images",
                   "pipeline.convert.tfrecord", "pipeline.convert.verify"]

# What a worker returns per input: (serialized record or None, skipped entry or None,
# re-encoded entry or None); entries are {"path": ..., "reason": ...}.
Outcome = tuple[bytes | None, dict[str, str] | None, dict[str, str] | None]


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


def shard_name(split: str, index: int, count: int) -> str:
  return f"{split}.array_record-{index:05d}-of-{count:05d}"


def plan_split(split: str, items: Sequence[Any], sizes: Sequence[int],
               shard_bytes: int) -> list[ShardPlan]:
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
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 22):
      h.update(block)
  return h.hexdigest()


def fingerprint(*parts: Any) -> str:
  """A digest of everything that determines the output (plan, options, version)."""
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class AtomicShard:
  """An ArrayRecord shard written under a temporary name and renamed by `commit`."""

  def __init__(self, out: str, name: str):
    self.path = os.path.join(out, name)
    self.tmp = os.path.join(out, f".{name}.tmp-{os.getpid()}")
    self.num_records = 0
    self._writer = array_record_module.ArrayRecordWriter(self.tmp, OPTIONS)

  def write(self, record: bytes) -> None:
    self._writer.write(record)
    self.num_records += 1

  def commit(self) -> tuple[int, str, int]:
    """Closes and renames the shard; returns (num_records, sha256, size in bytes)."""
    self._writer.close()
    digest, size = sha256_file(self.tmp), os.path.getsize(self.tmp)
    os.replace(self.tmp, self.path)
    return self.num_records, digest, size


def _marker_path(out: str, name: str) -> str:
  return os.path.join(out, PROGRESS_DIR, name + ".json")


def _load_done(out: str, name: str, fp: str) -> ShardResult | None:
  """The shard's done marker if it belongs to this plan and the shard file is intact."""
  try:
    with open(_marker_path(out, name)) as f:
      marker = json.load(f)
  except (OSError, ValueError):
    return None
  result = ShardResult(**marker["result"])
  path = os.path.join(out, name)
  if marker.get("fingerprint") != fp or not os.path.exists(path):
    return None
  return result if os.path.getsize(path) == result.size else None


def _mark_done(out: str, result: ShardResult, fp: str) -> None:
  path = _marker_path(out, result.name)
  tmp = path + f".tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump({"fingerprint": fp, "result": dataclasses.asdict(result)}, f)
  os.replace(tmp, path)


def _remove_stale_temporaries(out: str, names: set[str]) -> None:
  for entry in os.scandir(out):
    if entry.name.startswith(".") and entry.name[1:].split(".tmp-")[0] in names:
      os.unlink(entry.path)


def _tasks(plan: ShardPlan) -> Iterator[tuple[Any, ...]]:
  """Splits a shard's items into worker tasks of bounded bytes, in order."""
  start, nbytes = 0, 0
  for i, size in enumerate(plan.sizes):
    nbytes += size
    if nbytes >= _TASK_BYTES or i + 1 - start >= _TASK_ITEMS:
      yield plan.items[start:i + 1]
      start, nbytes = i + 1, 0
  if start < len(plan.items):
    yield plan.items[start:]


def _context() -> multiprocessing.context.BaseContext:
  """Workers fork from a server that imported the converters once: fast to start, and safe
  in processes that run JAX (forking those directly can deadlock)."""
  ctx = multiprocessing.get_context("forkserver")
  ctx.set_forkserver_preload(_WORKER_MODULES)
  return ctx


def ordered_map(process: Callable[[Any], Any], tasks: list, workers: int) -> Iterator[Any]:
  """Yields process(task) in task order, computed by `workers` processes (bounded queue)."""
  if workers <= 1:
    yield from map(process, tasks)
    return
  ctx = _context()
  with ctx.Pool(workers) as pool:
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


def completed(job: Job) -> manifest_lib.Manifest | None:
  """The manifest in `job.out` if this very job made it and its shards are all there."""
  try:
    m = manifest_lib.load(job.out)
  except (FileNotFoundError, ValueError, KeyError, TypeError):
    return None
  if m.created_by.get("fingerprint") != job.fp:
    return None
  files = [s.file for split in m.splits.values() for s in split.shards]
  return m if all(os.path.exists(os.path.join(job.out, f)) for f in files) else None


def pending(job: Job) -> list[ShardPlan]:
  """Prepares `job.out` and returns the shards an earlier, interrupted run did not finish."""
  os.makedirs(os.path.join(job.out, PROGRESS_DIR), exist_ok=True)
  _remove_stale_temporaries(job.out, {p.name for p in job.plans})
  return [p for p in job.plans if _load_done(job.out, p.name, job.fp) is None]


class _ShardBuilder:
  """Collects one shard's outcomes in plan order and commits it with its done marker."""

  def __init__(self, job: Job, plan: ShardPlan):
    self.job, self.plan, self.left = job, plan, len(plan.items)
    self.shard = AtomicShard(job.out, plan.name)
    self.skipped: list[dict[str, str]] = []
    self.reencoded: list[dict[str, str]] = []

  def add(self, task: tuple[Any, ...], outcomes: list[Outcome]) -> bool:
    """Writes a task's outcomes; returns True once the shard is complete and committed."""
    for record, skip, note in outcomes:
      if record is not None:
        self.shard.write(record)
      if skip:
        self.skipped.append(skip)
      if note:
        self.reencoded.append(note)
    self.left -= len(task)
    if self.left:
      return False
    result = ShardResult(self.plan.name, *self.shard.commit(), self.skipped, self.reencoded)
    _mark_done(self.job.out, result, self.job.fp)
    return True


def write_shard(job: Job, plan: ShardPlan) -> str:
  """Writes one whole shard in this process (the unit of work of the Beam pipeline)."""
  builder = _ShardBuilder(job, plan)
  for task in _tasks(plan):
    builder.add(task, job.process(task))
  return plan.name


def run(job: Job, *, workers: int | None, progress: bool, desc: str) -> manifest_lib.Manifest:
  """Writes every shard not already done, then the manifest.

  With at least as many shards to write as workers, each worker writes whole shards (no
  record crosses a process boundary); otherwise workers check records and this process
  writes them in plan order. Either way a shard's bytes follow from the plan alone.
  Finished shards of an interrupted run are kept.
  """
  if (m := completed(job)) is not None:
    return m
  todo = pending(job)
  workers = workers or os.cpu_count() or 1
  with tqdm.tqdm(total=sum(len(p.items) for p in todo), desc=desc, unit="file",
                 disable=not progress, dynamic_ncols=True) as bar:
    if workers > 1 and len(todo) >= workers:
      write = functools.partial(write_shard, dataclasses.replace(job, plans=[]))
      for plan, _ in zip(todo, ordered_map(write, todo, workers)):
        bar.update(len(plan.items))
    else:
      tasks = [(p, t) for p in todo for t in _tasks(p)]
      outcomes = ordered_map(job.process, [t for _, t in tasks], min(workers, len(tasks)))
      builder = None
      for (plan, task), results in zip(tasks, outcomes):
        builder = builder or _ShardBuilder(job, plan)
        if builder.add(task, results):
          builder = None
        bar.update(len(task))
  return finish(job)


def finish(job: Job) -> manifest_lib.Manifest:
  """Writes manifest.json from the done markers; removes stale shards and the progress folder."""
  results = [_load_done(job.out, p.name, job.fp) for p in job.plans]
  if missing := [p.name for p, r in zip(job.plans, results) if r is None]:
    raise RuntimeError(f"{job.out}: shards not written: {missing[:5]}...")
  by_split = {s: manifest_lib.Split(0, []) for s in job.splits}
  for plan, r in zip(job.plans, results):
    by_split[plan.split].shards.append(manifest_lib.Shard(r.name, r.num_records, r.sha256))
    by_split[plan.split].num_records += r.num_records
  skipped = list(job.skipped) + [s for r in results for s in r.skipped]
  reencoded = [n for r in results for n in r.reencoded]
  m = manifest_lib.Manifest(
      classes=list(job.classes), splits=by_split,
      skipped=sorted(skipped, key=lambda s: (s["path"], s["reason"])), keys=job.keys,
      created_by={**job.created_by, "fingerprint": job.fp,
                  "reencoded": sorted(reencoded, key=lambda s: s["path"])})
  try:
    old = manifest_lib.load(job.out)
  except (FileNotFoundError, ValueError, KeyError, TypeError):
    old = None
  if old is not None:
    # manifest_lib.save's rename does not overwrite. Until the new manifest exists the done
    # markers are kept, so a crash here is repaired by a re-run.
    os.unlink(os.path.join(job.out, manifest_lib.FILENAME))
  manifest_lib.save(m, job.out)
  if old is not None:
    keep = {r.name for r in results}
    for split in old.splits.values():
      for s in split.shards:
        if s.file not in keep and os.path.exists(os.path.join(job.out, s.file)):
          os.unlink(os.path.join(job.out, s.file))
  progress_dir = os.path.join(job.out, PROGRESS_DIR)
  for name in os.listdir(progress_dir):
    os.unlink(os.path.join(progress_dir, name))
  os.rmdir(progress_dir)
  return m


def summary(m: manifest_lib.Manifest) -> str:
  """One line: records per split, shards, skipped files by reason, re-encoded images."""
  parts = [f"{name}: {s.num_records} records in {len(s.shards)} shards"
           for name, s in m.splits.items()]
  reasons = collections.Counter(s["reason"].split(":")[0] for s in m.skipped)
  skipped = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
  line = f"{'; '.join(parts)}; {len(m.classes)} classes; skipped {len(m.skipped)}"
  line += f" ({skipped})" if skipped else ""
  reencoded = m.created_by.get("reencoded", [])
  return line + (f"; re-encoded {len(reencoded)}" if reencoded else "")
