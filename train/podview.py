"""Every host in process 0's log: at each log line every process's img/s, input wait,
storage requests/s (`pipeline.stats_of`, its worker processes' included) and peak RSS (the
process tree's: `rss_mb`), gathered with one small collective (all processes log at the
same steps), and the longest time it did not run (`train.stalls`).

Process 0 prints a row per host when they differ by more than `WAIT_POINTS` or
`SPEED_SHARE`, and the run's verdict is the worst host's (the highest input wait), named.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.experimental import multihost_utils

from pipeline.host import memory
from train import stalls

WAIT_POINTS = 0.05  # rows when input waits differ by more than 5 points of step time
SPEED_SHARE = 0.10  # or img/s by more than 10%


@dataclasses.dataclass(frozen=True)
class Host:
  """One process's window: the images it fed per second, its share of input wait, the
  storage requests it made per second, its process tree's peak RSS so far (MB) and its
  longest stall (seconds it did not run, and the step it was at)."""

  process: int
  images_per_sec: float
  input_wait_share: float
  requests_per_sec: float = 0.0
  peak_rss_mb: float = 0.0
  stall_s: float = 0.0
  stall_step: int = 0


def rss_mb() -> float:
  """MB this process tree holds (`pipeline.host.memory.tree_rss`; sampled at each log line)."""
  return memory.tree_rss() / memory.MB


def gather(
  images_per_sec: float,
  input_wait_share: float,
  requests_per_sec: float,
  peak_rss_mb: float = 0.0,
  stall: tuple[float, int] = (0.0, 0),
) -> list[Host]:
  """Every process's numbers, in process order; a collective, so every process calls it."""
  mine = np.array([images_per_sec, input_wait_share, requests_per_sec, peak_rss_mb, *stall])
  rows = multihost_utils.process_allgather(mine)
  return [Host(i, *map(float, row[:-1]), int(row[-1])) for i, row in enumerate(rows)]


def stalled(hosts: list[Host]) -> list[str]:
  """A line for each host that did not run for `stalls.STALL_S` or more (`stalls.line`)."""
  return [
    stalls.line(h.process if len(hosts) > 1 else None, h.stall_s, h.stall_step)
    for h in hosts
    if h.stall_s >= stalls.STALL_S
  ]


def worst(hosts: list[Host]) -> Host:
  return max(hosts, key=lambda h: h.input_wait_share)


def which(hosts: list[Host]) -> str:
  """Whose the verdict is (the worst host's), when there are several hosts."""
  return f": process {worst(hosts).process}, the worst of {len(hosts)}" if len(hosts) > 1 else ""


def differ(hosts: list[Host]) -> bool:
  waits = [h.input_wait_share for h in hosts]
  speeds = [h.images_per_sec for h in hosts]
  return max(waits) - min(waits) > WAIT_POINTS or max(speeds) > (1 + SPEED_SHARE) * min(speeds)


def rows(hosts: list[Host], verdict) -> str:
  """A line per host: `verdict(input_wait_share)` names how input-bound it is."""
  return "\n".join(
    f"  process {h.process}: {h.images_per_sec:7.0f} img/s  input wait "
    f"{100 * h.input_wait_share:4.1f}% ({verdict(h.input_wait_share)})  "
    f"{h.requests_per_sec:,.0f} requests/s  peak RSS {h.peak_rss_mb:,.0f} MB"
    for h in hosts
  )


def mean(windows: list[list[Host]]) -> list[Host]:
  """Each process's mean over `windows` (the first left out when there are others: it
  holds the steps right after compilation), and its peak RSS and longest stall over all; []
  for none."""
  timed = windows[1:] or windows
  hosts = []
  for i in range(len(windows[0]) if windows else 0):
    longest = max((w[i] for w in windows), key=lambda h: h.stall_s)
    hosts.append(
      Host(
        i,
        float(np.mean([w[i].images_per_sec for w in timed])),
        float(np.mean([w[i].input_wait_share for w in timed])),
        float(np.mean([w[i].requests_per_sec for w in timed])),
        max(w[i].peak_rss_mb for w in windows),
        longest.stall_s,
        longest.stall_step,
      )
    )
  return hosts
