"""A process whose mount stops answering exits: its one line, then it is gone, exit code and
all, while the mount still does not answer (no read thread joined at exit, no abort, no
worker process or shared memory left, no file open on the mount: it unmounts), at open,
while reading and while evaluating.

The mount is the storage rig (bench/rig.py) stalled as a dead gcsfuse connection: every
request waits, and one whose process dies is interrupted (the kernel holds a process until
the mount answers its requests in flight; gcsfuse answers an interrupted one at once).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tests.leftovers import clean_mount, descendants, outlived

DEADLINE_S = 3
HANG_S = DEADLINE_S + 60  # a hang detector, not a speed target

SCRIPT = textwrap.dedent(
  """
  import sys
  import pipeline
  from pipeline.host import shm
  from pipeline.storage import blockstore

  if __name__ == "__main__":
    data, split, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    perf = dict(record_cache_mb=0, read_deadline_s=%d, num_workers=workers)
    ds = pipeline.make_dataset(
      data, split, batch_size=4, image_size=16, train=split == "train", shard_index=0,
      shard_count=1, decoding=dict(cache_mb=0), performance=perf,
    )
    it = iter(ds)
    next(it), next(it)
    # what names its shared memory: its rings' tokens, its block stores'
    tokens = [*shm._TOKENS, *(made.peek()[2][0] for made in blockstore._MADE if made.alive)]
    print("read 2 batches:", *tokens, flush=True)
    sys.stdin.readline()  # the test stalls the mount, then says go on
    while True:  # the epochs of training, or evaluation after evaluation
      for _ in it:
        pass
      it = iter(ds)
  """
  % DEADLINE_S
)


def shm(tokens: list[str]) -> list[str]:
  """The files in /dev/shm named by `tokens` (other processes use it too)."""
  return [name for name in os.listdir("/dev/shm") if any(t in name for t in tokens)]


def start(args: list[str]) -> subprocess.Popen:
  return subprocess.Popen(
    args,
    cwd=REPO,
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,  # its session id names what it started
  )


def ended(proc: subprocess.Popen) -> tuple[int, list[str]]:
  """(exit code, stderr's lines) of `proc`, which must be gone within `HANG_S`, with
  nothing it started left."""
  try:
    _, err = proc.communicate(timeout=HANG_S)
  except subprocess.TimeoutExpired:
    left = descendants(proc.pid)
    os.killpg(proc.pid, 9)
    err = proc.communicate()[1]
    pytest.fail(f"alive {HANG_S} s after the mount stopped ({len(left)} it started): {err[-3000:]}")
  assert outlived(proc.pid) == [], "processes it started outlived it"
  return proc.returncode, [line for line in err.splitlines() if line.strip()]


def no_answer(lines: list[str], path: str) -> None:
  """The error's line is among `lines` (a traceback's last, before Grain's note)."""
  said = [line for line in lines if f"no answer within {DEADLINE_S} s" in line]
  assert len(said) == 1 and f"cannot read {path}" in said[0], "\n".join(lines[-40:])


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("split", ["train", "validation"])
def test_a_mount_that_stops_answering_mid_read_ends_the_process(
  storage_rig, photos_dir, tmp_path, split, workers
):
  script = tmp_path / "read.py"
  script.write_text(SCRIPT)
  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1)) as m:
    proc = start([sys.executable, str(script), str(m.path), split, str(workers)])
    said = proc.stdout.readline()
    assert said.startswith("read 2 batches:"), proc.communicate()[1][-3000:]
    tokens = said.split()[3:]
    with m.stall():
      proc.stdin.write("go on\n")
      proc.stdin.flush()
      code, lines = ended(proc)
  assert code == 1, lines[-20:]
  assert not any("terminate called" in line for line in lines), lines[-20:]
  no_answer(lines, f"{m.path}/{split}.array_record-")
  assert shm(tokens) == []


def test_a_mount_that_stops_answering_at_open_ends_the_process(storage_rig, photos_dir, tmp_path):
  script = tmp_path / "read.py"
  script.write_text(SCRIPT)
  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1)) as m, m.stall():
    proc = start([sys.executable, str(script), str(m.path), "train", "0"])
    code, lines = ended(proc)
  assert code == 1, lines[-20:]
  assert not any("terminate called" in line for line in lines), lines[-20:]
  no_answer(lines, f"{m.path}/manifest.json")


def test_a_mount_whose_stat_stops_answering_at_open_ends_the_process(
  storage_rig, photos_dir, tmp_path
):
  """Attributes the kernel keeps no time (gcsfuse without its stat cache): the manifest's
  stat itself waits, at open."""
  script = tmp_path / "read.py"
  script.write_text(SCRIPT)
  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1, attr_timeout_s=0)) as m:
    assert (m.path / "manifest.json").stat().st_size  # looked up once: now only its stat waits
    with m.stall(stats=True):
      code, lines = ended(start([sys.executable, str(script), str(m.path), "train", "0"]))
  assert code == 1, lines[-20:]
  assert not any("terminate called" in line for line in lines), lines[-20:]
  no_answer(lines, f"{m.path}/manifest.json")


