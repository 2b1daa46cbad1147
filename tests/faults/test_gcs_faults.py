"""A bucket that stalls or fails: every read Python makes of it (the manifest, the shards'
sizes) has a deadline and retries with backoff, and a bucket that keeps failing is one line
naming it within seconds, never a hang and never a silent wait.

The bucket is the local emulator (tests/gcs_emulator.py) behind a proxy that stalls or answers
503 for manifest.json, as a Cloud Storage outage or a dead connection would; reads run in
fresh processes with short deadlines (pipeline.storage.remote.ATTEMPT_S) so that the tests take
seconds.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests import leftovers
from tests.storage.test_gcs import REPO, gcs, needs_emulator  # noqa: F401 - the emulator fixture

HOP = ("host", "content-length", "transfer-encoding", "connection")
SHORT = "from pipeline.storage import remote; remote.ATTEMPT_S, remote.BACKOFF_S = 2.0, 0.2\n"


def run(code: str, env: dict, timeout: float = 60, args=()) -> subprocess.CompletedProcess:
  """`python -c CODE ARGS...` with this checkout first on the path; a hang fails at `timeout`,
  and so does any process it started that outlives it."""
  proc = subprocess.Popen(
    [sys.executable, "-c", code, *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "PYTHONPATH": REPO, "TQDM_DISABLE": "1", **env},
    start_new_session=True,  # its session id names what it started
  )
  try:
    out, err = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:  # hung: it and what it started
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert leftovers.outlived(proc.pid) == [], "processes it started outlived it"
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class _Proxy(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def __init__(self, upstream: str):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.upstream, self.fault = upstream, None
    self.released = threading.Event()  # ends stalled requests at teardown

  def handle_error(self, request, client_address):
    pass  # a client that gave up on a stalled answer

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):
    pass

  def _serve(self):
    server = self.server
    body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
    if self.path.startswith("/fault/"):  # a reader in the child sets the fault when it is ready
      server.fault = urllib.parse.unquote(self.path[len("/fault/") :])
      self.send_response(204)
      self.end_headers()
      return
    if server.fault in ("stall shards", "stall shard metadata"):
      media = "alt=media" in self.path  # array_record's reads of the records, or gcsfs' stat
      if "array_record" in self.path and media == (server.fault == "stall shards"):
        server.released.wait()
        return
    elif server.fault and "manifest.json" in self.path:
      # gcsfs' stat asks for the object and lists `manifest.json/` at once, and waits for the
      # object only: a single stall must meet the object, not whichever request comes first
      once = server.fault == "stall once"
      if server.fault == "stall" or (once and "prefix=" not in self.path):
        server.fault = None if once else server.fault
        server.released.wait()
        return
      if server.fault == "503":
        error = json.dumps({"error": {"code": 503, "message": "Service Unavailable"}}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(error)))
        self.end_headers()
        self.wfile.write(error)
        return
    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
    request = urllib.request.Request(
      server.upstream + self.path, data=body, method=self.command, headers=headers
    )
    try:
      response = urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as e:
      response = e
    data = response.read()
    self.send_response(response.status)
    for k, v in response.headers.items():
      if k.lower() not in HOP:
        self.send_header(k, v)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _serve


@pytest.fixture(scope="module")
def bucket(gcs, digits_dir):  # noqa: F811 - the fixture imported above
  """The digits in gs://bkt/digits, and a proxy in front of the emulator; yields (proxy,
  the environment that reads the bucket through it)."""
  upload = (
    "import sys, gcsfs\n"
    "gcsfs.GCSFileSystem(token='anon').put(sys.argv[1], 'bkt/digits', recursive=True)"
  )
  p = run(upload, env=gcs, args=[str(digits_dir)])
  assert p.returncode == 0, p.stderr[-2000:]
  proxy = _Proxy(gcs["STORAGE_EMULATOR_HOST"])
  thread = threading.Thread(target=proxy.serve_forever, daemon=True)
  thread.start()
  try:
    yield (
      proxy,
      {**gcs, "STORAGE_EMULATOR_HOST": proxy.url, "CLOUD_STORAGE_EMULATOR_ENDPOINT": proxy.url},
    )
  finally:
    proxy.released.set()
    proxy.shutdown()


def run_with(bucket, fault: str | None, code: str) -> subprocess.CompletedProcess:
  """`python -c CODE` reading the bucket while its proxy plays `fault` (None: one the code
  asks for); the proxy serves faultlessly after."""
  proxy, env = bucket
  proxy.fault = fault
  try:
    return run(code, env=env)
  finally:
    proxy.fault = None


LOAD = (
  SHORT
  + "from pipeline.catalog import manifest; print(manifest.load('gs://bkt/digits').num_classes)"
)


@needs_emulator
@pytest.mark.parametrize("fault, says", [("stall", "no answer within 2 s"), ("503", "503")])
def test_a_stalled_or_failing_bucket_is_one_line_within_seconds(bucket, fault, says):
  p = run_with(bucket, fault, LOAD)
  assert p.returncode == 1, p.stderr[-2000:]
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith(
    "pipeline.storage.remote.RemoteStorageError: cannot read gs://bkt/digits/manifest.json: "
  ), p.stderr[-2000:]
  assert says in last and "3 attempts in" in last
  retries = [x for x in p.stderr.splitlines() if "attempt 2 of 3" in x or "attempt 3 of 3" in x]
  assert len(retries) == 2, p.stderr[-2000:]  # each retry said, not waited out silently


@needs_emulator
def test_a_read_that_stalls_once_is_read_again_after_its_deadline(bucket):
  p = run_with(bucket, "stall once", LOAD)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.split() == ["10"]
  assert "reading gs://bkt/digits/manifest.json: no answer within 2 s; attempt 2 of 3" in p.stderr


@needs_emulator
@pytest.mark.parametrize("fault", ["stall shards", "stall shard metadata"])
def test_a_shard_read_that_stalls_is_one_line_within_seconds(bucket, fault):
  code = SHORT + (
    "import pipeline\n"
    "pipeline.make_dataset('gs://bkt/digits', batch_size=8, image_size=32, shard_index=0, "
    "shard_count=1)"
  )
  p = run_with(bucket, fault, code)
  assert p.returncode == 1, p.stderr[-2000:]
  assert (
    p.stderr.strip()
    .splitlines()[-1]
    .startswith(
      "pipeline.storage.remote.RemoteStorageError: cannot read gs://bkt/digits/train.array_record-00000-"
      "of-00001: no answer within 2 s (3 attempts in "
    )
  ), p.stderr[-2000:]


@needs_emulator
def test_a_shard_that_stalls_while_batches_are_read_is_one_line_within_seconds(bucket):
  code = SHORT + (
    "import os, urllib.request\n"
    "import pipeline\n"
    "ds = pipeline.make_dataset('gs://bkt/digits', batch_size=8, image_size=32, shard_index=0, "
    "shard_count=1, performance={'record_cache_mb': 0})\n"
    "url = os.environ['STORAGE_EMULATOR_HOST'] + '/fault/stall%20shards'\n"
    "urllib.request.urlopen(url).read()\n"
    "next(iter(ds))\n"
  )
  p = run_with(bucket, None, code)
  assert p.returncode == 1, p.stderr[-2000:]
  error = (
    "pipeline.storage.remote.RemoteStorageError: cannot read gs://bkt/digits/train.array_record-"
  )
  said = [x for x in p.stderr.splitlines() if x.startswith(error)]  # Grain adds a note after
  assert said and "-00000-of-00001: no answer within 6 s: " in said[0], p.stderr[-2000:]
