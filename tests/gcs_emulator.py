"""A local GCS for tests: `python tests/gcs_emulator.py PORT BUCKET` serves the JSON API of
`gcp-storage-emulator` (in memory) on 127.0.0.1:PORT with BUCKET created, until killed.

Two gaps of the emulator are filled here. It ignores suffix ranges (`Range: bytes=-N`, the
last N bytes, which real GCS serves and array_record's reader asks for first to find a
shard's footer) and answers them with the whole object from byte 0, which the reader then
takes for the file's tail ("Invalid Riegeli/records file: chunk boundary is ..."). The
wrapper turns `bytes=-N` into the equivalent `bytes=SIZE-N-` before the emulator sees it.
And it serves one connection at a time with a backlog of 5, which drops the connections of
array_record's parallel reads (54 s for 1,438 records); here each gets a thread (1.8 s).
An upload with the precondition ifGenerationMatch=0 (create only if absent, what a lock
object needs) is refused with 412 where the object exists, as GCS does; the emulator would
overwrite it. With GCS_EMULATOR_COUNT=FILE set, FILE holds the number of object downloads
(GETs) so far; with GCS_EMULATOR_REQUESTS=FILE, FILE holds the JSON API's requests so far by
handler ({"download": N, "ls": N, "insert": N, ...}; a batch's parts as "batch DELETE"...).
"""

from __future__ import annotations

import functools
import http
import http.server
import json
import os
import re
import sys
import threading
import types

from gcp_storage_emulator.handlers import objects

_download = objects.download
_COUNT = os.environ.get("GCS_EMULATOR_COUNT")
_gets, _lock = [0], threading.Lock()
_SUFFIX = re.compile(r"^\s*bytes=-(?P<n>[0-9]+)\s*$")


def _download_with_suffix_ranges(request, response, storage, *args, **kwargs):
  if _COUNT:
    with _lock:
      _gets[0] += 1
      with open(f"{_COUNT}.tmp", "w") as f:
        f.write(str(_gets[0]))
      os.replace(f"{_COUNT}.tmp", _COUNT)
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
  return _download(request, response, storage, *args, **kwargs)


_insert = objects.insert


def _insert_if_absent(request, response, storage, *args, **kwargs):
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
  return _insert(request, response, storage, *args, **kwargs)


objects.download = _download_with_suffix_ranges  # before `server` builds its routes
objects.insert = _insert_if_absent
_REQUESTS, _requests = os.environ.get("GCS_EMULATOR_REQUESTS"), {}


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


if _REQUESTS:
  for _name in ("download", "get", "ls", "insert", "upload_partial", "copy", "rewrite", "compose"):
    setattr(objects, _name, _counted(_name, getattr(objects, _name)))
  for _name in ("delete", "patch", "batch", "xml_upload"):
    setattr(objects, _name, _counted(_name, getattr(objects, _name)))
  objects._BATCH_METHOD_HANDLERS = {
    k: _counted(f"batch {k}", v) for k, v in objects._BATCH_METHOD_HANDLERS.items()
  }

from gcp_storage_emulator import server  # noqa: E402 - must follow the patch above


class _ThreadingHTTPServer(http.server.ThreadingHTTPServer):
  request_queue_size = 256


# The emulator's API thread builds `server.HTTPServer(...)` from its module's `server` name.
server.server = types.SimpleNamespace(HTTPServer=_ThreadingHTTPServer)


def main() -> None:
  port, bucket = int(sys.argv[1]), sys.argv[2]
  server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket).run()


if __name__ == "__main__":
  main()
