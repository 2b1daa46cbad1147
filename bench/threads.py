"""CPU by thread group in this process (decode, read, Grain's prefetch, main...), from the
kernel's per-thread counters: where the CPU around the decode goes.

`Snapshot()` reads each thread's CPU seconds, system seconds and minor page faults from
/proc/self/task, named by its Python thread (numbered pool threads grouped: 'pipeline-read_3'
counts as 'pipeline-read'; threads Python did not start as 'native'); `since(before)` is the
difference per group. Linux only: elsewhere a snapshot is empty.
"""

from __future__ import annotations

import collections
import os
import re
import threading

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_NUMBERED = re.compile(r"[_-]?\d+$")


def group(name: str) -> str:
  """A thread's group: its name without a pool's number, Grain's prefetch threads as one."""
  if name.startswith("grain-thread-prefetch"):
    return "grain-prefetch"
  return _NUMBERED.sub("", name)


class Snapshot:
  """Each live thread's (group, CPU s, system s, minor page faults), by native thread id."""

  def __init__(self):
    names = {t.native_id: t.name for t in threading.enumerate()}
    self.threads: dict[int, tuple[str, float, float, int]] = {}
    try:
      tids = os.listdir("/proc/self/task")
    except OSError:
      return
    for tid in tids:
      try:
        with open(f"/proc/self/task/{tid}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:  # a thread that ended meanwhile
        continue
      user, system = int(fields[11]) / _TICK, int(fields[12]) / _TICK
      name = group(names.get(int(tid), "native"))
      self.threads[int(tid)] = (name, user + system, system, int(fields[7]))

  def since(self, before: Snapshot) -> dict[str, dict]:
    """{group: {cpu_s, system_s, faults}} spent between `before` and this snapshot, the
    largest first (threads that ended between the two are not counted)."""
    out = collections.defaultdict(lambda: dict(cpu_s=0.0, system_s=0.0, faults=0))
    for tid, (name, cpu, system, faults) in self.threads.items():
      _, cpu0, system0, faults0 = before.threads.get(tid, (name, 0.0, 0.0, 0))
      g = out[name]
      g["cpu_s"] += cpu - cpu0
      g["system_s"] += system - system0
      g["faults"] += faults - faults0
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu_s"]))


def per_image(groups: dict[str, dict], images: int) -> dict[str, dict]:
  """`since`'s groups per image: CPU and system us, page faults, share of the CPU."""
  total = sum(g["cpu_s"] for g in groups.values()) or 1.0
  return {
    name: dict(
      cpu_us=round(g["cpu_s"] / images * 1e6, 1),
      system_us=round(g["system_s"] / images * 1e6, 1),
      faults=round(g["faults"] / images, 2),
      share=round(g["cpu_s"] / total, 4),
    )
    for name, g in groups.items()
    if g["cpu_s"] > 0
  }


def line(groups: dict[str, dict]) -> str:
  """`per_image`'s groups in one line, as `bench throughput` prints them."""
  parts = [
    f"{name} {g['share']:.1%} ({g['cpu_us']:.0f} us, {g['faults']:.1f} page faults)"
    for name, g in groups.items()
  ]
  return "CPU per image by thread: " + ", ".join(parts)
