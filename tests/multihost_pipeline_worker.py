"""One process of the multi-host pipeline tests (see test_multihost_pipeline.py).

Joins an N-process JAX cluster on localhost, reads its slice of a split with `make_dataset`
(shard_index/shard_count from jax.process_index()/process_count()) for 2 epochs of eval
images, which are a pure function of their record, so a hash names the record. Writes JSON:
each batch's hashes (null for padding) and the iterator state after --save_at batches.
"""

import argparse
import hashlib
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

import pipeline
from tests.cluster import join

SEED = 7
IMAGE_SIZE = 16


def make_dataset(data, shard_index: int, shard_count: int, split="train", batch_size: int = 4):
  """What process `shard_index` of `shard_count` reads: 2 shuffled epochs of eval images."""
  return pipeline.make_dataset(
    data,
    split,
    batch_size=batch_size,
    train=False,
    shuffle=True,
    num_epochs=2,
    seed=SEED,
    image_size=IMAGE_SIZE,
    shard_index=shard_index,
    shard_count=shard_count,
    performance=dict(num_threads=1),
  )


def hashes(batch: dict) -> list[str | None]:
  """Each example's hash, None for padding."""
  return [
    hashlib.sha1(image.tobytes()).hexdigest() if real else None
    for image, real in zip(batch["image"], batch["mask"])
  ]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--data", required=True, help="a converted dataset")
  parser.add_argument("--split", default="train")
  parser.add_argument("--batch_size", type=int, default=4)
  parser.add_argument("--save_at", type=int, default=0, help="save the state after N batches")
  parser.add_argument("--out", required=True, help="JSON file to write")
  args = parser.parse_args()

  join(args.port, args.num_processes, args.process_id, devices=1)
  ds = make_dataset(
    args.data, jax.process_index(), jax.process_count(), args.split, args.batch_size
  )
  it = iter(ds)
  out = {"process_index": jax.process_index(), "process_count": jax.process_count()}
  out["batches"] = []
  for batch in it:
    out["batches"].append(hashes(batch))
    if len(out["batches"]) == args.save_at:
      out["state"] = it.get_state()
  it.close()
  # A synchronous training step needs every process to yield the same number of batches.
  counts = multihost_utils.process_allgather(np.int32(len(out["batches"])))
  out["batch_counts"] = np.asarray(counts).tolist()
  with open(args.out, "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
