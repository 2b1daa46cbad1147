"""`bench.threads`: a process's CPU split by thread group, from the kernel's counters."""

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bench import measure, threads

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/task")


def busy(cpu_s: float) -> None:
  """Spends `cpu_s` of this thread's CPU, touching fresh memory on the way (page faults)."""
  start = time.thread_time()
  while time.thread_time() - start < cpu_s:
    np.ones(1 << 20, np.uint8).sum()


def test_a_pool_threads_cpu_counts_as_one_group_the_largest_first_with_its_page_faults():
  before = threads.Snapshot()
  with ThreadPoolExecutor(2, thread_name_prefix="pipeline-read") as pool:
    list(pool.map(busy, [0.2, 0.2]))
    after = threads.Snapshot()  # the pool's threads still alive: counted
  groups = after.since(before)
  assert next(iter(groups)) == "pipeline-read"  # the largest first, its threads' numbers dropped
  read = groups["pipeline-read"]
  assert read["cpu_s"] >= 0.3 and read["faults"] > 0 and 0 <= read["system_s"] <= read["cpu_s"]
  share = threads.per_image(groups, images=100)
  assert share["pipeline-read"]["cpu_us"] == pytest.approx(read["cpu_s"] / 100 * 1e6, abs=0.1)
  assert sum(g["share"] for g in share.values()) == pytest.approx(1.0, abs=1e-3)
  assert threads.line(share).startswith("CPU per image by thread: pipeline-read ")


def test_group_names_pool_threads_without_their_number_and_grains_prefetch_as_one():
  assert threads.group("pipeline-decode_12") == "pipeline-decode"
  assert threads.group("pipeline-read-3") == "pipeline-read"
  assert threads.group("grain-thread-prefetch-ThreadPrefetchDatasetIterator(x=1)") == (
    "grain-prefetch"
  )
  assert threads.group("MainThread") == "MainThread"


def test_a_thread_that_ended_between_snapshots_is_not_counted():
  before = threads.Snapshot()
  t = threading.Thread(target=busy, args=(0.05,), name="gone")
  t.start()
  t.join()
  assert "gone" not in threads.Snapshot().since(before)


def test_the_bench_rss_sampler_runs_as_a_thread_group_of_its_own():
  with measure.RssSampler(interval=0.01):
    groups = {name for name, *_ in threads.Snapshot().threads.values()}
  assert measure.SAMPLER in groups
