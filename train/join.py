"""Joining the other processes, saying whom this one waits for: JAX's join
(`jax.distributed.initialize`) is silent until its timeout, then aborts naming no process.

Process 0 holds a roll call on the coordinator's port + 1 (plain TCP: it works across
machines): every process reports there about once a second ("here", or that a signal
stopped it) and hears back who else reported. So each process says whom it still waits for
(`wait`), and names those that never came; process 0 that cannot start the join tells them
why (`refuse`), so that each says it at once instead of waiting out --join_timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable

POLL_S = 1.0  # how often a joining process reports to the roll call
FIRST_WAIT_S, WAIT_EVERY_S = 5, 15  # when a joining process says whom it waits for
PRESENT_S = 5.0  # a process that reported within this is here
ANSWER_S = 2.0  # for the roll call's answer
FAILED = "failed: "  # process 0's status when it cannot start the join, then its cause
HOLD_S = 30  # how long process 0 holds the roll call to tell the others that cause


def wait(connect: Callable[[], None], roll: RollCall, timeout_s: int) -> None:
  """Runs `connect` (JAX's join, which blocks until every process has come), saying every
  `WAIT_EVERY_S` whom it waits for; after `timeout_s`, names in one line those that never
  came and exits 1. Raises what `connect` raises."""
  failed = []

  def run():
    try:
      connect()
    except Exception as e:  # noqa: BLE001 - raised again below, in the main thread
      failed.append(e)

  joining = threading.Thread(target=run, daemon=True, name="train-join")
  joining.start()
  start, say_at = time.monotonic(), FIRST_WAIT_S
  while True:  # in the main thread, where signal handlers run (`RollCall.stopped`)
    joining.join(POLL_S)
    if not joining.is_alive():
      break
    roll.call()
    if (cause := roll.failed()) is not None:
      _say(f"python -m train: process 0 failed: {cause}")
      os._exit(2)  # as process 0 exits: `joining` waits inside JAX
    waited = time.monotonic() - start
    if waited >= timeout_s:
      _say(
        f"python -m train: {roll.missing()} never joined (waited {waited:.0f} s, "
        "--join_timeout); start the same command on every host"
      )
      os._exit(1)  # `joining` waits inside JAX, which would abort the process later
    if waited >= say_at:
      _say(
        f"process {roll.me}: waiting for {roll.missing()} to join "
        f"({waited:.0f} s of --join_timeout={timeout_s})"
      )
      say_at += WAIT_EVERY_S
  if failed:
    raise failed[0]


def refuse(roll: RollCall, cause: str, timeout_s: int) -> None:
  """Process 0, which cannot start the join: holds the roll call until every other process
  has heard `cause` (they say it and exit: `wait`), or for at most HOLD_S (and `timeout_s`)."""
  roll.report(0, FAILED + cause)
  end = time.monotonic() + min(HOLD_S, timeout_s)
  while roll.server and time.monotonic() < end and len(roll.reports) < roll.count:
    time.sleep(POLL_S / 4)
  time.sleep(POLL_S / 4 if roll.server else 0)  # the last answer on its way


def _say(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


class RollCall:
  """Process `me`'s view of who has come, of `count` processes, holding the roll call if
  `me` is 0."""

  def __init__(self, coordinator: str, count: int, me: int):
    host, _, port = coordinator.rpartition(":")
    self.address = (host.strip("[]"), int(port) + 1)
    self.count, self.me = count, me
    self.reports: dict[int, tuple[str, float]] = {}  # process -> (status, when), process 0
    self.heard: dict[int, str] | None = None  # process -> status, as last heard
    self.lock = threading.Lock()
    self.server = None
    if me == 0:
      self._serve()

  def _serve(self) -> None:
    roll = self

    class Handler(socketserver.StreamRequestHandler):
      def handle(self):
        self.request.settimeout(ANSWER_S)
        try:
          process, status = self.rfile.readline().decode().split(maxsplit=1)
          self.wfile.write(json.dumps(roll.report(int(process), status.strip())).encode())
        except (OSError, ValueError):
          pass

    class Server(socketserver.ThreadingTCPServer):
      daemon_threads = allow_reuse_address = True

    try:
      self.server = Server(("", self.address[1]), Handler)
    except OSError:  # the port is taken: who is missing stays unknown
      return
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def report(self, process: int, status: str) -> dict[int, str]:
    """Records `process`'s report (in process 0); returns who is here or stopped."""
    now = time.monotonic()
    with self.lock:
      self.reports[process] = (status, now)
      return {p: s for p, (s, t) in self.reports.items() if s != "here" or now - t < PRESENT_S}

  def call(self, status: str = "here") -> None:
    """Reports this process's `status` and hears who else has come."""
    if self.me == 0:
      heard = self.report(0, status) if self.server else None
    else:
      try:
        with socket.create_connection(self.address, timeout=ANSWER_S) as s:
          s.sendall(f"{self.me} {status}\n".encode())
          heard = json.loads(s.makefile().read())
      except (OSError, ValueError):
        heard = {}  # process 0 is not there (yet)
    self.heard = None if heard is None else {int(p): s for p, s in heard.items()}

  def failed(self) -> str | None:
    """Why process 0 could not start the join, as this process last heard it, or None."""
    status = (self.heard or {}).get(0, "")
    return status.removeprefix(FAILED) if self.me and status.startswith(FAILED) else None

  def missing(self) -> str:
    """'process 1', 'processes 0, 2' or 'the other processes' (when unknown): who has not
    come, and why, if a signal stopped them."""
    if self.heard is None:
      return "the other processes"
    gone = [p for p in range(self.count) if self.heard.get(p) != "here"]
    if not self.heard and self.me:
      return f"process 0 (the coordinator, {self.address[0]}:{self.address[1] - 1})"
    names = [f"{p} ({self.heard[p]})" if p in self.heard else str(p) for p in gone]
    return f"process{'es' if len(gone) > 1 else ''} {', '.join(names)}"

  def stopped(self, signum: int) -> None:
    """Tells the others that signal `signum` stopped this process, says so, exits 128 + it."""
    name = signal.Signals(signum).name
    self.call(f"stopped by {name}")
    _say(f"python -m train: stopped by {name} before joining the other processes")
    os._exit(128 + signum)

  def close(self) -> None:
    if self.server:
      self.server.shutdown()
      self.server.server_close()
