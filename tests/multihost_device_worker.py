"""One process of the two-process device_prefetch test (see test_device.py).

Joins a 2-process JAX cluster on localhost with 4 CPU devices, feeds its slice of the data
through `device_prefetch`, and saves what it sees of the global batches to an .npz file.
"""

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from pipeline.device import device_prefetch
from tests import cluster

LOCAL_BATCH = 4


def examples(ids):
  """Examples whose label is the global example id and whose pixels encode it."""
  return grain.MapDataset.source(ids).map(
    lambda i: {"image": np.full((2, 2, 3), i, np.uint8), "label": np.int32(i)}
  )


def main() -> None:
  parser = cluster.parser(__doc__)
  parser.add_argument("--mesh", default="8", help="mesh shape, e.g. 8 or 4,2")
  args = parser.parse_args()

  cluster.join(args, devices=4)
  shape = tuple(int(s) for s in args.mesh.split(","))
  names = ("data", "model")[: len(shape)]
  mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))

  def gather(x: jax.Array) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  out = {}

  # Training: process p feeds ids 16p..16p+15; 3 steps, then resume from the state after 1.
  ids = list(range(16 * args.process_id, 16 * (args.process_id + 1)))
  ds = device_prefetch(examples(ids).batch(LOCAL_BATCH).to_iter_dataset(), mesh, normalize=True)
  it = iter(ds)
  out["train_label"], out["train_image"], out["spec"] = [], [], []
  for step in range(3):
    batch = next(it)
    out["train_label"].append(gather(batch["label"]))
    out["train_image"].append(gather(batch["image"]))
    out["spec"].append(str(batch["image"].sharding.spec))
    if step == 0:
      state = it.get_state()
  it.close()
  resumed = iter(ds)
  resumed.set_state(state)
  out["resumed_label"] = gather(next(resumed)["label"])
  resumed.close()

  # Eval: 21 ids, uneven slices (11 and 10), padded to full batches with a mask.
  ds = device_prefetch(
    examples(list(range(21))[args.process_id :: args.num_processes])
    .batch(LOCAL_BATCH)
    .to_iter_dataset(),
    mesh,
    remainder="pad",
  )
  count = jax.jit(lambda m: m.astype(np.int32).sum())
  out["eval_label"], out["eval_mask"], out["eval_count"] = [], [], []
  it = iter(ds)
  for batch in it:
    out["eval_label"].append(gather(batch["label"]))
    out["eval_mask"].append(gather(batch["mask"]))
    out["eval_count"].append(int(count(batch["mask"])))
  it.close()
  np.savez(args.out, **out)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
