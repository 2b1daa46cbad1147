"""Soak: many epochs over a small set, with restarts, while RSS, files and threads are measured.

A training run lasts days, so a leak of a few KiB per batch or one thread, file handle or
shared-memory block per restart adds up. The soak trains on the digits for a bounded time,
restores the iterator from its saved state every few seconds (a checkpoint restart) and runs
a fresh eval pass each round, sampling resources throughout; after warm-up they must stay
flat: the last quarter of the run may not exceed the second quarter by more than a bound.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time

import psutil
import pytest

import pipeline

BATCH = 16
RSS_BOUND_MB = 32  # a leak of 1 KiB per batch shows up within a minute at ~500 batches/s
FD_BOUND, THREAD_BOUND, SHM_BOUND = 2, 2, 4
OURS = ("psm_", "pipeline-ring-")  # Grain's blocks, the hand-off's ring blocks


def _ours(path: str) -> bool:
  return any(f"/dev/shm/{prefix}" in path for prefix in OURS)


@dataclasses.dataclass(frozen=True)
class Sample:
  seconds: float
  batches: int
  rss_mb: float  # this process and its workers
  fds: int
  threads: int
  workers: int  # Grain's worker processes (not multiprocessing's helpers)
  shm: int  # shared-memory blocks (Grain's worker outputs) this process tree holds


def _shm() -> set[str]:
  return {n for n in os.listdir("/dev/shm") if n.startswith(OURS)}


def _held_shm(pid: int) -> set[str]:
  """The shared-memory blocks a process maps or has open. /dev/shm is shared by every
  process on the machine, so blocks are counted where this process tree holds them."""
  with open(f"/proc/{pid}/maps") as maps:
    names = {line.split("/dev/shm/")[1].split()[0] for line in maps if _ours(line)}
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
      continue
    if _ours(target):
      names.add(target.removeprefix("/dev/shm/").split()[0])
  return names


def _is_worker(process: psutil.Process) -> bool:
  """Grain starts its workers with spawn; helpers do not run spawn's entry point: the
  resource tracker, or the forkserver an earlier conversion in this process left running."""
  return "multiprocessing.spawn import spawn_main" in " ".join(process.cmdline())


def soak(
  data_dir, seconds: float, *, num_workers: int, restart_every_s: float
) -> tuple[list[Sample], Sample, set[str]]:
  """Trains for `seconds`, restarting from the saved state and evaluating every round.

  Returns the samples taken while training, one taken after everything was closed, and
  the shared-memory blocks seen held during the run that still exist after it.
  """
  me = psutil.Process()
  seen: set[str] = set()

  def sample(start: float, batches: int) -> Sample:
    rss = fds = threads = workers = 0
    held = set()
    for p in [me] + me.children(recursive=True):
      try:
        rss, fds, threads = (
          rss + p.memory_info().rss,
          fds + p.num_fds(),
          threads + p.num_threads(),
        )
        workers += p != me and _is_worker(p)
        held |= _held_shm(p.pid)
      except (psutil.NoSuchProcess, OSError):
        pass
    seen.update(held)
    return Sample(time.monotonic() - start, batches, rss / 2**20, fds, threads, workers, len(held))

  def train():
    return pipeline.make_dataset(
      data_dir,
      batch_size=BATCH,
      image_size=24,
      shard_index=0,
      shard_count=1,
      performance=dict(num_threads=2, num_workers=num_workers),
    )

  start, batches, samples = time.monotonic(), 0, []
  it = iter(train())
  while time.monotonic() - start < seconds:
    round_start = time.monotonic()
    while time.monotonic() - round_start < restart_every_s:
      for _ in range(20):
        next(it)
      batches += 20
      samples.append(sample(start, batches))
    state = it.get_state()  # a checkpoint, then a restart from it
    it.close()
    it = iter(train())
    it.set_state(state)
    evaluation = iter(
      pipeline.make_dataset(
        data_dir,
        "validation",
        batch_size=BATCH,
        train=False,
        image_size=24,
        shard_index=0,
        shard_count=1,
        performance=dict(num_threads=2),
      )
    )
    assert sum(int(b["mask"].sum()) for b in evaluation) == 60
    evaluation.close()
  it.close()
  del it, evaluation
  gc.collect()
  time.sleep(1)  # workers exit and unlink their last blocks
  return samples, sample(start, batches), seen & _shm()


def assert_flat(samples: list[Sample]) -> None:
  """The last quarter may not exceed the second (after warm-up) by more than the bounds."""
  q = len(samples) // 4
  assert q >= 3, f"only {len(samples)} samples"
  warm, late = samples[q : 2 * q], samples[-q:]

  def peak(window, field):
    return max(getattr(s, field) for s in window)

  rss_growth = statistics.median(s.rss_mb for s in late) - statistics.median(s.rss_mb for s in warm)
  assert rss_growth <= RSS_BOUND_MB, samples
  # Medians for file descriptors: a restart briefly holds the old and new workers' pipes.
  assert (
    statistics.median(s.fds for s in late) <= statistics.median(s.fds for s in warm) + FD_BOUND
  ), samples
  assert peak(late, "threads") <= peak(warm, "threads") + THREAD_BOUND, samples
  assert peak(late, "workers") <= peak(warm, "workers"), samples
  assert peak(late, "shm") <= peak(warm, "shm") + SHM_BOUND, samples


def summary(samples: list[Sample], num_records: int) -> str:
  first, last = samples[0], samples[-1]
  return (
    f"{last.seconds:.0f} s, {last.batches * BATCH / num_records:.0f} epochs; "
    f"RSS {first.rss_mb:.0f}->{last.rss_mb:.0f} MiB (peak "
    f"{max(s.rss_mb for s in samples):.0f}), fds {first.fds}->{last.fds}, threads "
    f"{first.threads}->{last.threads}, workers {last.workers}, shm held {last.shm}"
  )


@pytest.mark.parametrize(
  "seconds, restart_every_s",
  [(10, 1), pytest.param(60, 3, marks=pytest.mark.slow)],
  ids=["short", "long"],
)
def test_soak_with_thread_decoding_stays_flat(digits_dir, seconds, restart_every_s):
  samples, closed, _ = soak(digits_dir, seconds, num_workers=0, restart_every_s=restart_every_s)
  print(summary(samples, 240))
  assert_flat(samples)
  assert closed.threads <= samples[0].threads + THREAD_BOUND


@pytest.mark.slow
def test_soak_with_worker_processes_stays_flat(digits_dir):
  samples, closed, left_behind = soak(digits_dir, 90, num_workers=2, restart_every_s=15)
  print(summary(samples, 240))
  assert_flat(samples)
  assert min(s.workers for s in samples) == 2
  assert max(s.shm for s in samples) > 0  # batches do arrive in shared memory
  # Nothing left behind after close: no worker, no block held, none of ours in /dev/shm.
  assert closed.workers == 0 and closed.shm == 0 and not left_behind
