"""One process of order/test_blocks_hosts.py's pod: reads its slice of a split in the block order
through its own storage rig mount (--data: this host's mount), as a host of a pod reads a
bucket, and counts the storage reads it made.

Joins an N-process JAX cluster on localhost; for the train split (2 epochs) and the
validation split (2 evaluations) builds `make_dataset`'s stages, opens every shard (the
footer reads of an open are not the blocks'), zeroes the rig's counters, takes every batch,
and writes JSON: per split, the rig's read count and the (epoch, record) of each position
it planned (PAD: -1).
"""

import json
import pathlib

import jax
import numpy as np

import pipeline
from pipeline import dataset
from tests import cluster

BLOCK_RECORDS = 16


def spec(data: str, split: str, shard_index: int, shard_count: int) -> pipeline.Spec:
  """What process `shard_index` of `shard_count` reads of `split`: 2 epochs (training) or 2
  evaluations in blocks of BLOCK_RECORDS, with no record cache to hide the storage reads."""
  return pipeline.Spec.of(
    data,
    split,
    batch_size=4,
    train=split == "train",
    num_epochs=2,
    seed=3,
    image_size=16,
    order="blocks",
    block_records=BLOCK_RECORDS,
    shard_index=shard_index,
    shard_count=shard_count,
    performance=dict(num_workers=0, num_threads=1, record_cache_mb=0),
  )


def reads(data: str, split: str) -> dict:
  st = dataset.build(spec(data, split, jax.process_index(), jax.process_count()))
  source = st.read.source
  for shard in range(len(source.paths)):
    source.read_range(shard, 0, 1)
  rig = pathlib.Path(data)
  (rig / ".rig-reset").read_text()
  it = iter(dataset.chain(st))
  for _ in it:
    pass
  it.close()
  made = json.loads((rig / ".rig-stats").read_text())["reads"]
  sampler = st.plan.sampler
  taken = min(len(sampler), st.sizes.num_batches * st.sizes.batch_size)
  epochs, records = sampler.records(np.arange(taken))
  return {"reads": made, "epochs": epochs.tolist(), "records": records.tolist()}


def main() -> None:
  parser = cluster.parser(__doc__)
  parser.add_argument("--data", required=True, help="this host's rig mount of a dataset")
  args = parser.parse_args()

  cluster.join(args)
  out = {split: reads(args.data, split) for split in ("train", "validation")}
  with open(args.out, "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
