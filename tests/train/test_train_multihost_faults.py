"""Issue 37's faults in the trainer as two hosts of a pod slice
(tests/train/test_train_multihost.py's `Run`): a checkpoint resumed over a reordered shard list is
refused on both hosts and kept (row 1); a stalled mount on one host ends that host in one line
naming the shard, and the other host too (row 3); a cut metrics.jsonl is set aside with one warning
and the re-run finishes (row 4); blocks past every shard train (row 5: the hosts deal the blocks
out). Row 2 (TFDS metadata) is a check every host makes at open as one process does
(tests/catalog/test_tfds_folder.py); an error at open is one line on every host
(`train.hosts.agree`).
"""

import json
import re
import shutil
import subprocess

import pytest

from pipeline.convert import images
from tests.leftovers import clean_mount
from tests.train.test_train_multihost import VALIDATION, Run, own_lines, summary

pytestmark = pytest.mark.slow  # two trainer processes a test: `make test-slow`

STEPS = ("--config.checkpoint_every_steps=2",)


@pytest.fixture(scope="module")
def sharded(digits_raw, tmp_path_factory):
  """The digits converted into shards of 0.1 MB: several a split."""
  out = tmp_path_factory.mktemp("sharded") / "data"
  images.convert(
    images.Request(digits_raw, out, val_fraction=0.2, seed=0, shard_size_mb=0.1),
    workers=1,
    progress=False,
  )
  return out


@pytest.fixture(scope="module")
def finished(sharded, tmp_path_factory):
  """A 4-step run of two processes with checkpoints at steps 2 and 4."""
  tmp = tmp_path_factory.mktemp("finished")
  run = Run(tmp, tmp / "w", sharded, *STEPS, steps=4)
  assert run.wait(timeout=400) == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
  return tmp / "w"


def interrupted_copy(finished, tmp_path):
  """The finished run as if killed before its final eval: checkpoints, no summary."""
  workdir = tmp_path / "w"
  shutil.copytree(finished, workdir)
  (workdir / "summary.json").unlink()
  return workdir


def test_a_checkpoint_resumed_over_a_reordered_shard_list_is_refused_on_both_hosts_and_kept(
  finished, sharded, tmp_path
):
  workdir = interrupted_copy(finished, tmp_path)
  reordered = tmp_path / "reordered"  # the same files, the same total, another order
  shutil.copytree(sharded, reordered)
  meta = json.loads((reordered / "manifest.json").read_text())
  shards = meta["splits"]["train"]["shards"]
  assert len(shards) > 1
  shards.reverse()
  (reordered / "manifest.json").write_text(json.dumps(meta))
  run = Run(tmp_path, workdir, reordered, *STEPS, steps=4)
  codes = run.wait(timeout=300)
  for i in range(2):
    out = run.output(i)
    assert codes[i] == 2 and "Traceback" not in out, out[-3000:]
    assert own_lines(out) == [
      f"python -m train: checkpoint 4 in {workdir / 'checkpoints'} is good, but this run "
      "cannot continue its data: iterator state of another shard list (the same "
      f"{len(shards)} shards in another order): its positions are records of the shards it "
      "was saved with; keep their list (the manifest's, in its order) or start without the "
      "state"
    ]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]
  assert not (workdir / "unrestorable").exists() and not (workdir / "summary.json").exists()


def test_a_cut_metrics_file_is_set_aside_with_one_warning_and_the_rerun_finishes(
  finished, sharded, tmp_path
):
  workdir = interrupted_copy(finished, tmp_path)
  metrics = workdir / "metrics.jsonl"
  rows = metrics.read_text().count("\n")
  cut = metrics.read_bytes()[:-20]  # a kill or a full disk mid-write
  metrics.write_bytes(cut)
  run = Run(tmp_path, workdir, sharded, *STEPS, steps=4)
  assert run.wait(timeout=300) == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
  warning = (
    f"warning: {metrics} line {rows} is not a metrics row: moved it to {metrics}.damaged and "
    "began anew"
  )
  outputs = [run.output(i) for i in range(2)]
  assert [out.splitlines().count(warning) for out in outputs] == [1, 0], outputs[0][-3000:]
  assert not any("Traceback" in out for out in outputs)
  assert "resumed from step 4" in outputs[0]
  assert (workdir / "metrics.jsonl.damaged").read_bytes() == cut
  assert summary(workdir)["steps"] == 4


def test_blocks_past_every_shard_train_on_two_hosts_as_blocks_of_a_shard(sharded, tmp_path):
  """block_records and window_blocks of 2**40 (row 5: no answer in 120 s, 8.5 GB): each
  block is a shard, dealt out to the hosts; every validation record evaluated once."""
  huge = 2**40
  run = Run(
    tmp_path,
    tmp_path / "w",
    sharded,
    "--config.input.order=blocks",
    f"--config.input.block_records={huge}",
    f"--config.input.window_blocks={huge}",
    steps=2,
  )
  assert run.wait(timeout=300) == [0, 0], run.output(0)[-3000:] + run.output(1)[-3000:]
  assert summary(tmp_path / "w")["eval_examples"] == VALIDATION


def test_a_stalled_mount_on_one_host_ends_it_in_one_line_naming_the_shard_and_the_other_too(
  storage_rig, sharded, tmp_path
):
  """Each host reads `data` through its own mount of the dataset, as every host of a pod
  mounts the bucket at the same path; host 1's stops answering mid-run. Host 1 says so in
  one line naming itself and leaves, telling host 0 (waiting for it in a collective), which
  prints the same line and leaves too. Host 1 leaves while its mount still stalls, its reads
  left blocked (tests/faults/test_stalled_exit.py); no file is left open on either mount."""
  hosts = [tmp_path / f"host{i}" for i in range(2)]
  with (
    clean_mount(storage_rig.mount(sharded, latency_ms=1, mountpoint=hosts[0] / "data")),
    clean_mount(storage_rig.mount(sharded, latency_ms=1, mountpoint=hosts[1] / "data")) as stalled,
  ):
    run = Run(
      tmp_path,
      tmp_path / "w",
      "data",  # each host's own mount, at the same path
      "--config.checkpoint_every_steps=1000",
      "--config.input.performance.read_deadline_s=3",
      "--config.input.decoding.cache_mb=0",  # every epoch reads storage again
      "--config.input.performance.record_cache_mb=0",
      steps=400,
      cwd=hosts,
    )
    run.wait_for("step      2")
    with stalled.stall():
      try:
        run.procs[0].wait(timeout=240)  # exited, not hung
      except subprocess.TimeoutExpired:
        run.wait(timeout=0)  # fails the test with host 0's output, ending both
      stalled_line = own_lines(run.output(1))
    codes = run.wait(timeout=60)
  assert len(stalled_line) == 1, run.output(1)[-3000:]
  assert re.fullmatch(
    r"python -m train: process 1 failed: cannot read data/train\.array_record-\d{5}-of-\d{5}: "
    r"no answer within "
    r"3 s: check the mount \(gcsfuse: its log and its connection\) "
    r"\(performance\.read_deadline_s sets the wait\)",
    stalled_line[0],
  )
  assert codes == [1, 1] and not any("Traceback" in run.output(i) for i in range(2))
  assert own_lines(run.output(1)) == stalled_line
  assert own_lines(run.output(0)) == stalled_line, run.output(0)[-3000:]
