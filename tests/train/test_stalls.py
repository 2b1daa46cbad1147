"""A host that did not run (SIGSTOP, a paused VM, a swap storm) for seconds and then went on:
its own watchdog measures the stall and the step it was at, and process 0's log names it, as
the others spent that time waiting for it in a collective, not for input."""

import os
import pathlib
import signal
import subprocess
import sys
import time

from tests.train.test_train import ROOT, env
from train import podview, stalls
from train.podview import Host

TICK_S = 0.1
CHILD = f"""
import sys
from train import stalls
with stalls.Watchdog(tick_s={TICK_S}) as watchdog:
  print("ready", flush=True)
  for line in sys.stdin:
    if line.startswith("step "):
      watchdog.step = int(line.split()[1])
    print(*watchdog.take(), flush=True)
"""


def all_stopped(pid: int) -> bool:
  """Whether every thread of process `pid` is stopped (state T in /proc)."""
  tasks = pathlib.Path(f"/proc/{pid}/task").iterdir()
  return all((t / "stat").read_text().rpartition(")")[2].split()[0] == "T" for t in tasks)


def test_a_process_stopped_and_continued_records_the_stall_and_its_step():
  child = subprocess.Popen(
    [sys.executable, "-c", CHILD],
    cwd=ROOT,
    env=env(),
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )

  def ask(line: str) -> tuple[float, int]:
    child.stdin.write(line + "\n")
    child.stdin.flush()
    seconds, step = child.stdout.readline().split()
    return float(seconds), int(step)

  try:
    assert child.stdout.readline() == "ready\n"
    ask("step 6")  # what it recorded while starting: left out
    os.kill(child.pid, signal.SIGSTOP)
    while not all_stopped(child.pid):
      time.sleep(0.01)
    stopped = time.monotonic()  # no thread of the child runs from here...
    time.sleep(2.0)
    continued = time.monotonic()  # ...to here
    os.kill(child.pid, signal.SIGCONT)
    seconds, step = ask("take")
    # it last woke before the stop, so it was due at most one tick after it
    assert seconds >= continued - stopped - TICK_S
    assert step == 6
    again, _ = ask("take")
    assert again < seconds  # taken: the next window starts anew
    child.stdin.close()
    assert child.wait(timeout=30) == 0  # the thread stops with the run: nothing left at exit
  finally:
    child.kill()
    child.wait()


def test_process_0_names_a_host_that_did_not_run_with_its_step():
  """From the figures as every process gathers them at a log line (one process here: its own
  row) and as a run keeps them (`podview.mean`)."""
  (alone,) = podview.gather(120.0, 0.0, 4.0, 300.0, (7.5, 6))
  assert (alone.stall_s, alone.stall_step) == (7.5, 6)
  assert podview.stalled([alone]) == [
    "this process did not run for 7.5 s around step 6 (stopped or starved of CPU)"
  ]
  hosts = [Host(0, 100.0, 0.0, 0, 0, stalls.STALL_S - 0.5, 3), Host(1, 50.0, 0.0, 0, 0, 40.2, 6)]
  assert podview.stalled(hosts) == [
    "process 1 did not run for 40.2 s around step 6 (stopped or starved of CPU): the others "
    "waited for it"
  ]  # process 0's 4.5 s is below the threshold: a busy machine, not a stall
  windows = [hosts, [Host(0, 100.0, 0.0), Host(1, 100.0, 0.0, 0, 0, 1.0, 12)]]
  assert [(h.stall_s, h.stall_step) for h in podview.mean(windows)] == [(4.5, 3), (40.2, 6)]
