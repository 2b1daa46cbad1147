"""Image-folder and TFRecord conversion as an Apache Beam pipeline (optional extra `beam`).

The driver plans the job exactly as the local converter does (same file order, split and
byte-sized shard plan); each shard is one Beam element, written whole by one worker through
the same writer, so the shards are byte-identical to `python -m pipeline.convert images`
whatever the runner and worker count. Workers read the sources and write the shards through
Beam's FileSystems (`gs://` on Dataflow, local paths elsewhere; no gcsfuse): a shard is
written to a local temporary folder (one shard per worker at a time), copied to OUT's build
folder when complete, and a done marker beside it (records, size, sha256, crc32c, skipped
and re-encoded files) lets a retried or re-run shard be kept. The driver holds OUT's lock
(a lock object in a bucket), reports progress from the done markers (shards done / total,
files/s: it works on any runner, Dask's has no metrics) and writes the manifest last, as
the local converter does; a reader sees the old dataset, none, or the new one.

    python -m pipeline.convert images SRC OUT --runner DirectRunner --direct_num_workers 4
    python -m pipeline.convert images SRC OUT --runner DaskRunner --dask_client_address HOST:8786

`DaskRunner` (extra `beam`: apache-beam[dask]) runs on a dask.distributed cluster, one task
per shard; without `--dask_client_address` it starts a local cluster of this machine's
cores. Other runners take their usual Beam flags after the command; the workers need this
package (`--setup_file ./setup.py` or a container image) and, for `gs://`, apache-beam[gcp].
The driver plans a `gs://` SRC and commits a `gs://` OUT through gcsfs (extra `gcs`).
docs/DATA.md shows the Dataflow command; Dataflow itself has not been run by the tests.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, BinaryIO

from pipeline.catalog import manifest as manifest_lib
from pipeline.convert import bucket, images, shards, tfrecord

DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
_RUNNERS = {"DaskRunner": DASK_RUNNER}  # runners Beam knows only by their full name
_POLL_S = 2.0  # how often the driver lists the done markers
_READERS = 16  # concurrent reads of a task's files in a bucket


def _filesystems():
  from apache_beam.io.filesystems import FileSystems

  return FileSystems


def open_file(path: str) -> BinaryIO:
  """A source file opened through Beam's FileSystems, bytes as stored (no decompression)."""
  from apache_beam.io.filesystem import CompressionTypes

  return _filesystems().open(path, compression_type=CompressionTypes.UNCOMPRESSED)


def _read(path: str) -> bytes | OSError:
  try:
    with open_file(path) as f:
      return f.read()
  except OSError as e:  # Beam's BeamIOError is one too
    return e
  except Exception as e:  # a missing object in a bucket: google.api_core NotFound, no OSError
    if getattr(e, "code", None) == 404:
      return FileNotFoundError(errno.ENOENT, "No such object", path)
    raise


def read_many(paths: list[str]) -> list[bytes | OSError]:
  """The bytes of source files through Beam's FileSystems (a bucket's concurrently), or the
  OSError of each file that cannot be read."""
  if not paths or _local(paths[0]):
    return [_read(p) for p in paths]
  with concurrent.futures.ThreadPoolExecutor(min(_READERS, len(paths))) as pool:
    return list(pool.map(_read, paths))


def _local(path: str) -> bool:
  return _filesystems().get_scheme(path) in (None, "file")


def _put(target: str, write) -> None:
  """Writes `target` through FileSystems: an object appears whole when closed; a local file
  is written under a temporary name and renamed, so a retried attempt never sees half."""
  fs = _filesystems()
  tmp = target
  if _local(target):
    head, name = os.path.split(target)
    tmp = os.path.join(head, f".{name}.tmp-{os.getpid()}-{threading.get_ident()}")
  with fs.create(tmp) as f:
    write(f)
  if tmp != target:
    os.replace(tmp, target)


class _Copier(shards._ShardBuilder):
  """A shard written in a local folder and copied into OUT's build folder when complete."""

  def done(self, result: shards.ShardResult) -> shards.ShardResult:
    target = _filesystems().join(self.job.out, shards.BUILD_DIR, result.name)
    with open(self.shard.path, "rb") as src:
      _put(target, lambda f: shutil.copyfileobj(src, f, 8 << 20))
    os.unlink(self.shard.path)
    marker = {"fingerprint": self.job.fp, "result": dataclasses.asdict(result)}
    _put(target + ".done", lambda f: f.write(json.dumps(marker).encode()))
    return result


def write_shard(plan: shards.ShardPlan, job: shards.Job) -> str:
  """Writes one whole shard in this worker and copies it to OUT (Beam's unit of work)."""
  bucket._remove_stale_stages()
  stage = tempfile.mkdtemp(prefix=f"{bucket._STAGE}{os.getpid()}-")
  try:
    builder = _Copier(job, plan, stage)
    for task in shards._tasks(plan):
      builder.add(task, job.process(task))
  finally:
    shutil.rmtree(stage, ignore_errors=True)
  return plan.name


