"""The storage rig (bench/rig.py, bench/latencyfs.c): every read request waits the latency,
every time (no page cache); its counters are exact; concurrent reads wait together; data
read through it is the data on disk; it always unmounts.

Timings here are only lower bounds (a read cannot answer sooner than its latency); that reads
overlap is shown by the rig's own count of reads in flight.
"""

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

import grain
import pytest

from pipeline.catalog import manifest


@pytest.fixture
def blob(tmp_path):
  """A folder holding one 1 MB file of random bytes; returns (folder, bytes)."""
  data = os.urandom(1 << 20)
  (tmp_path / "src").mkdir()
  (tmp_path / "src" / "blob.bin").write_bytes(data)
  return tmp_path / "src", data


def mounted(path) -> bool:
  with open("/proc/mounts") as f:
    return any(line.split()[1] == os.path.realpath(path) for line in f)


def _at_once(rig, n: int, size: int) -> tuple[list[bytes], dict]:
  """`n` threads each read the k-th `size` bytes of the rig's blob.bin at once (counters
  reset after the open); what they read and the rig's counters."""
  fd = os.open(rig.path / "blob.bin", os.O_RDONLY)
  rig.reset()
  barrier = threading.Barrier(n)

  def read(k: int) -> bytes:
    barrier.wait()
    return os.pread(fd, size, k * size)

  try:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
      got = list(pool.map(read, range(n)))
  finally:
    os.close(fd)
  return got, rig.stats()


def test_a_4kb_read_waits_the_latency_and_again_when_repeated(storage_rig, blob):
  src, data = blob
  with storage_rig.mount(src, latency_ms=30) as rig:
    fd = os.open(rig.path / "blob.bin", os.O_RDONLY)
    try:
      for _ in range(2):  # the same bytes again: no page cache answers for the rig
        start = time.perf_counter()
        assert os.pread(fd, 4096, 8192) == data[8192 : 8192 + 4096]
        assert time.perf_counter() - start >= 0.030
    finally:
      os.close(fd)
    assert rig.stats()["reads"] == 2 and rig.stats()["bytes"] == 2 * 4096
  assert not mounted(rig.path) and not rig.path.exists()


def test_counters_are_exact_for_a_known_read_pattern_and_reset(storage_rig, blob):
  src, data = blob
  # Each read of at most 128 KiB is one request on any kernel (FUSE's smallest request cap).
  pattern = [(0, 4096), (10, 100), (5000, 131072), (len(data) - 1000, 4096), (len(data), 4096)]
  with storage_rig.mount(src, latency_ms=1) as rig:
    assert rig.stats() == {
      "reads": 0,
      "bytes": 0,
      "in_flight": 0,
      "max_in_flight": 0,
      "opens": 0,
      "capped": 0,
      "slowed": 0,
      "latency_ms": 1,
      "requests_per_s": 0,
      "mb_per_s": 0,
    }
    fd = os.open(rig.path / "blob.bin", os.O_RDONLY)
    try:
      got = [os.pread(fd, size, offset) for offset, size in pattern]
    finally:
      os.close(fd)
    assert got == [data[o : o + s] for o, s in pattern]
    expected = {"reads": 5, "bytes": 4096 + 100 + 131072 + 1000 + 0, "opens": 1}
    stats = rig.reset()
    assert {k: stats[k] for k in expected} == expected
    assert stats["max_in_flight"] == 1 and stats["in_flight"] == 0  # one after another
    assert rig.stats()["reads"] == rig.stats()["bytes"] == rig.stats()["opens"] == 0
    assert sorted(os.listdir(rig.path)) == ["blob.bin"]  # the counter files are not listed


def test_the_request_cap_queues_every_request_of_a_burst_but_the_first(storage_rig, blob):
  src, data = blob
  n = 16
  with storage_rig.mount(src, latency_ms=0, requests_per_s=50) as rig:
    got, stats = _at_once(rig, n, 4096)
  assert got == [data[k * 4096 : (k + 1) * 4096] for k in range(n)]
  # 16 requests at once, 1 per 20 ms: all but the first wait their turn (a thread late
  # by a whole turn may miss it)
  assert stats["reads"] == n and stats["capped"] >= n - 2 and stats["requests_per_s"] == 50


