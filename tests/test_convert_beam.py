"""The Apache Beam conversion writes the very same shards as the local converter: on the
in-process DirectRunner, and on Beam's DaskRunner with a dask.distributed cluster of two worker
processes that the tests start, one of which is killed in the middle of a shard.

`make test` runs this file in `.venv-beam` (apache-beam[dask] caps pillow, protobuf and
pyarrow below the versions of the main environment, where it is skipped).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import signal

import numpy as np
import psutil
import pytest
from PIL import Image

from pipeline.convert import beam as convert_beam  # imports apache_beam only when it runs
from pipeline.convert import images, shards, tfrecord
from tests.test_convert_images import messy  # noqa: F401 - a fixture

pytest.importorskip("apache_beam", reason="optional extra: pip install '.[beam]'")


def same_files(a, b) -> None:
  names = sorted(p.name for p in a.iterdir())
  assert names == sorted(p.name for p in b.iterdir())
  for name in names:
    assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def dask_cluster():
  """A dask.distributed cluster of two worker processes (one thread each) on this machine."""
  distributed = pytest.importorskip("distributed", reason="optional extra: apache-beam[dask]")
  with distributed.LocalCluster(
    n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
  ) as cluster:
    yield cluster


def dask_runner(cluster) -> dict:
  return {
    "runner": "DaskRunner",
    "pipeline_args": ["--dask_client_address", cluster.scheduler_address],
  }


def test_beam_image_conversion_matches_the_local_one(photos_raw, tmp_path):
  local = images.convert(
    photos_raw, tmp_path / "local", val_fraction=0.25, shard_size_mb=1, workers=1, progress=False
  )
  on_beam = convert_beam.convert_images(
    photos_raw, tmp_path / "beam", runner="DirectRunner", val_fraction=0.25, shard_size_mb=1
  )
  assert on_beam == local and len(local.splits["train"].shards) > 1
  same_files(tmp_path / "local", tmp_path / "beam")


def test_beam_tfrecord_conversion_matches_the_local_one(photos_dir, tmp_path):
  from tests.test_convert_images import read_shard
  from tests.test_convert_tfrecord import write_tfrecord

  payloads = [r for p in sorted(photos_dir.glob("train.*")) for r in read_shard(p)]
  write_tfrecord(tmp_path / "in.tfrecord", payloads)
  local = tfrecord.convert(
    str(tmp_path / "in.tfrecord"),
    tmp_path / "local",
    num_classes=4,
    shard_size_mb=1,
    workers=1,
    progress=False,
  )
  on_beam = convert_beam.convert_tfrecord(
    str(tmp_path / "in.tfrecord"), tmp_path / "beam", num_classes=4, shard_size_mb=1
  )
  assert on_beam == local
  same_files(tmp_path / "local", tmp_path / "beam")


def test_two_dask_workers_write_the_local_converters_bytes_and_report_progress(
  dask_cluster, photos_raw, tmp_path, capsys
):
  kwargs = dict(val_fraction=0.25, shard_size_mb=0.5)
  local = images.convert(photos_raw, tmp_path / "local", workers=1, progress=False, **kwargs)
  on_dask = convert_beam.convert_images(
    photos_raw, tmp_path / "dask", **dask_runner(dask_cluster), **kwargs
  )
  shards_written = sum(len(s.shards) for s in local.splits.values())
  assert on_dask == local and shards_written >= 4
  same_files(tmp_path / "local", tmp_path / "dask")
  progress = capsys.readouterr().err
  assert (
    f"convert raw (DaskRunner): {shards_written}/{shards_written} shards, 64/64 files" in progress
  )


def test_skipped_and_reencoded_files_reach_the_manifest_from_the_workers(
  dask_cluster,
  messy,  # noqa: F811 - the fixture imported above
  tmp_path,
):
  local = images.convert(messy, tmp_path / "local", workers=1, progress=False)
  on_dask = convert_beam.convert_images(
    messy, tmp_path / "dask", progress=False, **dask_runner(dask_cluster)
  )
  assert on_dask == local
  assert len(on_dask.skipped) == 10 and len(on_dask.created_by["reencoded"]) == 3
  same_files(tmp_path / "local", tmp_path / "dask")


def killed_once(task, *, process, kill_at, flag):
  """`process`, but the worker handed the item `kill_at` first is killed (SIGKILL), once."""
  if task[0] == kill_at:
    try:
      fd = os.open(flag, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
      pass
    else:
      os.write(fd, str(os.getpid()).encode())
      os.close(fd)
      os.kill(os.getpid(), signal.SIGKILL)
  return process(task)


def tiny_jpegs(root, count: int) -> None:
  rng = np.random.default_rng(0)
  for i in range(count):
    folder = root / f"class{i % 3}"
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(buf, "JPEG")
    (folder / f"{i:04d}.jpg").write_bytes(buf.getvalue())


def test_a_worker_killed_in_the_middle_of_a_shard_is_retried_with_the_same_bytes(
  dask_cluster, tmp_path
):
  tiny_jpegs(tmp_path / "src", 600)
  total = sum(f.stat().st_size for f in (tmp_path / "src").rglob("*.jpg"))
  shard_mb = total * 0.55 / (1 << 20)  # two shards of 300 files: two worker tasks each
  local = images.convert(
    tmp_path / "src", tmp_path / "local", shard_size_mb=shard_mb, workers=1, progress=False
  )
  job = images.plan(tmp_path / "src", tmp_path / "dask", shard_size_mb=shard_mb)
  second = job.plans[1].items[shards._TASK_ITEMS]  # its first task is written when it dies
  assert len(job.plans) == 2 and len(job.plans[1].items) > shards._TASK_ITEMS
  flag = tmp_path / "killed"
  process = functools.partial(job.process, read_many=convert_beam.read_many)
  job = dataclasses.replace(
    job, process=functools.partial(killed_once, process=process, kill_at=second, flag=str(flag))
  )
  on_dask = convert_beam.run(job, progress=False, **dask_runner(dask_cluster))
  try:  # the worker really died (its nanny started another), and the shard was written again
    assert psutil.Process(int(flag.read_text())).status() == psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    pass
  assert on_dask == local
  same_files(tmp_path / "local", tmp_path / "dask")
