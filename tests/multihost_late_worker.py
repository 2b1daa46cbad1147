"""One process of the late-process test (see tests/train/test_train_hosts.py).

Joins as the trainer does (`train.hosts.initialize`); process 1 arrives 40 s late at
`hosts.together` (as a busy host compiling the model's init), then both run a collective
across the processes, the first, which sets up Gloo, and write the process count it saw.
"""

import sys
import time

sys.path.pop(0)  # this script's folder: its train/ (the tests') would hide the trainer's

import numpy as np
from jax.experimental import multihost_utils

from tests import cluster
from train import hosts

LATE_S = 40  # past Gloo's 30 s


def main() -> None:
  args = cluster.parser(__doc__).parse_args()
  hosts.initialize(
    f"127.0.0.1:{args.port}", args.num_processes, args.process_id, cluster.HEARTBEAT_S, 120
  )
  time.sleep(LATE_S * args.process_id)
  hosts.together("late")
  seen = multihost_utils.process_allgather(np.array([args.process_id]))
  with open(args.out, "w") as f:
    f.write(" ".join(str(int(i)) for i in np.ravel(seen)))


if __name__ == "__main__":
  main()
