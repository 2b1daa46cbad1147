"""One process of the elastic-resume tests (see order/test_elastic.py).

Joins an N-process JAX cluster on localhost and reads its slice of a train split with
`make_dataset` (shard_index/shard_count from jax), a global batch of GLOBAL_BATCH examples
split over the processes. Writes JSON: each step's examples as "label:sha1(pixels)" (a
record and its crop), the iterator state after each --save_at step, and, for each state
in --resume (a JSON file), the steps that follow it, up to --steps in all.
"""

import hashlib
import json

import jax

import pipeline
from tests import cluster

SEED, IMAGE_SIZE, GLOBAL_BATCH = 7, 16, 12


def examples(batch: dict) -> list[str]:
  return [
    f"{label}:{hashlib.sha1(image.tobytes()).hexdigest()}"
    for image, label in zip(batch["image"], batch["label"], strict=True)
  ]


def make_dataset(data, shard_index: int, shard_count: int, workers=0, batch_size=None, **kwargs):
  """What process `shard_index` of `shard_count` reads: its share of each global batch (for
  the tests that resume on other settings: another `batch_size`, other `kwargs`)."""
  return pipeline.make_dataset(
    data,
    batch_size=batch_size or GLOBAL_BATCH // shard_count,
    seed=SEED,
    image_size=IMAGE_SIZE,
    shard_index=shard_index,
    shard_count=shard_count,
    performance=dict(num_threads=1, num_workers=workers),
    **kwargs,
  )


def main() -> None:
  parser = cluster.parser(__doc__)
  parser.add_argument("--data", required=True, help="a converted dataset")
  parser.add_argument("--steps", type=int, required=True, help="steps of a whole run")
  parser.add_argument("--save_at", default="", help="steps after which to save the state")
  parser.add_argument("--resume", default="", help="state JSON files, comma-separated")
  parser.add_argument("--workers", type=int, default=0, help="performance.num_workers")
  args = parser.parse_args()

  cluster.join(args)
  ds = make_dataset(args.data, jax.process_index(), jax.process_count(), args.workers)
  save_at = [int(s) for s in args.save_at.split(",") if s]
  out = {"steps": [], "states": {}, "resumed": {}}
  it = iter(ds)
  for step in range(1, args.steps + 1):
    out["steps"].append(examples(next(it)))
    if step in save_at:
      out["states"][step] = it.get_state()
  it.close()
  for path in filter(None, args.resume.split(",")):
    with open(path) as f:
      state = json.load(f)
    it = iter(ds)
    it.set_state(state)
    done = state["position"] // GLOBAL_BATCH
    out["resumed"][path] = [examples(next(it)) for _ in range(done, args.steps)]
    it.close()
  with open(args.out, "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
