"""The gs:// backend (`pipeline.storage.backend`): a dataset in a Cloud Storage bucket.

Two readers touch a `gs://bucket/ds` dataset: `etils.epath` reads manifest.json and stats
the shards (through TensorFlow's gfile when TensorFlow is installed, else fsspec + gcsfs),
and array_record's C++ reader opens the shards itself (google-cloud-cpp: application
default credentials, and `CLOUD_STORAGE_EMULATOR_ENDPOINT` for an emulator). `check` turns
what would otherwise surface as a long traceback (no gcsfs, no credentials, no network, an
emulator set for one reader only) into one line naming the fix; what retrying cannot mend (a
storage host that does not resolve: no DNS, no network) is that line at once, naming missing
credentials too. A shard is pinned by its object's generation, and checked by the CRC32C GCS
keeps for every object: one metadata request, never a read.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import socket
import urllib.parse
from collections.abc import Callable
from typing import TypeVar

from etils import epath

from pipeline.storage import remote
from pipeline.storage.remote import GCSFUSE, LOGIN, RemoteStorageError

T = TypeVar("T")
INSTALL = "pip install -e '.[gcs]' in the checkout (or pip install gcsfs)"
GCS_HOST = "storage.googleapis.com"
# gcsfs (and so epath without TensorFlow) reads this; array_record's reader reads the other.
EMULATOR_VARS = ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT")

_HNS = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"  # read by gcsfs when imported; on by default


def gs_reader() -> str | None:
  """What `etils.epath` reads gs:// paths with here: "tensorflow" (its gfile, chosen by epath
  whenever TensorFlow is installed and EPATH_USE_TF is not false), "gcsfs", or None."""
  use_tf = os.environ.get("EPATH_USE_TF", "").lower() not in ("false", "no", "f", "0")
  if use_tf and importlib.util.find_spec("tensorflow") is not None:
    return "tensorflow"
  return "gcsfs" if importlib.util.find_spec("gcsfs") is not None else None


def _host() -> tuple[str, int]:
  """(host, port) that gs:// reads go to: the emulator's, else Cloud Storage's."""
  url = os.environ.get(EMULATOR_VARS[0]) or f"https://{GCS_HOST}"
  parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
  return parts.hostname or GCS_HOST, parts.port or (443 if parts.scheme == "https" else 80)


def _unresolved() -> str | None:
  """Why the storage host's name does not resolve (gcsfs would retry that for a minute),
  or None; a resolver that does not answer in time is left to the reads' deadlines."""
  host, port = _host()
  try:
    remote.within(lambda: socket.getaddrinfo(host, port), remote.ATTEMPT_S)
  except socket.gaierror as e:
    return f"{host} does not resolve: {e.strerror or e}"
  except (remote.NoAnswer, OSError):
    pass
  return None


def _no_credentials() -> str | None:
  """google-auth's reason when it finds no Application Default Credentials, else None."""
  try:
    import google.auth
    from google.auth import exceptions
  except ImportError:
    return None
  try:
    remote.within(google.auth.default, remote.ATTEMPT_S)
  except exceptions.DefaultCredentialsError as e:
    return str(e).split(". ")[0]
  except Exception:  # noqa: BLE001 - a slow or odd lookup: say nothing of credentials
    pass
  return None


def _object(path) -> dict | None:
  """A gs:// object's metadata (size, generation, crc32c) from gcsfs, fresh (not a listing
  cached earlier): one request. None where gcsfs is not installed (then only a size is known)."""
  if importlib.util.find_spec("gcsfs") is None:
    return None
  from etils.epath.backend import fsspec_backend

  fs = fsspec_backend.fs(os.fspath(path))
  fs.invalidate_cache(os.fspath(path))
  return fs.info(os.fspath(path))


class Gcs:
  """gs://bucket/...: read with deadlines and retries (`pipeline.storage.remote.call`); a
  shard pinned as ("gs", generation, size)."""

  scheme = "gs"
  remote = True

  def check(self, data_dir, probe: str | None) -> None:
    """An emulator must be set for both readers or neither (and for gcsfs as it needs), a
    reader for the manifest must be installed, and `probe` (a file in `data_dir`) is
    stat'ed once, so missing credentials or network are named here; a missing file is left
    to its reader, which says how to make one."""
    emulator = [v for v in EMULATOR_VARS if os.environ.get(v)]
    if len(emulator) == 1:
      (other,) = set(EMULATOR_VARS) - set(emulator)
      raise RemoteStorageError(
        f"{emulator[0]} is set but {other} is not: the manifest and the shards would be read "
        "from different places (gcsfs reads the first, array_record the second); set both to "
        "the emulator's URL, or neither"
      )
    if gs_reader() is None:
      raise RemoteStorageError(f"reading {data_dir} needs gcsfs: {INSTALL}; {GCSFUSE}")
    if emulator and gs_reader() == "tensorflow":
      raise RemoteStorageError(
        "STORAGE_EMULATOR_HOST is set but epath reads gs:// with TensorFlow's gfile here, "
        "which ignores it: set EPATH_USE_TF=false (epath then uses gcsfs)"
      )
    if emulator and os.environ.get(_HNS, "").lower() not in ("false", "0"):
      raise RemoteStorageError(
        f"{emulator[0]} is set: also set {_HNS}=false (else gcsfs asks the emulator for "
        "the bucket's layout over gRPC, which it does not serve: a 60 s wait per call)"
      )
    if probe is None:
      return
    unresolved = _unresolved()
    if unresolved:
      missing = None if emulator else _no_credentials()
      also = f"; no credentials either ({missing}): {LOGIN}" if missing else ""
      raise RemoteStorageError(
        f"cannot read {data_dir}: cannot reach Cloud Storage ({unresolved}): check the network "
        f"and DNS{also}; {GCSFUSE}"
      )
    path = epath.Path(data_dir) / probe
    try:
      remote.call(path.stat, path)
    except FileNotFoundError:
      return
    except RemoteStorageError:
      raise
    except Exception as e:  # noqa: BLE001 - gcsfs, aiohttp, google-auth and TF raise their own
      raise RemoteStorageError(f"cannot read {path}: {remote.explain(e)}; {GCSFUSE}") from None

  def guard(self, fn: Callable[[], T], path, deadline_s: float | None = None) -> T:
    """`fn()`, a read of `path`, with a deadline per attempt and retries (`remote.call`)."""
    return remote.call(fn, path)

  def request(self, fn: Callable[[], T], wait_s: float) -> T:
    """`fn()`, a shard read array_record's client retries itself, within `wait_s`."""
    return remote.within(fn, wait_s)

  def size(self, path, deadline_s: float | None = None) -> int | None:
    st = remote.call(epath.Path(path).stat, path)
    return None if st.is_directory else st.length

  def look(self, path, deadline_s: float | None = None) -> tuple:
    """(size, pin, crc32c) from one metadata request; without gcsfs, (size, None, None)."""
    info = remote.call(lambda: _object(path), path)  # deadline, retries
    if info is None:
      return self.size(path), None, None
    if info.get("type") != "file":
      return None, None, None
    size, crc = int(info["size"]), info.get("crc32c")
    return (
      size,
      ("gs", str(info.get("generation")), size),
      base64.b64decode(crc).hex() if crc else None,
    )
