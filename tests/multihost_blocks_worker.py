"""One process of test_blocks_hosts.py's pod: reads its slice of a split in the block order
through its own storage rig mount (--data: this host's mount), as a host of a pod reads a
bucket, and counts the storage reads it made.

Joins an N-process JAX cluster on localhost; for the train split (2 epochs) and the
validation split (2 evaluations) builds `make_dataset`'s stages, opens every shard (the
footer reads of an open are not the blocks'), zeroes the rig's counters, takes every batch,
and writes JSON: per split, the rig's read count and the (epoch, record) of each position
it planned (PAD: -1).
"""

import argparse
import json
import pathlib

import jax
import numpy as np

import pipeline
from pipeline import dataset
from tests.cluster import join


def reads(split: str, data: str, train: bool) -> dict:
  spec = pipeline.Spec.of(
    data,
    split,
    batch_size=4,
    train=train,
    num_epochs=2,
    seed=3,
    image_size=16,
    order="blocks",
    block_records=16,
    shard_index=jax.process_index(),
    shard_count=jax.process_count(),
    performance=dict(num_workers=0, num_threads=1, record_cache_mb=0),
  )
  st = dataset.build(spec)
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
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--data", required=True, help="this host's rig mount of a dataset")
  parser.add_argument("--out", required=True, help="JSON file to write")
  args = parser.parse_args()

  join(args.port, args.num_processes, args.process_id, devices=1)
  out = {split: reads(split, args.data, split == "train") for split in ("train", "validation")}
  with open(args.out, "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
