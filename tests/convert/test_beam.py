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
import subprocess
import sys
import textwrap
import traceback

import numpy as np
import psutil
import pytest
from PIL import Image

from pipeline.convert import beam as convert_beam  # imports apache_beam only when it runs
from pipeline.convert import images, shards, tfrecord
from tests.convert.test_images import messy  # noqa: F401 - a fixture
from tests.storage.test_gcs import gcs, run  # noqa: F401 - gcs: a fixture, a local Cloud Storage

pytest.importorskip("apache_beam", reason="in .venv-beam: make test-beam")


def same_files(a, b) -> None:
  names = sorted(p.name for p in a.iterdir())
  assert names == sorted(p.name for p in b.iterdir())
  for name in names:
    assert (a / name).read_bytes() == (b / name).read_bytes(), name


def local_cluster(env: dict):
  """A dask.distributed cluster of two worker processes (one thread each) on this machine,
  whose `gs://` is the local Cloud Storage of `env` (the `gcs` fixture's)."""
  distributed = pytest.importorskip("distributed", reason="optional extra: apache-beam[dask]")
  return distributed.LocalCluster(
    n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, env=env
  )


@pytest.fixture(scope="module")
def dask_cluster(gcs):  # noqa: F811 - the fixture imported above
  with local_cluster(gcs) as cluster:
    yield cluster


def worker_stacks(cluster) -> str:
  """Where each worker's threads are: what a hung task waits on."""

  def stacks() -> str:
    frames = sys._current_frames().items()
    return "\n".join(f"thread {t}:\n" + "".join(traceback.format_stack(f)) for t, f in frames)

  distributed = pytest.importorskip("distributed")
  with distributed.Client(cluster.scheduler_address, timeout=30) as client:
    return "\n".join(f"== {w}\n{s}" for w, s in client.run(stacks).items())


def dask_runner(cluster) -> dict:
  return {
    "runner": "DaskRunner",
    "pipeline_args": ["--dask_client_address", cluster.scheduler_address],
  }


def test_beam_image_conversion_matches_the_local_one(photos_raw, tmp_path):
  local = images.convert(
    images.Request(photos_raw, tmp_path / "local", val_fraction=0.25, shard_size_mb=1),
    workers=1,
    progress=False,
  )
  on_beam = convert_beam.convert_images(
    images.Request(photos_raw, tmp_path / "beam", val_fraction=0.25, shard_size_mb=1),
    runner="DirectRunner",
  )
  assert on_beam == local and len(local.splits["train"].shards) > 1
  same_files(tmp_path / "local", tmp_path / "beam")


def test_beam_tfrecord_conversion_matches_the_local_one(photos_dir, tmp_path):
  from tests.convert.test_tfrecord import photos_tfrecord

  source = photos_tfrecord(photos_dir, tmp_path)
  local = tfrecord.convert(
    tfrecord.Request(source, tmp_path / "local", num_classes=4, shard_size_mb=1),
    workers=1,
    progress=False,
  )
  on_beam = convert_beam.convert_tfrecord(
    tfrecord.Request(source, tmp_path / "beam", num_classes=4, shard_size_mb=1)
  )
  assert on_beam == local
  same_files(tmp_path / "local", tmp_path / "beam")


def test_two_dask_workers_write_the_local_converters_bytes_and_report_progress(
  dask_cluster, photos_raw, tmp_path, capsys
):
  kwargs = dict(val_fraction=0.25, shard_size_mb=0.5)
  local = images.convert(
    images.Request(photos_raw, tmp_path / "local", **kwargs), workers=1, progress=False
  )
  on_dask = convert_beam.convert_images(
    images.Request(photos_raw, tmp_path / "dask", **kwargs), **dask_runner(dask_cluster)
  )
  shards_written = sum(len(s.shards) for s in local.splits.values())
  assert on_dask == local and shards_written >= 4
  same_files(tmp_path / "local", tmp_path / "dask")
  progress = capsys.readouterr().err
  assert (
    f"convert raw (DaskRunner): {shards_written}/{shards_written} shards, 64/64 files" in progress
  )


