"""The record cache: stored record bytes kept on this host after their first read, so a
bucket is paid once, not every epoch.

Two tiers, both optional: RAM up to a byte budget (per process), and a local-disk folder
(shared by the host's processes, kept across restarts). Disk entries are one file per
record, written atomically (temporary name, then rename), behind a header that ties them to
their record: a digest of (dataset, shard, the shard's identity when it was read, record
index), the length and the CRC32C of the bytes. An entry that is not a regular file or fails
any of these checks (damaged, swapped, copied or linked from another record's entry, or
filled from a shard since replaced) is a miss, removed and read again. Entries live under a
folder named by the dataset's shard digests. What is cached is the bytes the shard holds,
never decoded pixels: the cache changes no batch. (`DecodedCache` keeps decoded pixels for
the decode stage: decoding.cache_mb.)
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Callable

import google_crc32c
import numpy as np

from pipeline.storage import backend

SLOW_READ_S = 0.002  # reads at least this slow get the record cache by default
CACHE_MEMORY_SHARE = 0.25  # of the available memory the default record cache may take

_MAGIC = b"GPR2"
_HEADER = struct.Struct("<4s16sQI")  # magic, digest of the record's key, length, crc32c


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


class DecodedCache:
  """Record index -> its decoded image, up to `capacity` bytes (per process); an image is made
  once even when two batches in flight hold its record. Pickles as its capacity: each process
  fills its own."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self._lock = threading.Lock()
    self._images: dict[int, np.ndarray] = {}
    self._making = Once()
    self._used = 0

  def __getstate__(self):
    return {"capacity": self.capacity}

  def __setstate__(self, state):
    self.__init__(state["capacity"])

  def get(self, index: int, make: Callable[[], np.ndarray]) -> np.ndarray:
    """The image of record `index`; `make()` makes it where not kept, kept if it fits."""
    image = self._images.get(index)
    if image is not None:
      return image
    other = self._making.claim(index)
    if other is not None:
      other.wait()
      image = self._images.get(index)
      return image if image is not None else make()  # it did not fit
    try:
      image = make()
      with self._lock:
        if index not in self._images and self._used + image.nbytes <= self.capacity:
          self._images[index] = image
          self._used += image.nbytes
    finally:
      self._making.release(index)
    return image


class RecordCache:
  """Global record index -> record bytes: RAM (`ram_bytes`) then disk (`directory`).

  `names`: the shards' file names; `shard_keys`: each shard's identity as opened
  (`backend.cache_key` of its pin), so entries read from another version of a shard are
  never served. RAM holds this process's reads of this open, keyed by record index.
  """

  def __init__(
    self,
    ram_bytes: int,
    directory: str | None,
    dataset_id: str,
    names: list[str],
    shard_keys: list[str],
  ):
    self.ram_bytes, self.dataset_id, self.names = ram_bytes, dataset_id, names
    self.shard_keys = shard_keys
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

  def _key(self, shard: int, local: int) -> bytes:
    """What a disk entry must name to be served as record `local` of `shard` as opened."""
    key = f"{self.dataset_id}\0{self.names[shard]}\0{self.shard_keys[shard]}\0{local}"
    return hashlib.blake2b(key.encode(), digest_size=16).digest()

  def get(self, index: int, shard: int, local: int) -> bytes | None:
    """The record, or None (not cached, or a disk entry that failed its checks)."""
    data = self._ram.get(index)
    if data is None and self.directory:
      data = _read_entry(self._path(shard, local), self._key(shard, local))
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
      _write_entry(self._path(shard, local), self._key(shard, local), data)

  def _keep(self, index: int, data: bytes) -> None:
    with self._lock:
      if index not in self._ram and self._used + len(data) <= self.ram_bytes:
        self._ram[index] = data
        self._used += len(data)


def _read_entry(path: str, key: bytes) -> bytes | None:
  """The bytes of the entry at `path` if it is a regular file written for `key`, whole;
  else None, and an entry that exists is removed (it is read again from storage)."""
  try:  # no symlinks followed; a FIFO opens without waiting, and is refused below
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  except FileNotFoundError:
    return None
  except OSError:  # a symlink (ELOOP), or not ours to read
    fd = None
  if fd is not None:
    with os.fdopen(fd, "rb") as f:
      blob = f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    if len(blob) >= _HEADER.size:
      magic, named, size, crc = _HEADER.unpack_from(blob)
      data = blob[_HEADER.size :]
      if (magic, named, size) == (_MAGIC, key, len(data)) and google_crc32c.value(data) == crc:
        return data
  try:
    os.unlink(path)
  except OSError:
    pass
  return None


def _write_entry(path: str, key: bytes, data: bytes) -> None:
  folder = os.path.dirname(path)
  try:
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
  except OSError:  # a full or read-only local disk costs the cache entry, never the batch
    return
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(_HEADER.pack(_MAGIC, key, len(data), google_crc32c.value(data)) + data)
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


def record_cache(shards, created_by: dict, ram_bytes: int, directory, pins) -> RecordCache:
  """The record cache of `shards` (a manifest's, `created_by` its provenance) with `ram_bytes`
  of RAM and `directory` (or None) on disk; its entries tied to the shards as opened (`pins`).
  How much it holds is the host plan's (`pipeline.planner.cache_bytes`)."""
  names = [s.file for s in shards]
  return RecordCache(
    ram_bytes,
    directory,
    # a TFDS build records no digests: its dataset info's fingerprint names it instead
    dataset_id([s.sha256 or created_by.get("fingerprint", "") for s in shards], names),
    names,
    [backend.cache_key(p) for p in pins],
  )
