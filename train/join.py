"""Joining the other processes, saying whom this one waits for: JAX's join
(`jax.distributed.initialize`) is silent until its timeout, then aborts naming no process.

Process 0 holds a roll call on the coordinator's address, port + 1 (plain TCP: it works
across machines): every process reports there about once a second ("here", or that a signal
stopped it) and hears back who else reported. So each process says whom it still waits for
(`wait`), and names those that never came; process 0 that cannot start the join tells them
why (`refuse`), so that each says it at once instead of waiting out --join_timeout. The roll
call reads at most a short line, keeps only well-formed reports of this run's processes, and
each exchange ends within its deadline whatever the other side does; another service on the
port is one line, not a failure.
"""

from __future__ import annotations

import json
import os
import re
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
LINE_BYTES = 64  # a report: "<process> here" or "<process> stopped by SIGTERM"
ANSWER_BYTES = 64 * 1024  # process 0's answer: a status per process
STATUS = re.compile(r"here|stopped by SIG[A-Z0-9]{2,8}")
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
    roll.call(deadline_s=min(ANSWER_S, max(0.1, timeout_s - (time.monotonic() - start))))
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
    self.warned = False
    if me == 0:
      self._serve()

  def _serve(self) -> None:
    roll = self

    class Handler(socketserver.StreamRequestHandler):
      def handle(self):
        self.request.settimeout(ANSWER_S)
        try:
          report = roll.parse(self.rfile.readline(LINE_BYTES + 1))
          if report is not None:
            self.wfile.write(json.dumps(roll.report(*report)).encode())
        except OSError:
          pass

    class Server(socketserver.ThreadingTCPServer):
      daemon_threads = allow_reuse_address = True

    try:
      self.server = Server(self.address, Handler)
    except OSError as e:  # who is missing stays unknown; the join itself goes on
      _say(
        f"python -m train: the roll call cannot listen on {self.address[0]}:{self.address[1]} "
        f"(the coordinator's port + 1: {e.strerror or e}); joining without saying whom it waits for"
      )
      return
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def parse(self, line: bytes) -> tuple[int, str] | None:
    """A report `line` as (process, status), or None unless it is one of this run's processes
    saying one of the statuses a process sends."""
    if len(line) > LINE_BYTES or not line.endswith(b"\n"):
      return None
    process, _, status = line.decode("ascii", "replace").strip().partition(" ")
    if not (process.isdigit() and int(process) < self.count and STATUS.fullmatch(status)):
      return None
    return int(process), status

  def report(self, process: int, status: str) -> dict[int, str]:
    """Records `process`'s report (in process 0); returns who is here or stopped."""
    now = time.monotonic()
    with self.lock:
      self.reports[process] = (status, now)
      return {p: s for p, (s, t) in self.reports.items() if s != "here" or now - t < PRESENT_S}

  def call(self, status: str = "here", deadline_s: float = ANSWER_S) -> None:
    """Reports this process's `status` and hears who else has come, within `deadline_s`."""
    if self.me == 0:
      self.heard = self.report(0, status) if self.server else None
      return
    try:
      answer = self._exchange(f"{self.me} {status}\n".encode(), deadline_s)
    except OSError:
      self.heard = {}  # process 0 is not there (yet)
      return
    if not answer:  # process 0 closed without answering: too busy to read in time
      return
    heard = self._heard(answer)
    if heard is None and not self.warned:
      self.warned = True
      _say(
        f"python -m train: {self.address[0]}:{self.address[1]} (the coordinator's port + 1) "
        "answered something other than the roll call: another service on that port?"
      )
    self.heard = heard or {}

  def _exchange(self, report: bytes, deadline_s: float) -> bytes:
    """Sends `report` to the roll call; its answer, read whole within `deadline_s`."""
    end = time.monotonic() + deadline_s
    with socket.create_connection(self.address, timeout=deadline_s) as s:
      s.sendall(report)
      answer = b""
      while len(answer) <= ANSWER_BYTES:
        left = end - time.monotonic()
        if left <= 0:
          raise TimeoutError("no whole answer in time")
        s.settimeout(left)
        chunk = s.recv(ANSWER_BYTES + 1 - len(answer))
        if not chunk:
          return answer
        answer += chunk
    return b""  # longer than any roll call's answer

  def _heard(self, answer: bytes) -> dict[int, str] | None:
    """The roll call's `answer` as process -> status, or None if it is not one."""
    try:
      heard = json.loads(answer)
    except ValueError:
      return None
    if not isinstance(heard, dict):
      return None
    out = {}
    for process, status in heard.items():
      if not (process.isdigit() and int(process) < self.count and isinstance(status, str)):
        return None
      said = process == "0" and status.startswith(FAILED) and status.isprintable()
      if not (STATUS.fullmatch(status) or said):
        return None
      out[int(process)] = status
    return out

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