def test_two_dask_workers_convert_tfrecords_to_the_local_converters_bytes(
  dask_cluster, photos_dir, tmp_path
):
  from tests.convert.test_tfrecord import photos_tfrecord

  source = photos_tfrecord(photos_dir, tmp_path)
  kwargs = dict(num_classes=4, shard_size_mb=0.5)
  local = tfrecord.convert(
    tfrecord.Request(source, tmp_path / "local", **kwargs), workers=1, progress=False
  )
  on_dask = convert_beam.convert_tfrecord(
    tfrecord.Request(source, tmp_path / "dask", **kwargs),
    progress=False,
    **dask_runner(dask_cluster),
  )
  assert on_dask == local and len(local.splits["train"].shards) >= 4
  same_files(tmp_path / "local", tmp_path / "dask")


def test_skipped_and_reencoded_files_reach_the_manifest_from_the_workers(
  dask_cluster,
  messy,  # noqa: F811 - the fixture imported above
  tmp_path,
):
  local = images.convert(images.Request(messy, tmp_path / "local"), workers=1, progress=False)
  on_dask = convert_beam.convert_images(
    images.Request(messy, tmp_path / "dask"), progress=False, **dask_runner(dask_cluster)
  )
  assert on_dask == local
  assert len(on_dask.skipped) == 9 and len(on_dask.created_by["reencoded"]) == 3
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
    images.Request(tmp_path / "src", tmp_path / "local", shard_size_mb=shard_mb),
    workers=1,
    progress=False,
  )
  job = images.plan(images.Request(tmp_path / "src", tmp_path / "dask", shard_size_mb=shard_mb))
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


def test_from_a_bucket_into_a_bucket_through_beams_filesystems(
  gcs,  # noqa: F811 - the fixture imported above
  photos_raw,
  tmp_path,
):
  """The CLI on two Dask workers that read gs:// and write gs:// through Beam's FileSystems
  (no mount); gcsfs reads its emulator's address at import, so it runs in subprocesses. Its
  own cluster: not one whose worker a test killed (a run here once hung 300 s, a task in one
  worker; on a hang the test prints every worker's threads)."""
  put = "import gcsfs, sys; gcsfs.GCSFileSystem(token='anon').put(*sys.argv[1:], recursive=True)"
  assert run(put, env=gcs, args=[str(photos_raw), "bkt/beam/raw"]).returncode == 0
  flags = ["--val-fraction", "0.25", "--shard-size-mb", "0.5"]
  images.convert(
    images.Request(photos_raw, tmp_path / "local", val_fraction=0.25, shard_size_mb=0.5),
    workers=1,
    progress=False,
  )
  cli = ["-m", "pipeline.convert", "images", "gs://bkt/beam/raw", "gs://bkt/beam/out"]
  with local_cluster(gcs) as cluster:
    engine = ["--runner", "DaskRunner", "--dask_client_address", cluster.scheduler_address]
    try:
      p = run("", env=gcs, args=[*cli, *flags, *engine], timeout=120)
    except subprocess.TimeoutExpired:
      pytest.fail(f"no end after 120 s (a run takes ~7 s); the workers:\n{worker_stacks(cluster)}")
  assert p.returncode == 0, p.stderr[-2000:]
  assert "shards, 64/64 files" in p.stderr  # progress, from the done markers in the bucket
  check = textwrap.dedent(
    """
    import json, os, sys
    import gcsfs

    local, fs = sys.argv[1], gcsfs.GCSFileSystem(token="anon")
    names = sorted(os.listdir(local))
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("bkt/beam/out")) == names  # no build, lock
    for name in names:
      if name != "manifest.json":
        assert fs.cat_file(f"bkt/beam/out/{name}") == open(f"{local}/{name}", "rb").read(), name
    got = json.loads(fs.cat_file("bkt/beam/out/manifest.json"))
    want = json.load(open(f"{local}/manifest.json"))
    for sh in (sh for s in got["splits"].values() for sh in s["shards"]):  # the object's own
      assert sh.pop("generation") == str(fs.info(f"bkt/beam/out/{sh['file']}")["generation"])
    assert (got["splits"], got["skipped"]) == (want["splits"], want["skipped"])
    assert got["created_by"]["source"] == "gs://bkt/beam/raw"
    """
  )
  p = run(check, env=gcs, args=[str(tmp_path / "local")])
  assert p.returncode == 0, p.stderr[-2000:]