def test_a_request_that_arrives_after_its_turn_waits_for_no_cap(storage_rig, blob):
  src, data = blob
  with storage_rig.mount(src, latency_ms=20, requests_per_s=100, mb_per_s=1000) as rig:
    fd = os.open(rig.path / "blob.bin", os.O_RDONLY)
    try:
      for k in range(5):  # one at a time, each 20 ms after the last: past its 10 ms turn
        assert os.pread(fd, 4096, k * 4096) == data[k * 4096 : (k + 1) * 4096]
    finally:
      os.close(fd)
    stats = rig.stats()
  assert stats["reads"] == 5 and stats["capped"] == stats["slowed"] == 0


def test_the_bandwidth_cap_lets_concurrent_bytes_out_one_after_another(storage_rig, blob):
  src, data = blob
  n = 8
  with storage_rig.mount(src, latency_ms=0, mb_per_s=2) as rig:  # 64 KB: 32 ms each
    got, stats = _at_once(rig, n, 65536)
  assert got == [data[k * 65536 : (k + 1) * 65536] for k in range(n)]
  assert stats["bytes"] == n * 65536 and stats["slowed"] >= n - 2 and stats["mb_per_s"] == 2


def test_concurrent_reads_wait_together_not_one_after_another(storage_rig, blob):
  src, data = blob
  n, latency = 64, 0.05
  with storage_rig.mount(src, latency_ms=latency * 1000) as rig:
    fd = os.open(rig.path / "blob.bin", os.O_RDONLY)
    ready = threading.Barrier(n + 1)
    got = [None] * n

    def read(i):
      ready.wait()
      got[i] = os.pread(fd, 4096, i * 4096)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
    for t in threads:
      t.start()
    try:
      ready.wait()
      start = time.perf_counter()
      for t in threads:
        t.join()
      seconds = time.perf_counter() - start
    finally:
      os.close(fd)
    stats = rig.stats()
  assert got == [data[i * 4096 : (i + 1) * 4096] for i in range(n)]
  assert stats["reads"] == n and stats["bytes"] == n * 4096
  assert seconds >= latency  # no read answers sooner than the latency
  # They waited together (the rig's own count, not a timing a busy machine could stretch).
  assert stats["max_in_flight"] >= n // 4 and stats["in_flight"] == 0


def test_shards_read_through_the_rig_are_the_shards_on_disk(storage_rig, photos_dir):
  meta = manifest.load(photos_dir)
  with storage_rig.mount(photos_dir, latency_ms=1) as rig:
    for split in meta.splits:
      direct = [os.fspath(p) for p in meta.shard_paths(photos_dir, split)]
      through = [os.fspath(p) for p in meta.shard_paths(rig.path, split)]
      for a, b in zip(direct, through, strict=True):
        assert open(a, "rb").read() == open(b, "rb").read()
      local, remote = (grain.sources.ArrayRecordDataSource(p) for p in (direct, through))
      everything = list(range(len(local)))
      assert len(remote) == len(local) == meta.splits[split].num_records
      assert remote.__getitems__(everything) == local.__getitems__(everything)
    assert rig.stats()["reads"] > 0


def test_unmounts_when_the_block_raises_and_refuses_a_missing_source(storage_rig, blob, tmp_path):
  src, _ = blob
  with pytest.raises(KeyError):
    with storage_rig.mount(src, latency_ms=0, mountpoint=tmp_path / "mnt") as rig:
      assert mounted(rig.path)
      raise KeyError("boom")
  assert not mounted(tmp_path / "mnt") and (tmp_path / "mnt").is_dir()  # given: kept
  with pytest.raises(FileNotFoundError, match="missing"):
    with storage_rig.mount(tmp_path / "missing", latency_ms=1):
      pass


def test_cli_mounts_until_interrupted_then_unmounts(storage_rig, blob, tmp_path, run_python):
  src, data = blob
  mnt = tmp_path / "mnt"
  proc = subprocess.Popen(
    [sys.executable, "-m", "bench.rig", str(src), str(mnt), "--latency-ms", "2"],
    cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    line = proc.stdout.readline()
    assert "2 ms per read, no request cap and no bandwidth cap" in line and str(mnt) in line
    assert (mnt / "blob.bin").read_bytes() == data
  finally:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
  assert proc.returncode == 0, err
  assert '"reads": ' in out and not mounted(mnt)
  help_ = run_python("-m", "bench.rig", "--help")
  assert help_.returncode == 0 and "usage: python -m bench.rig" in help_.stdout
