"""One process of the multi-host pipeline tests (see order/test_multihost_pipeline.py).

Joins an N-process JAX cluster on localhost, reads its slice of a split with `make_dataset`
(shard_index/shard_count from jax.process_index()/process_count()) for 2 epochs of eval
images, which are a pure function of their record, so a hash names the record. Writes JSON:
each batch's hashes (null for padding) and the iterator state after --save_at batches.
"""

import hashlib
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

import pipeline
from tests import cluster

SEED, IMAGE_SIZE, BATCH = 7, 16, 4


def make_dataset(data, shard_index: int, shard_count: int, shuffle=True, num_epochs=2):
  """What process `shard_index` of `shard_count` reads: 2 shuffled epochs of eval images
  (the test hashes each record from 1 epoch in order)."""
  return pipeline.make_dataset(
    data,
    batch_size=BATCH,
    train=False,
    shuffle=shuffle,
    num_epochs=num_epochs,
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
  parser = cluster.parser(__doc__)
  parser.add_argument("--data", required=True, help="a converted dataset")
  parser.add_argument("--save_at", type=int, default=0, help="save the state after N batches")
  args = parser.parse_args()

  cluster.join(args)
  ds = make_dataset(args.data, jax.process_index(), jax.process_count())
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
