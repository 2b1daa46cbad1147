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
import contextlib
import dataclasses
import errno
import functools
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from typing import BinaryIO

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


def _write_element(plan: shards.ShardPlan, target: shards.Target, job: shards.Job) -> str:
  """Beam's unit of work: one whole shard, written by one worker."""
  return target.write_shard(job, plan).name


class BeamTarget(shards.Target):
  """Shards written by Beam workers, one element each, through Beam's FileSystems into the
  build folder of `inner`: OUT's own target (a folder's or a bucket's), which holds the lock,
  starts and commits as it does without Beam."""

  def __init__(self, inner: shards.Target, runner: str, pipeline_args: Sequence[str] = ()):
    self.inner, self.runner = inner, _RUNNERS.get(runner, runner)
    self.pipeline_args = list(pipeline_args)

  def locked(self, out: str) -> contextlib.AbstractContextManager[None]:
    return self.inner.locked(out)

  def start(self, job: shards.Job, overwrite: bool) -> manifest_lib.Manifest | None:
    return self.inner.start(job, overwrite)

  def written(self, job: shards.Job) -> dict[str, shards.ShardResult]:
    return self.inner.written(job)

  def finish(self, job: shards.Job, results: Sequence[shards.ShardResult]) -> manifest_lib.Manifest:
    return self.inner.finish(job, results)

  def open_shard(self, job: shards.Job, plan: shards.ShardPlan) -> shards.ShardWriter:
    """A shard written in a local folder and copied into OUT's build folder when complete."""

    def done(result: shards.ShardResult, path: str) -> shards.ShardResult:
      target = _filesystems().join(job.out, shards.BUILD_DIR, result.name)
      with open(path, "rb") as src:
        _put(target, lambda f: shutil.copyfileobj(src, f, 8 << 20))
      os.unlink(path)
      marker = {"fingerprint": job.fp, "result": dataclasses.asdict(result)}
      _put(target + ".done", lambda f: f.write(json.dumps(marker).encode()))
      return result

    return bucket.local_shard(plan, done)

  def write(
    self, job: shards.Job, todo: list[shards.ShardPlan], *, workers: int, progress: bool, desc: str
  ) -> dict[str, shards.ShardResult]:
    """Runs the pipeline that writes the shards `todo` (the runner places them, whatever
    `workers` is); the shards written, from their done markers."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    args, dask = list(self.pipeline_args), self.runner == DASK_RUNNER
    partitions = ("--dask_npartitions", "--dask_partition_size")
    if dask and not any(a.startswith(partitions) for a in args):
      args.append("--dask_partition_size=1")  # one task per shard (Dask's default: 128)
    worker_job = dataclasses.replace(job, plans=[], skipped=[])  # each element carries its plan
    p = beam.Pipeline(options=PipelineOptions(args, runner=self.runner))
    _ = (
      p
      | "Plan" >> beam.Create(todo)
      | "Spread" >> beam.Reshuffle()
      | "WriteShard" >> beam.Map(_write_element, self, worker_job)
    )
    with _Progress(job, todo, f"{desc} ({self.runner.rsplit('.', 1)[-1]})", progress) as bar:
      result = p.run()
      try:
        result.wait_until_finish()
      finally:
        if dask:  # the runner's own client: closed, or it outlives the cluster it joined
          result.client.close()
      bar.report(final=True)
    return self.inner.written(job)  # the markers, checked as a re-run checks them


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
  target = BeamTarget(bucket.target(job.out), runner, pipeline_args)
  return shards.run(job, target, progress=progress, desc=desc, overwrite=overwrite)


def convert_images(
  request: images.Request,
  *,
  runner: str = "DirectRunner",
  pipeline_args: Sequence[str] = (),
  progress: bool = True,
) -> manifest_lib.Manifest:
  """`images.convert` on Beam: the same plan, its files read through Beam's FileSystems."""
  require(runner)
  job = images.plan(request)
  job = dataclasses.replace(job, process=functools.partial(job.process, read_many=read_many))
  name = os.path.basename(os.path.normpath(os.fspath(request.src)))
  return run(
    job,
    runner=runner,
    pipeline_args=pipeline_args,
    overwrite=request.overwrite,
    progress=progress,
    desc=f"convert {name}",
  )


def convert_tfrecord(
  request: tfrecord.Request,
  *,
  runner: str = "DirectRunner",
  pipeline_args: Sequence[str] = (),
  progress: bool = True,
) -> manifest_lib.Manifest:
  """`tfrecord.convert` on Beam: the same plan, its files read through Beam's FileSystems."""
  require(runner)
  job = tfrecord.plan(request)
  job = dataclasses.replace(job, process=functools.partial(job.process, open_file=open_file))
  return run(
    job,
    runner=runner,
    pipeline_args=pipeline_args,
    overwrite=request.overwrite,
    progress=progress,
    desc="convert tfrecord",
  )
