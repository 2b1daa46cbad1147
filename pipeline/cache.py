"""The record cache: stored record bytes kept on this host after their first read, so a
bucket is paid once, not every epoch.

Two tiers, both optional: RAM up to a byte budget (per process), and a local-disk folder
(shared by the host's processes, kept across restarts). Disk entries are one file per
record, written atomically (temporary name, then rename) with a CRC32 in front: an entry that
fails its check is a miss, removed and read again. Entries live under a folder named by the
dataset's shard digests, so a cache never serves the records of another dataset. What is
cached is the bytes the shard holds, never decoded pixels: the cache changes no batch.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
import zlib

_HEADER = struct.Struct("<II")  # crc32, length


class Once:
  """Per key, one thread makes a value while others wait (batches in flight overlap at an
  epoch's end, so two may want one record): `claim` gives None to the thread that must make
  it, which then `release`s the key, and to the others the Event to wait for."""

  def __init__(self):
    self._lock = threading.Lock()
    self._making: dict[int, threading.Event] = {}

  def claim(self, key: int) -> threading.Event | None:
    with self._lock:
      if key in self._making:
        return self._making[key]
      self._making[key] = threading.Event()
      return None

  def release(self, key: int) -> None:
    with self._lock:
      done = self._making.pop(key, None)
    if done is not None:
      done.set()


class RecordCache:
  """Global record index -> record bytes: RAM (`ram_bytes`) then disk (`directory`)."""

  def __init__(self, ram_bytes: int, directory: str | None, dataset_id: str, names: list[str]):
    self.ram_bytes, self.dataset_id, self.names = ram_bytes, dataset_id, names
    self.directory = os.path.join(directory, dataset_id) if directory else None
    if self.directory:  # a folder we cannot write is the user's to fix, said now, once
      try:
        os.makedirs(self.directory, exist_ok=True)
        tempfile.TemporaryFile(dir=self.directory).close()
      except OSError as e:
        raise ValueError(
          f"performance.record_cache_dir {directory}: cannot keep records there "
          f"({e.strerror or e}); give a folder on a local disk this process can write"
        ) from None
    self._init_runtime()

  def _init_runtime(self):
    self._ram: dict[int, bytes] = {}
    self._used = 0
    self._lock = threading.Lock()
    self.reading = Once()

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k not in ("_ram", "_lock", "reading")}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def _path(self, shard: int, local: int) -> str:
    return os.path.join(self.directory, self.names[shard], f"{local}.rec")

  def get(self, index: int, shard: int, local: int) -> bytes | None:
    """The record, or None (not cached, or a disk entry that failed its check)."""
    data = self._ram.get(index)
    if data is None and self.directory:
      data = self._read_disk(self._path(shard, local))
      if data is not None:
        self._keep(index, data)
    return data

  def lookup(self, index: int, shard: int, local: int) -> bytes | threading.Event | None:
    """The record if kept; else None, and the caller reads it (then `put`s it and calls
    `reading.release`); or, while another thread reads it, that read's Event to wait for."""
    data = self.get(index, shard, local)
    if data is not None:
      return data
    other = self.reading.claim(index)
    if other is not None:
      return other
    data = self.get(index, shard, local)  # kept between the first look and the claim?
    if data is not None:
      self.reading.release(index)
    return data

  def put(self, index: int, shard: int, local: int, data: bytes) -> None:
    self._keep(index, data)
    if self.directory:
      self._write_disk(self._path(shard, local), data)

  def _keep(self, index: int, data: bytes) -> None:
    with self._lock:
      if index not in self._ram and self._used + len(data) <= self.ram_bytes:
        self._ram[index] = data
        self._used += len(data)

  @staticmethod
  def _read_disk(path: str) -> bytes | None:
    try:
      with open(path, "rb") as f:
        blob = f.read()
    except FileNotFoundError:
      return None
    if len(blob) >= _HEADER.size:
      crc, size = _HEADER.unpack_from(blob)
      data = blob[_HEADER.size :]
      if len(data) == size and zlib.crc32(data) == crc:
        return data
    try:  # a damaged entry: gone, and read again from storage
      os.unlink(path)
    except OSError:
      pass
    return None

  @staticmethod
  def _write_disk(path: str, data: bytes) -> None:
    folder = os.path.dirname(path)
    try:
      os.makedirs(folder, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    except OSError:  # a full or read-only local disk costs the cache entry, never the batch
      return
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(_HEADER.pack(zlib.crc32(data), len(data)) + data)
      os.replace(tmp, path)
    except OSError:  # a full local disk costs the cache entry, never the batch
      try:
        os.unlink(tmp)
      except OSError:
        pass


def dataset_id(digests: list[str], names: list[str]) -> str:
  """A folder name for one dataset's entries: its shards' names and digests."""
  h = hashlib.sha256()
  for name, digest in zip(names, digests):
    h.update(f"{name}:{digest}\n".encode())
  return h.hexdigest()[:16]
