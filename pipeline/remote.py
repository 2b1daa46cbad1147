"""Datasets in a bucket: what a `gs://` data_dir needs, checked before anything is read.

Two readers touch a `gs://bucket/ds` dataset: `etils.epath` reads manifest.json and stats
the shards (through TensorFlow's gfile when TensorFlow is installed, else fsspec + gcsfs),
and array_record's C++ reader opens the shards itself (google-cloud-cpp: application
default credentials, and `CLOUD_STORAGE_EMULATOR_ENDPOINT` for an emulator). `check` turns
what would otherwise surface as a long traceback (no gcsfs, no credentials, no network, an
emulator set for one reader only, a scheme array_record cannot open) into one line naming
the fix. A local path (or a gcsfuse mount) passes without a look.
"""

from __future__ import annotations

import importlib.util
import os
import re

from etils import epath

from pipeline.manifest import FILENAME

INSTALL = "pip install 'grain-pipeline[gcs]'"
GCSFUSE = "or mount the bucket with gcsfuse and pass the mount path"
# gcsfs (and so epath without TensorFlow) reads this; array_record's reader reads the other.
EMULATOR_VARS = ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT")

_HNS = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"  # read by gcsfs when imported; on by default
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_NO_ACCESS = (
  "401",
  "403",
  "anonymous caller",
  "permission",
  "unauthorized",
  "forbidden",
  "credentials",
  "access denied",
)
_NO_NETWORK = (
  "cannot connect to host",
  "could not resolve",
  "name or service not known",
  "temporary failure in name resolution",
  "connection refused",
  "network is unreachable",
  "timed out",
)


class RemoteStorageError(ValueError):
  """A remote data_dir that cannot be read as it is set up; the message says what to do."""


def scheme(path) -> str | None:
  """The URL scheme of a path ("gs" for gs://bucket/ds), None for a local path."""
  match = _SCHEME.match(os.fspath(path))
  return match[1].lower() if match else None


def gs_reader() -> str | None:
  """What `etils.epath` reads gs:// paths with here: "tensorflow" (its gfile, chosen by epath
  whenever TensorFlow is installed and EPATH_USE_TF is not false), "gcsfs", or None."""
  use_tf = os.environ.get("EPATH_USE_TF", "").lower() not in ("false", "no", "f", "0")
  if use_tf and importlib.util.find_spec("tensorflow") is not None:
    return "tensorflow"
  return "gcsfs" if importlib.util.find_spec("gcsfs") is not None else None


def _first_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return f"{type(e).__name__}: {lines[0] if lines else '(no message)'}"[:300]


def explain(e: BaseException) -> str:
  """One line for an error of reading GCS: what it is and what to do about it."""
  text = f"{type(e).__name__} {e}".lower()
  if any(s in text for s in _NO_ACCESS):
    return (
      f"no access ({_first_line(e)}): run `gcloud auth application-default login`, or on a "
      "TPU/GCE VM give its service account Storage Object Viewer on the bucket"
    )
  if any(s in text for s in _NO_NETWORK) or isinstance(e, (ConnectionError, TimeoutError)):
    return f"cannot reach Cloud Storage ({_first_line(e)}): check the network"
  return _first_line(e)


def check(data_dir, probe: bool = True) -> None:
  """Raises `RemoteStorageError` (one line) if `data_dir` is a URL this host cannot read.

  A local path returns at once. For gs://: an emulator must be set for both readers or
  neither (and for gcsfs as it needs), a reader for the manifest must be installed, and
  (`probe`) manifest.json is
  stat'ed once, so missing credentials or network are named here; a missing manifest is
  left to `manifest.load`, which says how to make one.
  """
  kind = scheme(data_dir)
  if kind is None:
    return
  if kind != "gs":
    raise RemoteStorageError(
      f"cannot read {data_dir}: shards are read by array_record, which opens local paths "
      f"and gs:// only; mount the {kind}:// storage and pass the mount path"
    )
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
  if not probe:
    return
  path = epath.Path(data_dir) / FILENAME
  try:
    path.stat()
  except FileNotFoundError:
    return
  except Exception as e:  # noqa: BLE001 - gcsfs, aiohttp, google-auth and TF raise their own
    raise RemoteStorageError(f"cannot read {path}: {explain(e)}; {GCSFUSE}") from None
