"""Datasets in a bucket: what a `gs://` data_dir needs, checked before anything is read.

Two readers touch a `gs://bucket/ds` dataset: `etils.epath` reads manifest.json and stats
the shards (through TensorFlow's gfile when TensorFlow is installed, else fsspec + gcsfs),
and array_record's C++ reader opens the shards itself (google-cloud-cpp: application
default credentials, and `CLOUD_STORAGE_EMULATOR_ENDPOINT` for an emulator). `check` turns
what would otherwise surface as a long traceback (no gcsfs, no credentials, no network, an
emulator set for one reader only, a scheme array_record cannot open) into one line naming
the fix; what retrying cannot mend (a storage host that does not resolve: no DNS, no network)
is that line at once, naming missing credentials too. A local path (or a gcsfuse mount)
passes without a look.

`call` runs each read of a bucket that Python makes (the manifest, the shards' sizes, the
first records at open) with a deadline per attempt and retries with exponential backoff and
jitter: a stalled or failing bucket is a warning per retry and then one line naming what
failed, within `ATTEMPTS` x `ATTEMPT_S` seconds, never a hang (gcsfs alone: minutes per
stalled request, ~35 s of silent retries per 503). The read stage's shard reads, which
array_record's own client retries, run `within` a deadline of that length, and `retry` reads
again what storage answered with "slow down" (`slow_down`: HTTP 429/503 and their kin). On
gs:// that client retries a 429 or 503 itself, out of sight (through the test emulator's
proxy, every third range read answered 429 outlasted a 6 s deadline): there a slow-down
shows as latency; `retry` sees what a FUSE mount or a Python reader raises.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import random
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import TypeVar

from absl import logging as absl_logging
from etils import epath

from pipeline.catalog.schema import FILENAME
from pipeline.storage import stalled

T = TypeVar("T")
ATTEMPT_S = 20.0  # deadline of one attempt (gcsfs retries a 5xx by itself within it)
ATTEMPTS = 3
BACKOFF_S = 1.0  # before the second attempt; doubled for each next, times 0.5-1.5 (jitter)
SLOW_DOWN_ATTEMPTS = 6  # of a read storage answers "slow down": waits of ~1+2+4+8+16 s
SAID_EVERY_S = 10.0  # a warning per retry of a read, at most this often

INSTALL = "pip install -e '.[gcs]' in the checkout (or pip install gcsfs)"
LOGIN = (
  "run `gcloud auth application-default login`, or on a TPU/GCE VM give its service account "
  "Storage Object Viewer on the bucket"
)
GCS_HOST = "storage.googleapis.com"
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


# What storage says when it wants fewer requests, in the words of HTTP (429, 503), gRPC
# (RESOURCE_EXHAUSTED, UNAVAILABLE: google-cloud-cpp's, so array_record's), S3 (SlowDown)
# and errno (EAGAIN, EBUSY: "Resource temporarily unavailable" from a FUSE mount).
_SLOW_DOWN = re.compile(
  r"too many requests|slow ?down|resource[_ ]exhausted|unavailable|rate ?limit|"
  r"(?:http|status|code|error)[ :=]*(?:429|503)\b|\b(?:429|503) (?:too|service)",
  re.IGNORECASE,
)


class RemoteStorageError(ValueError):
  """A remote data_dir that cannot be read as it is set up; the message says what to do.
  `stalled`: storage gave no answer in time, and reads may wait on in their threads (or
  worker processes), which the process's exit will not wait for (`stalled.mark`), also
  where the error is raised again after it crossed from a worker process."""

  stalled = False

  def __setstate__(self, state):
    super().__setstate__(state)
    if self.stalled:
      stalled.mark()


def _no_answer(message: str) -> RemoteStorageError:
  """The error of storage that gave no answer in time (`stalled`); this process marked."""
  error = RemoteStorageError(message)
  error.stalled = True
  stalled.mark()
  return error


def scheme(path) -> str | None:
  """The URL scheme of a path ("gs" for gs://bucket/ds), None for a local path."""
  match = _SCHEME.match(os.fspath(path))
  return match[1].lower() if match else None


def in_bucket(path) -> bool:
  """Whether `path` is read from a bucket: gs://, or a FUSE mount (gcsfuse, the rig's), found
  in /proc/self/mountinfo (absent off Linux: then only gs://)."""
  if scheme(path) is not None:
    return scheme(path) == "gs"
  try:
    with open("/proc/self/mountinfo") as f:
      mounts = [line.split(" - ") for line in f]
  except OSError:
    return False

  def fuse(path: str) -> bool:
    best, fstype = "", ""
    for head, tail in (m for m in mounts if len(m) == 2):
      point = head.split()[4].replace("\\040", " ")
      inside = path == point or path.startswith(point.rstrip("/") + "/")
      if inside and len(point) >= len(best):
        best, fstype = point, tail.split()[0]
    return fstype.startswith("fuse")

  # the path as written first: resolving links looks up each name, which a stalled mount holds
  return fuse(os.path.abspath(path)) or fuse(os.path.realpath(path))


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
    return f"no access ({_first_line(e)}): {LOGIN}"
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
  unresolved = _unresolved()
  if unresolved:
    missing = None if emulator else _no_credentials()
    also = f"; no credentials either ({missing}): {LOGIN}" if missing else ""
    raise RemoteStorageError(
      f"cannot read {data_dir}: cannot reach Cloud Storage ({unresolved}): check the network "
      f"and DNS{also}; {GCSFUSE}"
    )
  path = epath.Path(data_dir) / FILENAME
  try:
    call(path.stat, path)
  except FileNotFoundError:
    return
  except RemoteStorageError:
    raise
  except Exception as e:  # noqa: BLE001 - gcsfs, aiohttp, google-auth and TF raise their own
    raise RemoteStorageError(f"cannot read {path}: {explain(e)}; {GCSFUSE}") from None


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
    within(lambda: socket.getaddrinfo(host, port), ATTEMPT_S)
  except socket.gaierror as e:
    return f"{host} does not resolve: {e.strerror or e}"
  except (NoAnswer, OSError):
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
    within(google.auth.default, ATTEMPT_S)
  except exceptions.DefaultCredentialsError as e:
    return str(e).split(". ")[0]
  except Exception:  # noqa: BLE001 - a slow or odd lookup: say nothing of credentials
    pass
  return None


def _transient(e: BaseException) -> bool:
  """Whether `e` may pass if asked again: a timeout, no connection, HTTP 408, 429 or 5xx, or
  another way of saying "slow down"."""
  code = getattr(e, "code", None) or getattr(e, "status", None)
  if str(code).isdigit() and (int(code) in (408, 429) or 500 <= int(code) < 600):
    return True
  if isinstance(e, (TimeoutError, ConnectionError)) or slow_down(e):
    return True
  return explain(e).startswith("cannot reach")


def slow_down(e: BaseException) -> bool:
  """Whether `e` is storage asking for fewer requests: HTTP 429 or 503, gRPC
  RESOURCE_EXHAUSTED or UNAVAILABLE, S3's SlowDown, EAGAIN or EBUSY (from a FUSE mount), in
  the error itself or in the message a reader wrapped it in."""
  code = getattr(e, "code", None) or getattr(e, "status", None)
  if str(code).isdigit() and int(code) in (429, 503):
    return True
  if isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.EBUSY):
    return True
  return bool(_SLOW_DOWN.search(str(e)))


