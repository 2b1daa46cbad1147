"""Faults survived: a pipeline worker killed, a shard damaged after conversion.

Each test breaks something for real (SIGKILL to a Grain worker process, bytes cut from or
flipped in a converted shard) and pins down what the user sees: a clear error within a
bounded time, or the documented skip, and an exact resume from the last saved state.
"""

from __future__ import annotations

import gc
import hashlib
import os
import pathlib
import shutil
import signal
import time

import grain
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline
from pipeline.catalog import manifest
from pipeline.dataset import BadRecordError
from pipeline.storage.source import ShardedSource
from tests.conftest import assert_same_batches, take

SHARD = "validation.array_record-00000-of-00001"


def spawned_workers(before: set[int]) -> list[psutil.Process]:
  """Grain's worker processes started since `before` (not multiprocessing's tracker)."""
  return [
    p
    for p in psutil.Process().children(recursive=True)
    if p.pid not in before and "spawn_main" in " ".join(p.cmdline())
  ]


# --- a worker process killed ----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_killed_worker_raises_promptly_and_a_restart_resumes_exactly(digits_dir):
  def dataset(workers: int) -> grain.IterDataset:
    return pipeline.make_dataset(
      digits_dir,
      batch_size=8,
      image_size=16,
      seed=1,
      shard_index=0,
      shard_count=1,
      performance=dict(num_threads=1, num_workers=workers),
    )

  expected = take(iter(dataset(0)), 12)  # workers only change where batches are made
  before = {p.pid for p in psutil.Process().children(recursive=True)}
  ds = dataset(2)
  it = iter(ds)
  assert_same_batches(take(it, 4), expected[:4])
  state = it.get_state()
  workers = spawned_workers(before)
  assert len(workers) == 2

  os.kill(workers[0].pid, signal.SIGKILL)
  start, served = time.monotonic(), []
  with pytest.raises(RuntimeError, match="terminated unexpectedly with exit code -9"):
    for _ in range(20):  # batches already in flight may still arrive
      served.append(next(it))
  assert time.monotonic() - start < 60
  assert_same_batches(served, expected[4 : 4 + len(served)])
  it.close()
  psutil.wait_procs(workers, timeout=30)
  assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)

  restarted = iter(ds)  # a fresh iterator, as after a restart from the checkpoint
  restarted.set_state(state)
  assert_same_batches(take(restarted, 4), expected[4:8])
  restarted.close()
  del it, restarted
  gc.collect()


# --- shards damaged after conversion --------------------------------------------------------


@pytest.fixture
def damaged(digits_dir, tmp_path) -> pathlib.Path:
  """A private copy of the converted digits, to be damaged by the test."""
  shutil.copytree(digits_dir, tmp_path / "data")
  return tmp_path / "data"


def flip_byte_in_record(data_dir: pathlib.Path, index: int) -> None:
  """Flips one bit in the middle of record `index` (uncompressed shards hold it verbatim)."""
  shard = data_dir / SHARD
  n = pipeline.load_manifest(data_dir).splits["validation"].num_records
  record = ShardedSource([shard], [n]).read([index])[0]
  data = bytearray(shard.read_bytes())
  at = data.find(record)
  assert at > 0 and data.find(record, at + 1) == -1
  data[at + len(record) // 2] ^= 0x08
  shard.write_bytes(bytes(data))


def eval_dataset(data, on_error="raise", verify="size", order=None) -> grain.IterDataset:
  return pipeline.make_dataset(
    data,
    "validation",
    verify=verify,
    batch_size=16,
    train=False,
    image_size=16,
    on_error=on_error,
    shard_index=0,
    shard_count=1,
    order=order,
    performance=dict(num_threads=1),
  )


def hashes(batches) -> list[str]:
  """One hash per real example, in order (eval images are a function of the record)."""
  return [
    hashlib.sha1(image.tobytes()).hexdigest()
    for b in batches
    for image, real in zip(b["image"], b["mask"], strict=True)
    if real
  ]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_truncated_shard_fails_its_first_read_naming_the_shard(damaged, on_error):
  """Not a bad record but a bad file: it raises whatever `on_error` says."""
  shard = damaged / SHARD
  os.truncate(shard, shard.stat().st_size * 2 // 3)
  with pytest.raises(manifest.ManifestError, match=SHARD):  # its size, checked at open
    eval_dataset(damaged, on_error)
  with pytest.raises(OSError, match=SHARD):  # unchecked: its first read (the open's probe)
    next(iter(eval_dataset(damaged, on_error, verify="none")))


def test_a_bit_flipped_record_is_never_served(damaged, digits_dir):
  """Riegeli hashes every chunk: a flipped bit is an error (or a skip), never other pixels."""
  truth = hashes(eval_dataset(digits_dir))
  flip_byte_in_record(damaged, 17)
  with pytest.raises((OSError, BadRecordError), match="hash mismatch"):
    list(eval_dataset(damaged, "raise"))
  try:
    served = hashes(eval_dataset(damaged, "skip"))
  except OSError:  # today: the corrupt chunk fails its whole batch even with "skip"
    return
  assert served == truth[:17] + truth[18:]


@pytest.mark.parametrize("order", ["global", "blocks"])  # blocks: read whole, then one by one
def test_a_bit_flipped_record_raises_naming_shard_and_index(damaged, order):
  flip_byte_in_record(damaged, 17)
  with pytest.raises(BadRecordError, match=f"{SHARD} record 17"):
    list(eval_dataset(damaged, "raise", order=order))


@pytest.mark.parametrize("order", ["global", "blocks"])
def test_a_bit_flipped_record_is_skipped_when_asked(damaged, order):
  flip_byte_in_record(damaged, 17)
  n = pipeline.load_manifest(damaged).splits["validation"].num_records
  assert len(hashes(eval_dataset(damaged, "skip", order=order))) == n - 1


@settings(
  max_examples=200,
  deadline=None,
  database=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(offset=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_in_a_shard_is_detected_or_harmless(
  digits_dir, tmp_path_factory, offset, bit
):
  """Where a bit flips (header, index, record, padding) the reader raises or reads true."""
  original = digits_dir / SHARD
  n = pipeline.load_manifest(digits_dir).splits["validation"].num_records
  truth = ShardedSource([original], [n]).read(range(n))
  data = bytearray(original.read_bytes())
  data[int(offset * len(data))] ^= 1 << bit
  copy = tmp_path_factory.mktemp("flip") / SHARD
  copy.write_bytes(bytes(data))
  try:
    source = ShardedSource([copy], [n])
    read = [source.read([i])[0] for i in range(n)]  # one by one: the index may be damaged
  except OSError as e:
    assert SHARD in str(e) and "Riegeli" in str(e)
    return
  assert read == truth
