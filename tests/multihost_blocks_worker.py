"""One process of order/test_blocks_hosts.py's pod: reads its slice of a split in the block order
through its own storage rig mount (--data: this host's mount), as a host of a pod reads a
bucket, and counts the storage reads it made.

Joins an N-process JAX cluster on localhost; for the train split (--epochs epochs) and the
validation split (as many evaluations) builds `make_dataset`'s stages, opens every shard (the
footer reads of an open are not the blocks'), zeroes the rig's counters, takes every batch,
and writes JSON: per split, the rig's read and byte counts, the (epoch, record) of each
position it planned (PAD: -1) and where its reads stop inside a block (`Sampler.cuts`).
"""

import json
import pathlib

import jax
import numpy as np

import pipeline
from pipeline import dataset
from tests import cluster

BLOCK_RECORDS = 16


def spec(
  data: str,
  split: str,
  shard_index: int,
  shard_count: int,
  cache_mb: float = 0,
  epochs: int = 2,
  block_records: int = BLOCK_RECORDS,
) -> pipeline.Spec:
  """What process `shard_index` of `shard_count` reads of `split`: `epochs` epochs (training)
  or evaluations in blocks of BLOCK_RECORDS, by default with no record cache to hide the
  storage reads."""
  return pipeline.Spec.of(
    data,
    split,
    batch_size=4,
    train=split == "train",
    num_epochs=epochs,
    seed=3,
    image_size=16,
    order="blocks",
    block_records=block_records,
    shard_index=shard_index,
    shard_count=shard_count,
    performance=dict(num_workers=0, num_threads=1, record_cache_mb=cache_mb),
  )


def reads(data: str, split: str, args) -> dict:
  me, count = jax.process_index(), jax.process_count()
  st = dataset.build(spec(data, split, me, count, args.cache_mb, args.epochs, args.block_records))
  source = st.read.source
  for shard in range(len(source.paths)):
    source.read_range(shard, 0, 1)
  rig = pathlib.Path(data)
  (rig / ".rig-reset").read_text()
  it = iter(dataset.chain(st))
  for _ in it:
    pass
  it.close()
  made = json.loads((rig / ".rig-stats").read_text())
  sampler = st.plan.sampler
  taken = min(len(sampler), st.sizes.num_batches * st.sizes.batch_size)
  epochs, records = sampler.records(np.arange(taken))
  return {
    "reads": made["reads"],
    "bytes": made["bytes"],
    "epochs": epochs.tolist(),
    "records": records.tolist(),
    "cuts": list(sampler.cuts),
  }


def main() -> None:
  parser = cluster.parser(__doc__)
  parser.add_argument("--data", required=True, help="this host's rig mount of a dataset")
  parser.add_argument("--cache_mb", type=float, default=0, help="performance.record_cache_mb")
  parser.add_argument("--epochs", type=int, default=2, help="epochs, or evaluations")
  parser.add_argument("--block_records", type=int, default=BLOCK_RECORDS, help="records a block")
  args = parser.parse_args()

  cluster.join(args)
  out = {split: reads(args.data, split, args) for split in ("train", "validation")}
  with open(args.out, "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
