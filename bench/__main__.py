"""`python -m bench COMMAND ...`: each command is a module here."""

import importlib
import sys

from bench import measure

MODULES = {
  "convert": "convert_speed",
  "device": "device_feed",
  "ops": "ops_speed",
}  # command -> module

COMMANDS = {
  "throughput": "the pipeline's images/s, first batch, peak RSS, per-stage costs",
  "peers": "the pipeline vs tf.data (tuned per its guide), same photos, one table",
  "device": "host pipeline alone vs through the device-put prefetch iterator",
  "storage": "pipeline vs tf.data through a storage rig adding 0-50 ms per read (FUSE)",
  "gets": "storage requests (GETs) per image from a gs:// bucket (the tests' emulator)",
  "ops": "what ops cost beside the fused head: a flip, big_vision pp strings, randaug",
  "ceiling": "the cores' raw JPEG decode rate (full and DCT-scaled) on the same photos",
  "convert": "conversion images/s and MB/s vs a sequential converter",
  "scaling": "one process's ceiling (GIL), worker costs, projected img/s on many-core hosts",
  "mixture": "a 2-source mixture's images/s beside one source of the same images",
  "host": "this host's pipeline (local, rig; block, global order) beside the model's figure",
  "photos": "a reproducible set of JPEGs of ImageNet's sizes (~110 KB), converted",
  "all": "everything above on one dataset; writes REPORT.md",
}


def main() -> None:
  if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help") or sys.argv[1] not in COMMANDS:
    print("usage: python -m bench COMMAND [--help]\n\ncommands:")
    for name, what in COMMANDS.items():
      print(f"  {name:11s} {what}")
    sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
  name = sys.argv[1].replace("-", "_")
  module = importlib.import_module(f"bench.{MODULES.get(name, name)}")
  measure.run_cli(module.main, sys.argv[2:])


if __name__ == "__main__":
  main()
