"""The source: a split's ArrayRecord shards as one random-access sequence of records.

`read_shard` is one `ArrayRecordReader.read(indices)` call on remote storage (the batched reads
array_record is fast at: its pool keeps one storage request per record in flight), and the
records one at a time in the calling thread on this host's disks, whose page cache answers
at once (the pool's hand-offs cost 2-3x the CPU of the reads there); the read stage
(`pipeline.stages.read`) runs one per shard of a batch, many at once. `read_range` reads
consecutive records in one request. Readers open lazily, so the source pickles to worker processes.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Sequence

import numpy as np
from array_record.python import array_record_module
from etils import epath

from pipeline.storage import backend

# Random access: no sequential read-ahead (`max_parallelism` only governs that read-ahead:
# a batched `read(indices)` of 2+ records still runs on array_record's global pool). No
# footer prefetch: opening a 1.2 MB shard then reads 126 KB, not 1 MB (in 2 requests either
# way, measured through bench/rig.py).
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0,footer_prefetch_bytes:0"
# A range read (`read_range`) on a reader with a read-ahead buffer is one request for the
# range (FUSE still cuts it into 1 MiB requests); on the reader above it is one per record.
# One record read through it is the same one request of that record's bytes.
RANGE_OPTIONS = "readahead_buffer_size:4194304,max_parallelism:1,footer_prefetch_bytes:0"


class CorruptRecordsError(OSError):
  """Records that fail Riegeli's checksums in a shard that opened fine."""


class ShardedSource:
  """Records of several shards, addressed by a global index in shard order."""

  def __init__(self, paths: Sequence[epath.Path], counts: Sequence[int], pins=None):
    self.paths = [os.fspath(p) for p in paths]
    # what each shard was when opened (backend.pin): a shard replaced since is refused
    self.pins = list(pins) if pins is not None else [backend.pin(p) for p in self.paths]
    # how each shard's reads wait (`backend.of`), looked up once per folder
    folders = {os.path.dirname(p): p for p in reversed(self.paths)}  # each folder's first
    found = {folder: backend.of(p) for folder, p in folders.items()}
    self.backends = [found[os.path.dirname(p)] for p in self.paths]
    self.names = [epath.Path(p).name for p in paths]
    self.starts = [0]
    for c in counts:
      self.starts.append(self.starts[-1] + c)
    self._ends = np.array(self.starts[1:], np.int64)
    # reads come in ranges (the block order): single records too go through the range reader,
    # so that each shard opens one reader and reads its footer once, not twice
    self.by_ranges = False
    self._init_readers()

  def _init_readers(self):
    self._readers: list = [None] * len(self.paths)
    self._range_readers: list = [None] * len(self.paths)
    self._locks = [threading.Lock() for _ in self.paths]  # shards open in parallel

  def __getstate__(self):
    drop = ("_readers", "_range_readers", "_locks")
    return {k: v for k, v in self.__dict__.items() if k not in drop}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_readers()

  def __len__(self) -> int:
    return self.starts[-1]

  def locate(self, index: int) -> tuple[int, int]:
    """(shard number, index within the shard) of a global index."""
    if not 0 <= index < len(self):
      raise IndexError(f"record {index} outside [0, {len(self)})")
    shard = bisect.bisect_right(self.starts, index) - 1
    return shard, index - self.starts[shard]

  def where(self, index: int) -> str:
    """Names a record for error messages: 'train.array_record-00003-of-00016 record 17'."""
    shard, local = self.locate(index)
    return f"{self.names[shard]} record {local}"

  def _reader(self, shard: int, ranges: bool = False):
    readers = self._range_readers if ranges else self._readers
    if readers[shard] is not None:
      return readers[shard]
    with self._locks[shard]:
      if readers[shard] is None:
        expected = self.starts[shard + 1] - self.starts[shard]
        options = RANGE_OPTIONS if ranges else READER_OPTIONS
        try:
          reader = array_record_module.ArrayRecordReader(self.paths[shard], options)
          found = reader.num_records() if reader.ok() else None
          if found != expected:
            reader.close()  # a reader that failed to open raises its error here
        except Exception as e:  # noqa: BLE001 - array_record raises plain RuntimeErrors
          raise OSError(f"cannot open shard {self.paths[shard]}: {e}") from None
        if found != expected:
          raise OSError(
            f"shard {self.paths[shard]} holds {found} records, the manifest "
            f"{expected}: it changed after conversion"
          )
        try:
          backend.check_pinned(self.paths[shard], self.pins[shard])
        except OSError:
          reader.close()
          raise
        readers[shard] = reader
      return readers[shard]

  def open_empty(self) -> None:
    """Opens each shard listed with 0 records, which no read would open: one that holds
    records is refused (an `OSError` naming it, as any shard that disagrees at open)."""
    for shard, (begin, end) in enumerate(zip(self.starts, self.starts[1:])):
      if begin == end:
        self._reader(shard)

  def shards_of(self, indices: np.ndarray) -> np.ndarray:
    """The shard number of each global index."""
    indices = np.asarray(indices, np.int64)
    if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
      bad = indices[(indices < 0) | (indices >= len(self))][0]
      raise IndexError(f"record {bad} outside [0, {len(self)})")
    return np.searchsorted(self._ends, indices, side="right")

  def read_shard(self, shard: int, local: list[int]) -> list[bytes]:
    """Records `local` (indices within the shard) of one shard, in that order: in one batched
    read from remote storage, one at a time in this thread from local files; a single record
    through the range reader when reads come in ranges (`by_ranges`)."""
    ranges = self.by_ranges and len(local) == 1
    if self.backends[shard].remote:
      read = lambda: self._reader(shard, ranges).read(local)
    else:

      def read():
        reader = self._reader(shard, ranges)
        return [reader.read(i, i + 1)[0] for i in local]

    return self._read(shard, read, f"{sorted(local)[:8]}...")

  def read_range(self, shard: int, begin: int, end: int) -> list[bytes]:
    """Records [begin, end) of one shard, in one storage request (`RANGE_OPTIONS`)."""
    return self._read(
      shard, lambda: self._reader(shard, True).read(begin, end), f"{begin} to {end - 1}"
    )

  def _read(self, shard: int, read, which: str) -> list[bytes]:
    try:
      return read()
    except OSError:
      raise
    except Exception as e:  # noqa: BLE001 - array_record raises plain RuntimeErrors
      if isinstance(e, MemoryError) or "bad_alloc" in str(e):  # out of memory: not the data
        raise MemoryError(f"out of memory reading {self.names[shard]}: {e}") from None
      raise CorruptRecordsError(f"cannot read {self.names[shard]} records {which}: {e}") from None

  def read(self, indices: Sequence[int]) -> list[bytes]:
    """The records at `indices`, in that order; one batched read per shard, in turn."""
    indices = np.asarray(indices, np.int64)
    shards = self.shards_of(indices)
    out: list[bytes] = [b""] * len(indices)
    for shard in np.unique(shards).tolist():
      slots = np.flatnonzero(shards == shard)
      recs = self.read_shard(shard, (indices[slots] - self.starts[shard]).tolist())
      for slot, rec in zip(slots.tolist(), recs):
        out[slot] = rec
    return out

  def close(self) -> None:
    for shard, lock in enumerate(self._locks):
      with lock:
        for readers in (self._readers, self._range_readers):
          if readers[shard] is not None:
            readers[shard].close()
            readers[shard] = None
