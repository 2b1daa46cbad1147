"""One process of the two-process pipeline.input test (see test_input.py).

Joins a 2-process JAX cluster on localhost with 4 CPU devices each, reads a dataset through
`pipeline.input` in both layouts, and saves what it sees to an .npz file.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

import pipeline
from tests import cluster

FAST = {"image_size": 8, "performance": {"num_threads": 1}}


def main() -> None:
  parser = cluster.parser(__doc__)
  parser.add_argument("--data_dir", required=True)
  args = parser.parse_args()

  cluster.join(args, devices=4)
  gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
  out = {}

  train = pipeline.input(args.data_dir, "train", global_batch_size=16, seed=1, **FAST)
  batch = next(train)
  out["train_local_rows"] = train.batch_size
  out["train_label"] = gather(batch["label"])
  out["train_image_sum"] = gather(batch["image"].astype(np.int32).sum(axis=(1, 2, 3)))
  train.close()

  val = pipeline.input(args.data_dir, "validation", global_batch_size=16, **FAST)
  real = [gather(b["image"].astype(np.int32).sum(axis=(1, 2, 3)))[gather(b["mask"])] for b in val]
  out["eval_steps"], out["eval_real"] = val.steps_per_epoch, sum(len(r) for r in real)
  val.close()

  pmapped = pipeline.input(
    args.data_dir, "train", global_batch_size=16, seed=1, layout="pmap", **FAST
  )
  batch = next(pmapped)
  out["pmap_shape"] = batch["label"].shape
  total = jax.pmap(lambda x: jax.lax.psum(x.sum(), "d"), axis_name="d")(batch["label"])
  out["pmap_psum"] = np.asarray(total.addressable_shards[0].data).reshape(-1)[0]
  out["pmap_label"] = gather(batch["label"])
  pmapped.close()

  try:
    pipeline.input(args.data_dir, "train", global_batch_size=15, **FAST)
  except ValueError as e:
    out["error"] = str(e)
  np.savez(args.out, **out)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
