"""Block reads: a block's consecutive records in one storage request, kept until taken.

In the block order (`pipeline.order.blocks`) a window's batches take the records of the same
blocks, each block's records spread over the window. `BlockReads` reads a block whole the
first time one of its records is wanted (one range read: one request, the block's bytes),
hands each record out once, and keeps the rest for the batches that want them, within a
byte budget (the oldest blocks go first; a record asked for after its block went is read
again, with its block). Two batches read at once that want one block wait for one read.
Each range read runs through the caller's `request` (the read stage's: the request budget's
turn, a deadline, retries after "slow down").
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

Request = Callable[[int, Callable[[], list]], list]  # (shard, read) -> read()'s records


def _direct(shard: int, read: Callable[[], list]) -> list:
  return read()


class BlockReads:
  """Records of one source by (shard, index within the shard), read block by block.

  read_range(shard, begin, end): the shard's records [begin, end), one request;
  shard_records: each shard's record count; budget_bytes: the most record bytes kept.
  """

  def __init__(
    self,
    read_range: Callable[[int, int, int], list],
    shard_records: list[int],
    block_records: int,
    budget_bytes: int,
  ):
    self.read_range, self.shard_records = read_range, shard_records
    self.block_records, self.budget_bytes = block_records, budget_bytes
    self._init_runtime()

  def _init_runtime(self):
    self._lock = threading.Lock()
    # block -> {index in shard: [record, copies]}: a block read again at an epoch's turn
    # while records of its last read still wait holds two copies of them
    self._kept: collections.OrderedDict = collections.OrderedDict()
    self._reading: dict = {}  # block -> Event set when its read ends
    self.kept_bytes = 0
    self.requests = self.bytes = self.taken = 0  # range reads, their bytes, records handed out

  def __getstate__(self):
    keep = ("read_range", "shard_records", "block_records", "budget_bytes")
    return {k: self.__dict__[k] for k in keep}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_runtime()

  def read(self, shard: int, local: list[int], request: Request = _direct) -> list:
    """The records `local` of `shard`, in that order (errors of a range read raise); each
    range read is `request(shard, read)`."""
    out: list = [None] * len(local)
    wanted = collections.defaultdict(list)
    for k, i in enumerate(local):
      wanted[(shard, i // self.block_records)].append(k)
    for block, ks in wanted.items():
      for k, rec in zip(ks, self._take(block, [local[k] for k in ks], request)):
        out[k] = rec
    return out

  def _take(self, block: tuple[int, int], local: list[int], request: Request) -> list:
    """Each of `local` (a batch across two epochs may name one twice) from the block's
    kept copies, after one more read of the block whole if those are too few."""
    need = collections.Counter(local)
    while True:
      with self._lock:
        kept = self._kept.get(block, {})
        if all(kept.get(i, (b"", 0))[1] >= n for i, n in need.items()):
          self.taken += len(local)
          return [self._pop(block, kept, i) for i in local]
        waiting = self._reading.get(block)
        if waiting is None:
          self._reading[block] = threading.Event()
          break
      waiting.wait()
    try:
      records = self._read_block(block, request)
      first = block[1] * self.block_records
      with self._lock:
        kept = self._kept.setdefault(block, {})
        for i, rec in enumerate(records, first):
          if i not in kept:
            kept[i] = [rec, 0]
            self.kept_bytes += len(rec)
          kept[i][1] += 1  # one more copy: an epoch's turn may want a record twice
        taken = [self._pop(block, kept, i) if i in kept else records[i - first] for i in local]
        self.taken += len(local)
        while self.kept_bytes > self.budget_bytes and len(self._kept) > 1:
          self._drop(next(iter(self._kept)))
      return taken
    finally:
      with self._lock:
        self._reading.pop(block).set()

  def _read_block(self, block: tuple[int, int], request: Request) -> list:
    shard, b = block
    begin = b * self.block_records
    end = min(begin + self.block_records, self.shard_records[shard])
    records = request(shard, lambda: self.read_range(shard, begin, end))
    with self._lock:
      self.requests += 1
      self.bytes += sum(len(r) for r in records)
    return records

  def _pop(self, block, kept: dict, i: int) -> bytes:
    rec, copies = kept[i]
    if copies > 1:
      kept[i][1] -= 1
      return rec
    del kept[i]
    self.kept_bytes -= len(rec)
    if not kept:
      self._kept.pop(block, None)
    return rec

  def _drop(self, block) -> None:
    self.kept_bytes -= sum(len(rec) for rec, _ in self._kept.pop(block).values())
