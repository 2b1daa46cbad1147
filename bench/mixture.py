"""`python -m bench mixture DATA_DIR`: a 2-source mixture's images/s beside one source's.

    python -m bench mixture data/photos --rounds 5 --batches 20 [--order blocks]

The same images both ways: the split alone, and a mixture of two sources that are both the
split (weights 1:1: the same decode work per image, through the mixture's plan, per-source
decode heads, label checks and merge), in interleaved rounds (alone, mixture, alone, ...) so
a shared machine's drift falls on both; the median of each, their ratio and each round's.
Also the CPU time per image (this process and its worker processes, over the timed part):
the work each does, which a loaded machine's share of the cores moves less than images/s.
With --batches about (split records x 2) / batch_size (25 for 802 records in batches of 64)
both streams decode about the same images (each record about twice): the photos' sizes vary.
"""

from __future__ import annotations

import statistics
import sys

import psutil

import pipeline
from bench import measure


class CpuClock:
  """CPU seconds of this process and its worker processes between `timed(True)` and
  `timed(False)` (`measure.run`'s callback)."""

  def __init__(self):
    self.seconds, self._at = 0.0, {}

  def _now(self) -> dict:
    out = {}
    for p in [psutil.Process(), *measure.workers()]:
      try:
        t = p.cpu_times()
        out[p.pid] = t.user + t.system
      except psutil.Error:  # exited meanwhile
        continue
    return out

  def __call__(self, start: bool) -> None:
    now = self._now()
    if start:
      self._at = now
    else:
      self.seconds = sum(t - self._at.get(pid, 0.0) for pid, t in now.items())


def main(argv: list[str]) -> dict:
  p = measure.parser(
    "mixture", __doc__, "split", "batch_size", "image_size", "rounds", "batches", "json"
  )
  p.add_argument(
    "--order", choices=("global", "blocks"), help="both streams' order (default: by storage)"
  )
  args = p.parse_args(argv)
  keywords = dict(batch_size=args.batch_size, image_size=args.image_size, seed=0)
  keywords.update(order=args.order)
  keywords.update(shard_index=0, shard_count=1)
  made = {
    "one source": lambda: pipeline.make_dataset(args.data_dir, args.split, **keywords),
    "2-source mixture": lambda: pipeline.make_dataset(
      {"a": args.data_dir, "b": args.data_dir}, args.split, weights={"a": 1, "b": 1}, **keywords
    ),
  }
  rates: dict[str, list[float]] = {name: [] for name in made}
  cpu: dict[str, list[float]] = {name: [] for name in made}  # ms per image
  for _ in range(args.rounds):
    for name, make in made.items():
      it, clock = lambda make=make: iter(make()), CpuClock()
      run = measure.run(name, it, args.batch_size, args.batches * args.batch_size, clock)
      rates[name].append(run.images_per_sec)
      cpu[name].append(clock.seconds / run.images * 1e3)
  medians = {name: statistics.median(r) for name, r in rates.items()}
  cpu_medians = {name: statistics.median(r) for name, r in cpu.items()}
  mixed, alone = rates["2-source mixture"], rates["one source"]
  ratios = [m / a for m, a in zip(mixed, alone)]
  ratio = medians["2-source mixture"] / medians["one source"]
  cpu_ratio = cpu_medians["2-source mixture"] / cpu_medians["one source"]
  for name, r in rates.items():
    print(
      f"{name:18s} median {medians[name]:7.0f} img/s  rounds {[round(x) for x in r]}  "
      f"cpu {cpu_medians[name]:.2f} ms/img, rounds {[round(x, 2) for x in cpu[name]]}"
    )
  print(f"mixture / one source: {ratio:.3f} (rounds {[round(x, 2) for x in ratios]})")
  print(f"cpu per image, mixture / one source: {cpu_ratio:.3f}")
  return measure.finish(
    p,
    args,
    argv,
    {
      "rates": rates,
      "medians": medians,
      "ratio": ratio,
      "round_ratios": ratios,
      "cpu_ms_per_image": cpu,
      "cpu_ratio": cpu_ratio,
    },
  )


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
