"""Reads of storage that may stall or fail (a bucket, a FUSE mount): deadlines, retries, and
one line naming the fix (`RemoteStorageError`) instead of a long traceback or a hang. What a
kind of storage needs before it is read is its backend's (`pipeline.storage.backend`).

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
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from absl import logging as absl_logging

from pipeline.storage import stalled

T = TypeVar("T")
ATTEMPT_S = 20.0  # deadline of one attempt (gcsfs retries a 5xx by itself within it)
ATTEMPTS = 3
BACKOFF_S = 1.0  # before the second attempt; doubled for each next, times 0.5-1.5 (jitter)
SLOW_DOWN_ATTEMPTS = 6  # of a read storage answers "slow down": waits of ~1+2+4+8+16 s
SAID_EVERY_S = 10.0  # a warning per retry of a read, at most this often

LOGIN = (
  "run `gcloud auth application-default login`, or on a TPU/GCE VM give its service account "
  "Storage Object Viewer on the bucket"
)
GCSFUSE = "or mount the bucket with gcsfuse and pass the mount path"
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
