"""The worker hand-off (pipeline/stages/handoff.py): batches written once into a reused ring of
shared-memory blocks (pipeline/host/shm.py), read in place, never overwritten while you hold
them, nothing left behind."""

from __future__ import annotations

import gc
import glob
import json
import os
import subprocess
import sys

import grain
import numpy as np
import pytest

from pipeline.host import shm
from pipeline.stages import handoff
from tests.conftest import REPO


def _batches(n: int, rows: int = 4, side: int = 160) -> list[dict]:
  rng = np.random.default_rng(0)
  return [
    {
      "image": rng.integers(0, 256, (rows, side, side, 3), np.uint8),
      "label": np.arange(rows, dtype=np.int32) + k,
      "_skipped": np.int64(k),
    }
    for k in range(n)
  ]


def _through_ring(batches: list[dict], writer: shm.Writer):
  """Send and Receive in one process: the two ends of the hand-off without Grain's queue."""
  ds = grain.MapDataset.source(batches).to_iter_dataset()
  return iter(handoff.ReceiveIterDataset(handoff.SendIterDataset(ds, writer)))


def _mine(writer: shm.Writer) -> list[str]:
  return glob.glob(f"{shm.SHM_DIR}/{shm.PREFIX}-{writer.token}-*")


def test_batches_arrive_whole_and_the_ring_reuses_its_blocks():
  writer = shm.Writer.new()
  batches = _batches(12)
  it = _through_ring(batches, writer)
  for want in batches:
    got = next(it)
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
    assert isinstance(got["image"].base.base, shm._Lease)  # a view: read in place
    del got
  assert len(writer.ring().blocks) <= 2  # each batch dropped before the next: reused
  assert not _mine(writer)  # names are unlinked once mapped


def test_a_batch_you_keep_is_never_overwritten():
  writer = shm.Writer.new()
  batches = _batches(10)
  it = _through_ring(batches, writer)
  kept = [next(it) for _ in range(10)]
  for got, want in zip(kept, batches):
    np.testing.assert_array_equal(got["image"], want["image"])
  assert len(writer.ring().blocks) == 10  # the ring grew instead
  del kept, got
  gc.collect()
  assert all(b.words[0] == shm.FREE for b in writer.ring().blocks)


def test_an_image_array_made_in_the_ring_is_sent_without_a_copy():
  writer = shm.Writer.new()
  image = writer.empty((4, 160, 160, 3), np.uint8)
  image[...] = 7
  ring = writer.ring()
  block = ring.find(image)
  assert block is not None and block.words[0] == shm.TAKEN
  it = _through_ring([{"image": image}], writer)
  got = next(it)
  assert len(ring.blocks) == 1 and (got["image"] == 7).all()


def test_reused_memory_under_a_batch_is_an_error_not_a_silent_wrong_batch():
  writer = shm.Writer.new()
  sent = handoff.SendIterDataset(grain.MapDataset.source(_batches(1)).to_iter_dataset(), writer)
  descriptor = next(iter(sent))
  writer.ring().blocks[0].words[1] += 1  # as if the worker had reused the block
  received = iter(
    handoff.ReceiveIterDataset(grain.MapDataset.source([descriptor]).to_iter_dataset())
  )
  with pytest.raises(shm.HandoffError, match="reused before it was read"):
    next(received)


def test_a_missing_block_is_a_handoff_error_naming_it():
  writer = shm.Writer.new()
  sent = handoff.SendIterDataset(grain.MapDataset.source(_batches(1)).to_iter_dataset(), writer)
  descriptor = next(iter(sent))
  path = writer.ring().blocks[0].path
  os.unlink(path)  # as a cleanup of /dev/shm by something else would
  received = iter(
    handoff.ReceiveIterDataset(grain.MapDataset.source([descriptor]).to_iter_dataset())
  )
  with pytest.raises(shm.HandoffError, match=f"block {path} is gone") as e:
    next(received)
  assert "\n" not in str(e.value)


CHILD = """
import glob, json, os, sys
import numpy as np
import pipeline
from pipeline.host import lifecycle, shm
from pipeline.stages import handoff

def main():
  ds = pipeline.make_dataset(sys.argv[1], batch_size=8, image_size=64, shard_index=0,
                             shard_count=1, performance=dict(num_workers=2, num_threads=1))
  it = iter(ds)
  kept = [next(it) for _ in range(6)]
  copies = [b["image"].copy() for b in kept]
  for _ in range(40):
    next(it)
  same = all((b["image"] == c).all() for b, c in zip(kept, copies))
  receiver = next(n for n in lifecycle.iterators(it) if isinstance(n, handoff._ReceiveIterator))
  print(json.dumps({"same": bool(same), "blocks": len(receiver.reader.blocks),
                    "tokens": sorted(shm._TOKENS)}))
  # exits with batches unsent and the iterator open: the exit path must clean up
  return kept

if __name__ == "__main__":
  held = main()  # a module global: released as the interpreter tears its modules down
"""


def test_workers_leave_nothing_behind_and_print_no_warning(digits_dir, tmp_path):
  """46 batches from 2 worker processes; 6 kept to the end stay intact; the process exits
  with batches unsent, its iterator open and batches held in a module global."""
  script = tmp_path / "child.py"
  script.write_text(CHILD)
  grain_blocks = set(glob.glob("/dev/shm/psm_*"))
  proc = subprocess.run(
    [sys.executable, str(script), str(digits_dir)],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["same"]  # kept batches were never overwritten by later ones
  assert out["blocks"] <= 24  # 46 batches through a reused ring (6 kept + what is in flight)
  for noise in ("leaked", "Traceback", "Exception ignored"):
    assert noise not in proc.stderr, proc.stderr
  assert out["tokens"] and not [
    path for token in out["tokens"] for path in glob.glob(f"/dev/shm/{shm.PREFIX}-{token}-*")
  ]
  assert set(glob.glob("/dev/shm/psm_*")) <= grain_blocks  # nor any block of Grain's