def trainer(workdir: pathlib.Path, data_dir) -> subprocess.Popen:
  """`python -m train` on `data_dir` (digits), long enough to be stalled mid-run."""
  args = [
    *(sys.executable, "-m", "train", "--config", str(REPO / "configs/default.py")),
    *(f"--workdir={workdir}", f"--config.input.data_dir={data_dir}", "--config.batch_size=16"),
    *("--config.num_steps=100000", "--config.log_every=1", "--config.synthetic_steps=1"),
    *("--config.input.performance.record_cache_mb=0", "--config.input.decoding.cache_mb=0"),
    f"--config.input.performance.read_deadline_s={DEADLINE_S}",
  ]
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  return start(args)


def test_the_trainer_on_a_mount_that_stops_answering_at_open_exits_2_in_one_line(
  storage_rig, digits_dir, tmp_path
):
  with clean_mount(storage_rig.mount(digits_dir, latency_ms=1)) as m, m.stall():
    code, lines = ended(trainer(tmp_path / "w", m.path))
  assert code == 2, lines[-20:]
  assert len(lines) == 1 and lines[0].startswith("python -m train: "), "\n".join(lines[-30:])
  no_answer(lines, f"{m.path}/manifest.json")


@pytest.mark.slow
def test_the_trainer_on_a_mount_that_stops_answering_mid_run_exits_1_in_one_line(
  storage_rig, digits_dir, tmp_path
):
  with clean_mount(storage_rig.mount(digits_dir, latency_ms=1)) as m:
    proc = trainer(tmp_path / "w", m.path)
    for line in proc.stdout:
      if "step" in line and " 2" in line.split("step", 1)[1][:10]:
        break
    with m.stall():
      code, lines = ended(proc)
  assert code == 1, lines[-20:]
  said = [line for line in lines if line.startswith("python -m train: ")]
  assert len(said) == 1 and "Traceback" not in "\n".join(lines), "\n".join(lines[-40:])
  no_answer(said, f"{m.path}/train.array_record-")


def on_the_mount(data, mount: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
  """A local copy of `data`'s manifest.json beside links to its shards on `mount`: the manifest
  answers, the shards' bytes wait where the mount stalls."""
  local = tmp_path / "local"
  local.mkdir()
  (local / "manifest.json").write_bytes((data / "manifest.json").read_bytes())
  for shard in data.glob("*.array_record-*"):
    (local / shard.name).symlink_to(mount / shard.name)
  return local


@pytest.mark.parametrize(
  "keywords",
  ["verify='sha256'", "features=dict(name='image/filename')"],
  ids=["checking_every_byte", "reading_a_features_sample"],
)
def test_a_mount_that_stops_answering_after_the_manifest_at_open_ends_the_process(
  storage_rig, photos_dir, tmp_path, keywords
):
  script = tmp_path / "open.py"
  script.write_text(
    "import sys, pipeline\n"
    "if __name__ == '__main__':\n"
    "  pipeline.make_dataset(sys.argv[1], batch_size=4, shard_count=1, shard_index=0,\n"
    f"    {keywords}, performance=dict(read_deadline_s={DEADLINE_S}, num_workers=0))\n"
  )
  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1)) as m, m.stall():
    local = on_the_mount(photos_dir, m.path, tmp_path)
    code, lines = ended(start([sys.executable, str(script), str(local)]))
  assert code == 1, lines[-20:]
  assert not any("terminate called" in line for line in lines), lines[-20:]
  no_answer(lines, f"{local}/train.array_record-")


def test_shards_linked_from_a_mount_whose_stats_stop_answering_end_the_process_at_open(
  storage_rig, photos_dir, tmp_path
):
  """Which storage holds a linked shard is found without a look-up on the mount (its
  lookups wait too): the shard's stat then waits at most the deadline."""
  script = tmp_path / "open.py"
  script.write_text(
    "import sys, pipeline\n"
    "if __name__ == '__main__':\n"
    "  pipeline.make_dataset(sys.argv[1], batch_size=4, shard_count=1, shard_index=0,\n"
    f"    performance=dict(read_deadline_s={DEADLINE_S}, num_workers=0))\n"
  )
  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1)) as m, m.stall(stats=True):
    local = on_the_mount(photos_dir, m.path, tmp_path)
    code, lines = ended(start([sys.executable, str(script), str(local)]))
  assert code == 1, lines[-20:]
  no_answer(lines, f"{local}/train.array_record-")


def test_convert_verify_on_a_mount_that_stops_answering_exits_in_one_line(storage_rig, photos_dir):
  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1)) as m, m.stall():
    verify = ["verify", str(m.path), f"--read-deadline-s={DEADLINE_S}"]
    proc = start([sys.executable, "-m", "pipeline.convert", *verify])
    code, lines = ended(proc)
  assert code != 0 and len(lines) == 1, lines[-20:]
  no_answer(lines, f"{m.path}/manifest.json")


@pytest.mark.parametrize("workers", [1, 2])
def test_convert_verify_on_shards_that_stop_answering_exits_2_in_one_line(
  storage_rig, photos_dir, tmp_path, workers
):
  """The manifest answers; the shards' reads, in verify's worker processes too, wait at most
  --read-deadline-s."""
  with clean_mount(storage_rig.mount(photos_dir, latency_ms=1)) as m, m.stall():
    local = on_the_mount(photos_dir, m.path, tmp_path)
    verify = ["verify", str(local), f"--read-deadline-s={DEADLINE_S}", f"--workers={workers}"]
    code, lines = ended(start([sys.executable, "-m", "pipeline.convert", *verify]))
  assert code == 2 and len(lines) == 1, lines[-20:]
  no_answer(lines, f"{local}/")
