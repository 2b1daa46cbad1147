"""`python -m pipeline.convert`: every user error is one line (exit status 2 for usage
errors), tracebacks only with --verbose; a progress bar only on a terminal."""

from __future__ import annotations

import fcntl
import os
import pathlib
import pty
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from pipeline.catalog import manifest
from pipeline.convert import __main__ as cli
from pipeline.convert import verify
from tests.conftest import REPO, run_command
from tests.faults import test_stalled_exit as stalled

CONVERT = [sys.executable, "-m", "pipeline.convert"]


def main(capsys, *args) -> tuple[int, str, str]:
  try:
    code = cli.main([str(a) for a in args])
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def convert_photos(photos_raw, tmp_path) -> list[str]:
  """The command line that converts the photos into tmp_path/out, 64 files in several shards."""
  out = str(tmp_path / "out")
  return [*CONVERT, "images", str(photos_raw), out, "--shard-size-mb", "0.2", "--workers", "1"]


def one_line(text: str) -> str:
  assert "Traceback" not in text
  lines = text.strip().splitlines()
  assert len(lines) == 1, text
  return lines[0]


@pytest.fixture
def damaged(photos_dir, tmp_path) -> pathlib.Path:
  data = shutil.copytree(photos_dir, tmp_path / "damaged")
  text = (data / manifest.FILENAME).read_text()
  (data / manifest.FILENAME).write_text(text[: len(text) // 2])
  return data


@pytest.mark.parametrize(
  "args, message",
  [
    ([], "the following arguments are required: command"),
    (["images"], "the following arguments are required: src, out"),
    (["images", "{tmp}/nope", "{tmp}/out"], "image folder {tmp}/nope not found"),
    (["images", "{photos}", "{tmp}/out", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["images", "{photos}", "{photos}"], "must not be the image folder"),
    (["tfrecord", "{tmp}/nope-*", "{tmp}/out", "--num-classes", "3"], "no TFRecord files match"),
    (["tfrecord", "{tmp}/x", "{tmp}/out", "--num-classes", "0"], "--num-classes: 0 is outside"),
    (["tfrecord", "{tmp}/a_file", "{tmp}/out", "--classes", "{tmp}/none.txt"], "none.txt"),
    (["tfds", "mnist", "{tmp}/out", "--data-dir", "{tmp}/nope"], "TFDS data dir {tmp}/nope"),
    (["verify", "{tmp}/nope"], "{tmp}/nope/manifest.json not found"),
    (["verify", "{photos}", "--workers", "-1"], "--workers: -1 is outside"),
    (["builtin", "{tmp}/a_file"], "{tmp}/a_file is a file, not a folder"),
    (["images", "{tmp}/a_file", "{tmp}/out"], "{tmp}/a_file is a file, not an image folder"),
    (["verify", "{tmp}/a_file"], "{tmp}/a_file is a file, not a dataset folder"),
  ],
)
def test_usage_errors_are_one_line_with_exit_status_2(photos_raw, tmp_path, capsys, args, message):
  (tmp_path / "a_file").write_text("not a folder")
  fill = {"tmp": tmp_path, "photos": photos_raw}
  code, out, err = main(
    capsys, *[a.format(**fill) for a in args], *(["--no-progress"] if args else [])
  )
  assert code == 2
  assert message.format(**fill) in one_line(err)


@pytest.mark.parametrize(
  "runner, missing, dist",
  [
    ("DaskRunner", "distributed", "apache-beam[dask]"),
    ("DirectRunner", "apache_beam", "apache-beam"),
    ("DataflowRunner", "apache_beam", "apache-beam"),
  ],
)
def test_a_missing_engine_is_one_line_naming_its_environment_and_leaves_nothing(
  photos_raw, tmp_path, capsys, monkeypatch, runner, missing, dist
):
  # As in the main .venv, which has no Beam: its extra caps versions the main one exceeds.
  monkeypatch.setitem(sys.modules, missing, None)
  for command in (["images", photos_raw], ["tfrecord", photos_raw / "*", "--num-classes", "4"]):
    out = tmp_path / "out"
    code, _, err = main(capsys, *command[:2], out, *command[2:], "--runner", runner)
    assert code == 2
    assert one_line(err) == (
      f"error: convert {command[0]} --runner {runner} needs {dist} (No module named "
      f"{missing!r}), which caps pillow, protobuf and pyarrow below this environment's "
      "versions, so it has its own: `make test-beam` creates .venv-beam (and runs the Beam "
      "tests); then run .venv-beam/bin/python -m pipeline.convert"
    )
    assert not out.exists()  # no .convert-build left behind


def test_verify_of_a_damaged_manifest_is_one_line_with_exit_status_1(damaged, capsys):
  code, out, err = main(capsys, "verify", damaged, "--no-progress")
  assert code == 1
  assert f"{damaged / manifest.FILENAME} is not valid JSON" in one_line(out)


def test_in_a_new_process_too_and_verbose_shows_the_traceback(tmp_path):
  args = [*CONVERT, "images", str(tmp_path / "nope"), str(tmp_path / "out"), "--no-progress"]
  plain = run_command(args, timeout=120)
  assert plain.returncode == 2
  assert one_line(plain.stderr) == f"error: image folder {tmp_path / 'nope'} not found"
  verbose = run_command(args + ["--verbose"], timeout=120)
  assert verbose.returncode != 0
  assert "Traceback" in verbose.stderr and "FileNotFoundError" in verbose.stderr


def test_progress_is_a_line_per_tenth_when_not_on_a_terminal(photos_raw, tmp_path):
  result = run_command(convert_photos(photos_raw, tmp_path))
  assert result.returncode == 0, result.stderr
  assert "\r" not in result.stderr
  lines = result.stderr.strip().splitlines()
  assert 2 <= len(lines) <= 10 and lines[-1] == "convert raw: 100% (64/64 files)", lines
  assert all(line.startswith("convert raw: ") and "%" in line for line in lines)


def test_progress_is_a_bar_on_a_terminal(photos_raw, tmp_path):
  controller, terminal = pty.openpty()
  fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, cols
  child = subprocess.Popen(
    convert_photos(photos_raw, tmp_path), cwd=REPO, stdout=subprocess.DEVNULL, stderr=terminal
  )
  os.close(terminal)
  shown = b""
  while True:
    try:
      chunk = os.read(controller, 4096)
    except OSError:  # the terminal closed: the process is done
      break
    if not chunk:
      break
    shown += chunk
  os.close(controller)
  assert child.wait(timeout=300) == 0
  assert b"\r" in shown and b"64/64" in shown and b"100%|" in shown
  assert b"(64/64 files)" not in shown  # no log lines on a terminal


def _forkserver_started(pid: int) -> bool:
  """Whether process `pid` has started the server its workers fork from and answers SIGINT
  again (it ignores it while the server starts: a few ms)."""
  status = pathlib.Path(f"/proc/{pid}/status").read_text()
  ignored = int(status.split("SigIgn:")[1].split()[0], 16)
  if ignored & (1 << (signal.SIGINT - 1)):
    return False
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
        if b"forkserver" in (stat.parent / "cmdline").read_bytes():
          return True
    except (OSError, ValueError, IndexError):
      continue
  return False


@pytest.mark.slow
def test_ctrl_c_while_workers_start_is_one_line_and_the_same_command_resumes(photos_raw, tmp_path):
  args = convert_photos(photos_raw, tmp_path)[:-1] + ["2"]
  child = subprocess.Popen(
    args, cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True
  )
  deadline = time.monotonic() + 120
  while not _forkserver_started(child.pid) and child.poll() is None and time.monotonic() < deadline:
    time.sleep(0.01)
  os.killpg(child.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
  _, err = child.communicate(timeout=120)
  lines = [line for line in err.splitlines() if not line.startswith("convert raw: ")]
  assert child.returncode == 130, err
  assert lines == ["interrupted: finished shards are kept; re-run the same command to resume"]
  assert run_command(args).returncode == 0
  assert verify.verify(tmp_path / "out", progress=False).ok


CTRL_C_AS_THE_SERVER_STARTS = """
import multiprocessing.util, os, signal
from pipeline.convert import shards

spawn = multiprocessing.util.spawnv_passfds

def spawn_then_ctrl_c(*args):
  pid = spawn(*args)  # the server the workers fork from, starting
  os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C, to the whole process group, now
  return pid

if __name__ == "__main__":
  multiprocessing.util.spawnv_passfds = spawn_then_ctrl_c
  print(list(shards.ordered_map(abs, [-1, -2, -3], 2)))
"""


def test_ctrl_c_as_the_workers_server_starts_interrupts_and_leaves_no_process(tmp_path):
  """A Ctrl-C in the few ms the server the workers fork from takes to start is answered
  (it was ignored there, and the work went on), by this process alone."""
  script = tmp_path / "ctrl_c.py"
  script.write_text(CTRL_C_AS_THE_SERVER_STARTS)
  child = subprocess.Popen(
    [sys.executable, str(script)],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,  # its own process group, and a session naming what it starts
  )
  out, err = child.communicate(timeout=120)
  assert child.returncode in (130, -signal.SIGINT) and out == "", (out, err[-3000:])
  assert err.strip().splitlines()[-1] == "KeyboardInterrupt", err[-3000:]
  for _ in range(100):  # the server goes once its parent is gone
    if not stalled.descendants(child.pid):
      break
    time.sleep(0.1)
  assert stalled.descendants(child.pid) == []
