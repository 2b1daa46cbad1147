"""A local GCS for tests: `python tests/gcs_emulator.py PORT BUCKET` serves the JSON API of
`gcp-storage-emulator` (in memory) on 127.0.0.1:PORT with BUCKET created, until killed;
`serving()` starts one on a free port and yields the environment that points gcsfs, epath,
array_record and TensorStore (Orbax) at it (the tests' `gcs` fixture, `bench convert --emulator`).

The emulator's gaps are filled here. It ignores suffix ranges (`Range: bytes=-N`, the
last N bytes, which real GCS serves and array_record's reader asks for first to find a
shard's footer) and answers them with the whole object from byte 0, which the reader then
takes for the file's tail ("Invalid Riegeli/records file: chunk boundary is ..."). The
wrapper turns `bytes=-N` into the equivalent `bytes=SIZE-N-` before the emulator sees it.
And it serves one connection at a time with a backlog of 5, which drops the connections of
array_record's parallel reads (54 s for 1,438 records); here each gets a thread (1.8 s), and
its handlers run one at a time under a lock: its storage (one in-memory dict, dumped whole to
JSON on each write) is not thread-safe, and a write beside another failed with "dictionary
changed size during iteration", the upload stored but never answered, gcsfs's retry then
refused (404) and its cancel (DELETE of the session, which the emulator lacks) a bare 501.
Downloads name the object's generation (`x-goog-generation`), as from GCS: TensorStore's
conditional writes (Orbax's checkpoints) fail on "Malformed StorageGeneration" without it.
An upload with the precondition ifGenerationMatch=0 (create only if absent, what a lock
object needs) is refused with 412 where the object exists, as GCS does; the emulator would
overwrite it. With GCS_EMULATOR_COUNT=FILE set, FILE holds the number of object downloads
(GETs) so far; with GCS_EMULATOR_REQUESTS=FILE, FILE holds the JSON API's requests so far by
handler ({"download": N, "ls": N, "insert": N, ...}; a batch's parts as "batch DELETE"...).
"""

from __future__ import annotations

import contextlib
import functools
import http
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request

_COUNT = os.environ.get("GCS_EMULATOR_COUNT")
_REQUESTS, _requests = os.environ.get("GCS_EMULATOR_REQUESTS"), {}
_gets, _lock = [0], threading.Lock()
_handling = threading.RLock()  # one handler at a time (see above)
_SUFFIX = re.compile(r"^\s*bytes=-(?P<n>[0-9]+)\s*$")


@contextlib.contextmanager
def serving(bucket: str = "bkt", counters: dict | None = None):
  """An emulator with `bucket` on a free port, answering when this yields; yields (the
  environment that points gcsfs, epath and array_record at it, its process id). `counters`:
  its GCS_EMULATOR_COUNT / GCS_EMULATOR_REQUESTS files. Killed at exit."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen(
    [sys.executable, os.path.abspath(__file__), str(port), bucket],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    env={**os.environ, **(counters or {})},
  )
  try:
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}", timeout=1).read()
        break
      except OSError:
        if time.monotonic() > deadline or proc.poll() is not None:
          raise
        time.sleep(0.1)
    env = {
      "STORAGE_EMULATOR_HOST": url,
      "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
      "EPATH_USE_TF": "false",
      "TENSORSTORE_GCS_HTTP_URL": url,  # Orbax's checkpoints, written by TensorStore
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
    }
    yield env, proc.pid
  finally:
    proc.kill()
    proc.wait()


def _count_get() -> None:
  with _lock:
    _gets[0] += 1
    with open(f"{_COUNT}.tmp", "w") as f:
      f.write(str(_gets[0]))
    os.replace(f"{_COUNT}.tmp", _COUNT)


def _counted(name: str, handler):
  @functools.wraps(handler)
  def counted(*args, **kwargs):
    with _lock:
      _requests[name] = _requests.get(name, 0) + 1
      with open(f"{_REQUESTS}.tmp", "w") as f:
        json.dump(_requests, f)
      os.replace(f"{_REQUESTS}.tmp", _REQUESTS)
    return handler(*args, **kwargs)

  return counted


def _patch():
  """The emulator's gaps filled (see above); returns its `server` module, patched."""
  from gcp_storage_emulator.handlers import objects

  download, insert = objects.download, objects.insert

  def download_with_suffix_ranges(request, response, storage, *args, **kwargs):
    if _COUNT:
      _count_get()
    headers = request._request_handler.headers
    match = _SUFFIX.fullmatch(headers.get("range", "") or "")
    if match:
      try:
        size = len(storage.get_file(request.params["bucket_name"], request.params["object_id"]))
      except Exception:  # noqa: BLE001 - a missing object: the emulator's own 404 follows
        size = None
      if size is not None:
        del headers["range"]
        headers["Range"] = f"bytes={max(0, size - int(match['n']))}-"
    try:  # GCS names the generation of what it serves; TensorStore's writes depend on it
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
      response["x-goog-generation"] = obj["generation"]
    except Exception:  # noqa: BLE001 - a missing object: the emulator's own 404 follows
      pass
    return download(request, response, storage, *args, **kwargs)

  def insert_if_absent(request, response, storage, *args, **kwargs):
    """An upload with ifGenerationMatch=0 (create only if absent) gets 412 where the object
    exists, as from GCS; the emulator ignores the precondition."""
    if request.query.get("ifGenerationMatch") == ["0"]:
      name = (request.query.get("name") or [None])[0]
      if name is None and isinstance(request.data, dict):
        name = request.data.get("meta", {}).get("name")
      try:
        storage.get_file_obj(request.params["bucket_name"], name)
      except Exception:  # noqa: BLE001 - absent: the upload goes on
        pass
      else:
        response.status = http.HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "conditionNotMet"}})
        return None
    return insert(request, response, storage, *args, **kwargs)

  objects.download = download_with_suffix_ranges  # before `server` builds its routes
  objects.insert = insert_if_absent
  if _REQUESTS:
    for name in ("download", "get", "ls", "insert", "upload_partial", "copy", "rewrite"):
      setattr(objects, name, _counted(name, getattr(objects, name)))
    for name in ("compose", "delete", "patch", "batch", "xml_upload"):
      setattr(objects, name, _counted(name, getattr(objects, name)))
    objects._BATCH_METHOD_HANDLERS = {
      k: _counted(f"batch {k}", v) for k, v in objects._BATCH_METHOD_HANDLERS.items()
    }
  from gcp_storage_emulator import server  # after the patch above

  def one_at_a_time(handler):
    @functools.wraps(handler)
    def locked(*args, **kwargs):
      with _handling:
        return handler(*args, **kwargs)

    return locked

  server.HANDLERS = tuple(
    (route, {method: one_at_a_time(h) for method, h in handlers.items()})
    for route, handlers in server.HANDLERS
  )
  objects.insert = one_at_a_time(objects.insert)  # the router's fallback for POST uploads

  class ThreadingHTTPServer(http.server.ThreadingHTTPServer):
    request_queue_size = 256

  # The emulator's API thread builds `server.HTTPServer(...)` from its module's `server` name.
  server.server = types.SimpleNamespace(HTTPServer=ThreadingHTTPServer)
  return server


def main() -> None:
  port, bucket = int(sys.argv[1]), sys.argv[2]
  _patch().create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket).run()


if __name__ == "__main__":
  main()
