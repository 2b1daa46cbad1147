"""The roll call (train.join) against what else may reach its port: it binds the coordinator's
address, keeps only this run's well-formed reports, bounds what it reads, and each exchange
ends within its deadline; another service on the port is one line. Real sockets, in-process."""

import socket
import socketserver
import threading
import time

import pytest

from train import join


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def roll():
  """Process 0's roll call for a run of 2 processes, coordinator 127.0.0.1:P."""
  coordinator = f"127.0.0.1:{free_port() - 1}"
  roll = join.RollCall(coordinator, 2, 0)
  assert roll.server is not None
  yield roll, coordinator
  roll.close()


def send(address, data: bytes) -> bytes | None:
  """The roll call's answer to `data`; None if it hung up before taking all of it."""
  with socket.create_connection(address, timeout=5) as s:
    try:
      s.sendall(data)
      s.shutdown(socket.SHUT_WR)
      return s.makefile("rb").read()
    except (BrokenPipeError, ConnectionResetError):
      return None


def test_the_roll_call_listens_on_the_coordinators_address_only(roll):
  roll, _ = roll
  assert roll.server.server_address == roll.address
  assert roll.address[0] == "127.0.0.1"


def test_only_this_runs_processes_with_known_statuses_are_recorded(roll):
  roll, coordinator = roll
  for forged in (
    b" here\n",  # no process
    b"7 here\n",  # not a process of this run of 2
    b"-1 here\n",
    b"1 here\x1b[2J\n",  # terminal escapes
    b"1 stopped by nothing\n",
    b"1 here",  # no end of line
  ):
    send(roll.address, forged)
  assert roll.reports == {}
  member = join.RollCall(coordinator, 2, 1)
  member.call()
  assert member.heard == {1: "here"} and set(roll.reports) == {1}
  member.call("stopped by SIGTERM")
  assert roll.report(0, "here") == {0: "here", 1: "stopped by SIGTERM"}


def test_a_line_longer_than_any_report_is_not_read_on(roll):
  roll, _ = roll
  answer = send(roll.address, b"1 here" + b" " * 10_000_000 + b"\n")
  assert answer in (None, b"") and roll.reports == {}


class Trickle(socketserver.StreamRequestHandler):
  """Another service on the port: answers one byte every 0.5 s, for a minute."""

  def handle(self):
    for _ in range(120):
      try:
        self.wfile.write(b"[")
        self.wfile.flush()
      except OSError:
        return
      time.sleep(0.5)


class JsonList(socketserver.StreamRequestHandler):
  """Another service on the port that answers valid JSON of another shape."""

  def handle(self):
    self.wfile.write(b'["not", "a", "roll", "call"]')


@pytest.mark.parametrize("handler", [Trickle, JsonList])
def test_another_service_on_the_port_is_one_line_and_each_call_ends_in_its_deadline(handler, capfd):
  server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
  server.daemon_threads = True
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    member = join.RollCall(f"127.0.0.1:{server.server_address[1] - 1}", 2, 1)
    calls = threading.Thread(target=lambda: [member.call(deadline_s=1.0) for _ in range(2)])
    calls.start()
    calls.join(timeout=20)  # two calls of at most 1 s each; a trickle read to its end takes 60
    assert not calls.is_alive(), "a call waited past its deadline"
    assert member.heard == {}
    assert member.missing() == "process 0 (the coordinator, 127.0.0.1:%d)" % (
      server.server_address[1] - 1
    )
  finally:
    server.shutdown()
    server.server_close()
  err = capfd.readouterr().err.splitlines()
  if handler is JsonList:
    assert len(err) == 1 and "answered something other than the roll call" in err[0], err


def test_process_0_says_in_one_line_when_another_service_holds_its_port(capfd):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    roll = join.RollCall(f"127.0.0.1:{port - 1}", 2, 0)
  assert roll.server is None
  err = capfd.readouterr().err.splitlines()
  assert len(err) == 1, err
  assert f"cannot listen on 127.0.0.1:{port} (the coordinator's port + 1" in err[0]
  roll.call()
  assert roll.missing() == "the other processes"