def backoff_s(attempt: int) -> float:
  """The wait after failed attempt `attempt` (1, 2, ...): exponential, with jitter."""
  return BACKOFF_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)


def retry(
  fn: Callable[[], T],
  what,
  slowed: Callable[[], None] = lambda: None,
  sleep: Callable[[float], None] = time.sleep,
) -> T:
  """`fn()`, a read of `what`, asked again after `backoff_s` while storage answers "slow
  down" (`slow_down`; `slowed()` is told each time), at most `SLOW_DOWN_ATTEMPTS` times; then
  `RemoteStorageError` in one line naming `what`. Any other error raises as it is."""
  for attempt in range(1, SLOW_DOWN_ATTEMPTS + 1):
    try:
      return fn()
    except Exception as e:
      if not slow_down(e):
        raise
      cause = _first_line(e)
    if attempt < SLOW_DOWN_ATTEMPTS:
      slowed()
      wait = backoff_s(attempt)
      absl_logging.log_every_n_seconds(
        absl_logging.WARNING,
        "reading %s: %s; attempt %d of %d in %.1f s (said at most every %g s)",
        SAID_EVERY_S,
        what,
        cause,
        attempt + 1,
        SLOW_DOWN_ATTEMPTS,
        wait,
        SAID_EVERY_S,
      )
      sleep(wait)
  raise RemoteStorageError(
    f"cannot read {what}: storage kept asking to slow down ({cause}; {SLOW_DOWN_ATTEMPTS} "
    "attempts): set performance.max_requests_per_s below the bucket's budget"
  )


