"""Image-folder and TFRecord conversion as an Apache Beam pipeline (optional extra `beam`).

The driver plans the job exactly as the local converter does (same file order, split and
byte-sized shard plan); each shard is one Beam element, written whole by one worker through
the same writer, so the shards are byte-identical to `python -m pipeline.convert images`.
The driver holds OUT's lock; finished shards leave done markers in OUT's build folder, so a
failed pipeline re-run only writes the rest; the driver swaps the result into OUT at the end.

    python -m pipeline.convert images SRC OUT --runner DirectRunner --direct_num_workers 4

Other runners take their usual Beam flags after the command. SRC and OUT must be the same
paths on the driver and on every worker (the converter reads and writes plain files), e.g.
a bucket mounted with gcsfuse, or a shared NFS/Filestore volume; workers need this package:

    # Google Cloud Dataflow (OUT on a gcsfuse mount, or a Filestore volume)
    python -m pipeline.convert images /gcs/in/train /gcs/out/imagenet --runner DataflowRunner \\
        --project P --region us-central1 --temp_location gs://B/tmp \\
        --sdk_container_image IMAGE_WITH_THIS_PACKAGE_AND_MOUNT   # or --setup_file ./setup.py
    # Apache Flink / Spark (portable runners; the cluster mounts the shared volume)
    python -m pipeline.convert tfrecord '/shared/tf/train-*' /shared/out --num-classes 1000 \\
        --runner FlinkRunner --flink_master HOST:8081 --environment_type DOCKER
    python -m pipeline.convert images /shared/in /shared/out --runner SparkRunner \\
        --spark_master_url spark://HOST:7077 --environment_type DOCKER
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from pipeline import manifest as manifest_lib
from pipeline.convert import images, shards, tfrecord


def run(
  job: shards.Job,
  *,
  runner: str = "DirectRunner",
  pipeline_args: Sequence[str] = (),
  overwrite: bool = False,
) -> manifest_lib.Manifest:
  """Writes a planned job's unfinished shards with Beam, then swaps the result into OUT."""
  import apache_beam as beam
  from apache_beam.options.pipeline_options import PipelineOptions

  with shards.locked(job.out):
    if (m := shards.start(job, overwrite)) is not None:
      return m
    todo = shards.pending(job)
    worker_job = dataclasses.replace(job, plans=[])  # each element carries its own plan
    options = PipelineOptions(list(pipeline_args), runner=runner)
    with beam.Pipeline(options=options) as p:
      _ = (
        p
        | "Plan" >> beam.Create(todo)
        | "Spread" >> beam.Reshuffle()
        | "WriteShard" >> beam.Map(lambda plan: shards.write_shard(worker_job, plan))
      )
    return shards.finish(job)


def convert_images(
  src: str | os.PathLike,
  out: str | os.PathLike,
  *,
  runner: str = "DirectRunner",
  pipeline_args: Sequence[str] = (),
  overwrite: bool = False,
  **kwargs: Any,
) -> manifest_lib.Manifest:
  """`images.convert` on Beam; `kwargs` are `images.plan`'s (split, val_fraction, ...)."""
  return run(
    images.plan(src, out, **kwargs), runner=runner, pipeline_args=pipeline_args, overwrite=overwrite
  )


def convert_tfrecord(
  pattern: str | Sequence[str],
  out: str | os.PathLike,
  *,
  runner: str = "DirectRunner",
  pipeline_args: Sequence[str] = (),
  overwrite: bool = False,
  **kwargs: Any,
) -> manifest_lib.Manifest:
  """`tfrecord.convert` on Beam; `kwargs` are `tfrecord.plan`'s (split, num_classes, ...)."""
  return run(
    tfrecord.plan(pattern, out, **kwargs),
    runner=runner,
    pipeline_args=pipeline_args,
    overwrite=overwrite,
  )