class _Progress:
  """Counts the done markers in OUT's build folder while the pipeline runs: a line on
  stderr per tenth of the shards (shards done / total, files, files/s), and at the end."""

  def __init__(self, job: shards.Job, todo: list[shards.ShardPlan], desc: str, enabled: bool):
    self.job, self.desc, self.enabled = job, desc, enabled
    self.files = {p.name: len(p.items) for p in todo}
    self.total_files = sum(self.files.values())
    self.start, self.said, self.shown = time.monotonic(), 0, 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._poll, daemon=True)

  def _done(self) -> list[str]:
    pattern = _filesystems().join(self.job.out, shards.BUILD_DIR, "*.done")
    try:
      found = _filesystems().match([pattern])[0].metadata_list
    except OSError:  # nothing there yet, or a listing that failed: the next poll tells
      return []
    names = (m.path.rsplit("/", 1)[-1].removesuffix(".done") for m in found)
    return [n for n in names if n in self.files]

  def report(self, final: bool = False) -> None:
    """A line if another tenth of the shards is done (`final`: if any shard is done since
    the last line)."""
    if not self.enabled:
      return
    done = self._done()
    step = len(done) * 10 // max(1, len(self.files))
    if step <= self.said and not (final and len(done) != self.shown):
      return
    self.said, self.shown = step, len(done)
    files = sum(self.files[n] for n in done)
    rate = files / max(1e-9, time.monotonic() - self.start)
    print(
      f"{self.desc}: {len(done)}/{len(self.files)} shards, {files}/{self.total_files} files, "
      f"{rate:.0f} files/s",
      file=sys.stderr,
      flush=True,
    )

  def _poll(self) -> None:
    while not self._stop.wait(_POLL_S):
      self.report()

  def __enter__(self) -> _Progress:
    if self.enabled:
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()


def require(runner: str) -> None:
  """Raises `ModuleNotFoundError` (naming the module) when Apache Beam, or Dask for the
  DaskRunner, is not installed: checked before anything is planned or written."""
  modules = (["distributed", "dask"] if runner.endswith("DaskRunner") else []) + ["apache_beam"]
  for name in modules:
    if importlib.util.find_spec(name) is None:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _write(
  job: shards.Job,
  todo: list[shards.ShardPlan],
  runner: str,
  pipeline_args: Sequence[str],
  progress: bool,
  desc: str,
) -> None:
  """Runs the pipeline that writes the shards `todo` (one element each)."""
  import apache_beam as beam
  from apache_beam.options.pipeline_options import PipelineOptions

  runner = _RUNNERS.get(runner, runner)
  args = list(pipeline_args)
  dask = runner == DASK_RUNNER
  if dask and not any(a.startswith(("--dask_npartitions", "--dask_partition_size")) for a in args):
    args.append("--dask_partition_size=1")  # one task per shard (Dask's default: 128)
  worker_job = dataclasses.replace(job, plans=[], skipped=[])  # each element carries its plan
  p = beam.Pipeline(options=PipelineOptions(args, runner=runner))
  _ = (
    p
    | "Plan" >> beam.Create(todo)
    | "Spread" >> beam.Reshuffle()
    | "WriteShard" >> beam.Map(write_shard, worker_job)
  )
  with _Progress(job, todo, f"{desc} ({runner.rsplit('.', 1)[-1]})", progress) as bar:
    result = p.run()
    try:
      result.wait_until_finish()
    finally:
      if dask:  # the runner's own client: closed, or it outlives the cluster it joined
        result.client.close()
    bar.report(final=True)


def run(
  job: shards.Job,
  *,
  runner: str = "DirectRunner",
  pipeline_args: Sequence[str] = (),
  overwrite: bool = False,
  progress: bool = True,
  desc: str = "convert",
) -> manifest_lib.Manifest:
  """Writes a planned job's unfinished shards with Beam, then commits the manifest in OUT."""
  if bucket.is_url(job.out):
    bucket.check(job.out)
    with bucket.locked(job.out):
      m, results = bucket.start(job, overwrite)
      if m is not None:
        return m
      todo = [p for p in job.plans if p.name not in results]
      _write(job, todo, runner, pipeline_args, progress, desc)
      results = bucket._resume(job)  # the markers, checked against the objects' listing
      if missing := [p.name for p in job.plans if p.name not in results]:
        raise RuntimeError(f"{job.out}: shards not written: {missing[:5]}...")
      return bucket.finish(job, [results[p.name] for p in job.plans])
  with shards.locked(job.out):
    if (m := shards.start(job, overwrite)) is not None:
      return m
    _write(job, shards.pending(job), runner, pipeline_args, progress, desc)
    return shards.finish(job)


def convert_images(
  src: str | os.PathLike,
  out: str | os.PathLike,
  *,
  runner: str = "DirectRunner",
  pipeline_args: Sequence[str] = (),
  overwrite: bool = False,
  progress: bool = True,
  **kwargs: Any,
) -> manifest_lib.Manifest:
  """`images.convert` on Beam; `kwargs` are `images.plan`'s (split, val_fraction, ...)."""
  require(runner)
  job = images.plan(src, out, **kwargs)
  job = dataclasses.replace(job, process=functools.partial(job.process, read_many=read_many))
  name = os.path.basename(os.path.normpath(os.fspath(src)))
  return run(
    job,
    runner=runner,
    pipeline_args=pipeline_args,
    overwrite=overwrite,
    progress=progress,
    desc=f"convert {name}",
  )


def convert_tfrecord(
  pattern: str | Sequence[str],
  out: str | os.PathLike,
  *,
  runner: str = "DirectRunner",
  pipeline_args: Sequence[str] = (),
  overwrite: bool = False,
  progress: bool = True,
  **kwargs: Any,
) -> manifest_lib.Manifest:
  """`tfrecord.convert` on Beam; `kwargs` are `tfrecord.plan`'s (split, num_classes, ...)."""
  require(runner)
  job = tfrecord.plan(pattern, out, **kwargs)
  job = dataclasses.replace(job, process=functools.partial(job.process, open_file=open_file))
  return run(
    job,
    runner=runner,
    pipeline_args=pipeline_args,
    overwrite=overwrite,
    progress=progress,
    desc="convert tfrecord",
  )