class _Retried(logging.Filter):
  """Keeps the last error gcsfs retried by itself (it logs them at DEBUG, then tries again
  for ~35 s), so that a deadline can say what the bucket answered; lets through only the
  records the logger showed before."""

  def __init__(self, level: int):
    super().__init__()
    self.level, self.at, self.error = level, 0.0, ""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if "retrying after exception: " in message:
      self.at, self.error = time.monotonic(), message.split("exception: ", 1)[1][:200]
    return record.levelno >= self.level


_retried: _Retried | None = None


def _watch_gcsfs() -> _Retried:
  global _retried
  if _retried is None:
    logger = logging.getLogger("gcsfs")
    level = logger.getEffectiveLevel()
    for name in ("gcsfs.credentials", "gcsfs.zonal_file"):  # they would inherit DEBUG
      child = logging.getLogger(name)
      child.setLevel(child.level or level)
    _retried = _Retried(level)
    logger.addFilter(_retried)
    logger.setLevel(logging.DEBUG)
  return _retried


class NoAnswer(TimeoutError):
  """A read of a bucket that got no answer in time."""


def no_answer(path, deadline_s: float, setting: str | None = None) -> RemoteStorageError:
  """The one line for a read of `path` (gs:// or a mount) that got no answer in time; it
  names the `setting` of the deadline, if any."""
  fix = (
    f"check the network and the bucket, {GCSFUSE}"
    if scheme(path)
    else "check the mount (gcsfuse: its log and its connection)"
  )
  said = f" ({setting} sets the wait)" if setting else ""
  return _no_answer(f"cannot read {path}: no answer within {deadline_s:g} s: {fix}{said}")


def on_mount(
  fn: Callable[[], T], path, deadline_s: float | None = None, setting: str | None = None
) -> T:
  """`fn()`, a read of local `path`: within a deadline (None: `ATTEMPT_S` x `ATTEMPTS`) where
  `path` is on a FUSE mount, whose reads may never return; else `no_answer`."""
  if not in_bucket(path):
    return fn()
  deadline_s = deadline_s or ATTEMPT_S * ATTEMPTS
  try:
    return within(fn, deadline_s)
  except NoAnswer:
    raise no_answer(path, deadline_s, setting) from None


def within(fn: Callable[[], T], deadline_s: float) -> T:
  """`fn()` on a daemon thread of its own, or `NoAnswer` after `deadline_s` (the thread is
  left to finish or hang on its own: a stalled request cannot be interrupted, and a daemon
  thread does not hold up the process's exit)."""
  out: dict = {}

  def run():
    try:
      with stalled.reading():
        out["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      out["error"] = e

  thread = threading.Thread(target=run, name="pipeline-remote-read", daemon=True)
  thread.start()
  thread.join(deadline_s)
  if thread.is_alive():
    raise NoAnswer(f"no answer within {deadline_s:g} s")
  if "error" in out:
    raise out["error"]
  return out["value"]


def call(fn: Callable[[], T], what) -> T:
  """`fn()`, a read of `what` in a bucket, with a deadline per attempt and retries with
  backoff; raises `RemoteStorageError` (one line) when the bucket refuses access or keeps
  failing (no answer, no connection, HTTP 408, 429, 5xx), any other error as it is."""
  retried = _watch_gcsfs()
  begin = time.monotonic()
  for attempt in range(1, ATTEMPTS + 1):
    start = time.monotonic()
    try:
      return within(fn, ATTEMPT_S)
    except FileNotFoundError:
      raise
    except Exception as e:
      cause, silent = explain(e), isinstance(e, NoAnswer)
      if silent:
        cause = f"{e} (it answered {retried.error})" if retried.at >= start else str(e)
      if cause.startswith("no access"):
        raise RemoteStorageError(f"cannot read {what}: {cause}; {GCSFUSE}") from None
      if not _transient(e):
        raise
    if attempt < ATTEMPTS:
      wait = backoff_s(attempt)
      absl_logging.warning(
        "reading %s: %s; attempt %d of %d in %.1f s", what, cause, attempt + 1, ATTEMPTS, wait
      )
      time.sleep(wait)
  raise (_no_answer if silent else RemoteStorageError)(
    f"cannot read {what}: {cause} ({ATTEMPTS} attempts in {time.monotonic() - begin:.0f} s): "
    f"check the network and the bucket, {GCSFUSE}"
  )
