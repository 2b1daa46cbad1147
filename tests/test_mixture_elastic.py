"""A mixture in the block order resumed in another layout: on another process count, or with a
source added or removed (which changes the others' windows). Each source reads every record of
its interrupted epoch once across the resume, in blocks, then its next epochs as a fresh run
in the new layout reads them (`pipeline.mixing.stream`).

Each process of a layout is its own `make_dataset` (threads) with its shard_index; a global
batch of 24 keeps the mixture's windows. Which record each slot holds is read from the batches
(each record's file name), its epoch from the stream's order."""

from __future__ import annotations

import numpy as np
import pytest

import pipeline
from tests.conftest import take

GLOBAL = 24
FILE = {"file": "image/filename"}


@pytest.fixture(scope="module")
def dirs(digits_dir, photos_dir) -> dict:
  return {"digits": digits_dir, "photos": photos_dir, "more": digits_dir}


def mixture(dirs: dict, names: str, p: int, n: int):
  """Process `p` of `n` of the mixture of the sources `names` (weights 1:2:1), blocks of 4."""
  sources = {name: dirs[name] for name in names.split()}
  weights = {"digits": 1, "photos": 2, "more": 1}
  return pipeline.make_dataset(
    sources,
    "train",
    weights={name: weights[name] for name in sources},
    features=FILE,
    batch_size=GLOBAL // n,
    image_size=16,
    seed=3,
    order="blocks",
    block_records=4,
    shard_index=p,
    shard_count=n,
    performance=dict(num_workers=0, record_cache_mb=0),
  )


def all_files(data_dir) -> list:
  """Every record's file name (one eval pass)."""
  ds = pipeline.make_dataset(
    data_dir, "train", train=False, batch_size=300, image_size=16, features=FILE
  )
  batch = next(iter(ds))
  return sorted(batch["file"][batch["mask"]].tolist())


def uses(its: list, batches: list, name: str) -> list[tuple[np.ndarray, np.ndarray]]:
  """Each process's (epoch, file) of each use of source `name` in its `batches`: the files
  from the batches, the epochs from the process's order of that source."""
  out = []
  for it, taken in zip(its, batches, strict=True):
    s = it.mixture.names.index(name)
    files = np.concatenate([b["file"][b["source"] == s] for b in taken])
    epochs, _ = it.mixture.sampler.samplers[s].records(np.arange(len(files)))
    out.append((epochs, files))
  return out


def resumed_state(dirs, was: str, n: int, now: str, m: int, capfd) -> tuple:
  """Reads 7 batches on `n` processes of the sources `was`, restores the state into `m`
  processes of the sources `now`, reads 48 batches there (past every source's interrupted
  epoch: the digits' 40 batches): (the iterators and batches before, after, the line said,
  the state)."""
  before = [iter(mixture(dirs, was, p, n)) for p in range(n)]
  first = [take(it, 7) for it in before]
  state = before[-1].get_state()
  capfd.readouterr()
  after = [iter(mixture(dirs, now, p, m)) for p in range(m)]
  for it in after:
    it.set_state(state)
  said = [line for line in capfd.readouterr().err.splitlines() if "mixture resumed" in line]
  assert len(said) == m and len(set(said)) == 1  # one line a process
  return (before, first), (after, [take(it, 48) for it in after]), said[0], state


def assert_every_record_once(dirs, name: str, before, after) -> int:
  """Source `name`'s interrupted epoch (the one the new processes begin in) read whole across
  the resume, each record once; returns that epoch."""
  was, now = uses(*before, name), uses(*after, name)
  epoch = min(int(e[0]) for e, _ in now)
  assert all(int(e[-1]) > epoch for e, _ in now)  # every process read past it
  taken = np.concatenate([f[e == epoch] for e, f in was + now])
  assert sorted(taken.tolist()) == all_files(dirs[name])
  return epoch


def assert_next_epochs_fresh(its, name: str, epoch: int, fresh: list) -> None:
  """Source `name`'s next epochs in each of the processes `its` as in `fresh`, the iterators
  of a fresh run of the new layout."""
  for it, new in zip(its, fresh, strict=True):
    resumed = it.mixture.sampler.samplers[it.mixture.names.index(name)]
    own = new.mixture.sampler.samplers[new.mixture.names.index(name)]
    assert resumed.resumed and not own.resumed
    for later in (epoch + 1, epoch + 2):
      got = [
        s.records(np.arange(s.epoch_start(later), s.epoch_start(later + 1))) for s in (resumed, own)
      ]
      np.testing.assert_array_equal(got[0][1], got[1][1])
      assert (got[0][0] == later).all()


@pytest.mark.parametrize("n, m", [(3, 2), (2, 3)])
def test_a_block_order_mixture_continues_on_another_count_each_source_once(dirs, capfd, n, m):
  names = "digits photos more"
  before, after, said, saved = resumed_state(dirs, names, n, names, m, capfd)
  assert f"read on {n} process(es) x batch {GLOBAL // n}" in said
  assert f"now on {m} process(es) x batch {GLOBAL // m}" in said
  assert "other global batches than the uninterrupted run's" in said
  fresh = [iter(mixture(dirs, names, p, m)) for p in range(m)]
  for name in names.split():
    epoch = assert_every_record_once(dirs, name, before, after)
    assert_next_epochs_fresh(after[0], name, epoch, fresh)
  state = after[0][0].get_state()  # names each source's earlier layout: resumes on its count
  used = saved["mixture"]["used"]["photos"]
  assert state["mixture"]["resumed"]["photos"] == [[n, 1, used, 96 // 3]]
  again = iter(mixture(dirs, names, 0, m))
  again.set_state(state)
  assert again.mixture.sampler.samplers[1] == after[0][0].mixture.sampler.samplers[1]
  expected = take(after[0][0], 2)
  got = take(again, 2)
  for x, y in zip(expected, got, strict=True):
    np.testing.assert_array_equal(x["file"], y["file"])


@pytest.mark.parametrize(
  "was, now", [("digits photos", "digits photos more"), ("digits photos more", "photos digits")]
)
def test_a_source_added_or_removed_the_others_read_each_record_once(dirs, capfd, was, now):
  before, after, said, _ = resumed_state(dirs, was, 2, now, 2, capfd)
  windows = [96 // len(x.split()) for x in (was, now)]
  assert f"read on 2 process(es) x batch 12 in windows of {windows[0]} blocks a source" in said
  assert f"in windows of {windows[1]}" in said
  kept = [name for name in now.split() if name in was.split()]
  assert said.count(", ".join(kept) + ":") == 1
  for name in kept:
    assert_every_record_once(dirs, name, before, after)
