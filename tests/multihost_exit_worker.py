"""One process of the two-process exit test (see tests/train/test_train_hosts.py).

Joins as the trainer does (`train.hosts.initialize`), its failure watcher polling JAX's client
every millisecond, and exits normally, process 1 a little after process 0: at exit the watcher
must not be inside a call of the client (which aborts the process as the interpreter ends).
"""

import sys
import time

sys.path.pop(0)  # this script's folder: its train/ (the tests') would hide the trainer's

from tests import cluster
from train import hosts


def main() -> None:
  args = cluster.parser(__doc__).parse_args()
  hosts.POLL_S = 0.001
  hosts.initialize(
    f"127.0.0.1:{args.port}", args.num_processes, args.process_id, cluster.HEARTBEAT_S, 120
  )
  time.sleep(0.5 + 2 * args.process_id)  # process 1 ends while process 0's service waits
  with open(args.out, "w") as f:
    f.write("done")


if __name__ == "__main__":
  main()
