"""Block reads: a block's consecutive records in one storage request, kept until taken.

In the block order (`pipeline.order.blocks`) a window's batches take the records of the same
blocks, each block's records spread over the window. `BlockReads` reads a block whole the
first time one of its records is wanted (one range read: one request, the block's bytes),
hands each record out once, and keeps the rest for the batches that want them, within a
byte budget (the oldest blocks go first; a record asked for after its block went is read
again, with its block). Where the shares of the blocks are cut at records
(`pipeline.order.blocks.Blocks.cuts`), a read stops at a cut: a process reads only its part of
a cut block. Two batches read at once that want one block wait for one read, and
share its failure: a block storage did not answer fails them all at once, not one deadline
after another.
Each range read runs through the caller's `request` (`pipeline.storage.fetch.Fetcher`'s: the
request budget's turn, a deadline, retries after "slow down"). With a `BlockStore`
(`pipeline.storage.blockstore`), the worker processes of a host share each block's read
through shared memory instead, and none keeps blocks of its own.
"""

from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import threading
from collections.abc import Callable

from pipeline.storage.blockstore import BlockStore

Request = Callable[[int, Callable[[], list]], list]  # (shard, read) -> read()'s records


def _direct(shard: int, read: Callable[[], list]) -> list:
  return read()


@dataclasses.dataclass
class _Reading:
  """A block's read in flight: `done` is set when it ends, with `error` if it failed."""

  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  error: BaseException | None = None


def _again(error: BaseException) -> BaseException:
  """A copy of `error` for another thread to raise (its own traceback), else `error`."""
  try:
    return copy.copy(error)
  except Exception:  # noqa: BLE001 - an exception its own args cannot rebuild
    return error


class BlockReads:
  """Records of one source by (shard, index within the shard), read block by block.

  read_range(shard, begin, end): the shard's records [begin, end), one request;
  shard_records: each shard's record count; budget_bytes: the most record bytes kept;
  store: the host's blocks, shared by its worker processes (None: this process's own);
  cuts: each shard's records (indices within it, sorted) where a read stops inside a block.
  A block is keyed (shard, its first record): an aligned run of `block_records`, cut there.
  """

  def __init__(
    self,
    read_range: Callable[[int, int, int], list],
    shard_records: list[int],
    block_records: int,
    budget_bytes: int,
    store: BlockStore | None = None,
    cuts: dict[int, list[int]] | None = None,
  ):
    self.read_range, self.shard_records = read_range, shard_records
    self.block_records, self.budget_bytes, self.store = block_records, budget_bytes, store
    self.cuts = cuts or {}
    self._init_runtime()

  def _init_runtime(self):
    self._lock = threading.Lock()
    # block -> {index in shard: [record, copies]}: a block read again at an epoch's turn
    # while records of its last read still wait holds two copies of them
    self._kept: collections.OrderedDict = collections.OrderedDict()
    self._reading: dict[tuple[int, int], _Reading] = {}  # block -> its read in flight
    self.kept_bytes = 0
    self.requests = self.bytes = self.taken = 0  # range reads, their bytes, records handed out

  def __getstate__(self):
    keep = ("read_range", "shard_records", "block_records", "budget_bytes", "store", "cuts")
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
      wanted[(shard, self._bounds(shard, i)[0])].append(k)
    for block, ks in wanted.items():
      for k, rec in zip(ks, self._take(block, [local[k] for k in ks], request)):
        out[k] = rec
    return out

  def _bounds(self, shard: int, i: int) -> tuple[int, int]:
    """[begin, end) of the block read that brings record `i` of `shard`: its aligned run of
    `block_records`, cut where a share's part of a cut block begins."""
    begin = i - i % self.block_records
    end = min(begin + self.block_records, self.shard_records[shard])
    cuts = self.cuts.get(shard, ())
    k = bisect.bisect_right(cuts, i)
    if k:
      begin = max(begin, cuts[k - 1])
    if k < len(cuts):
      end = min(end, cuts[k])
    return begin, end

  def _take(self, block: tuple[int, int], local: list[int], request: Request) -> list:
    """Each of `local` (a batch across two epochs may name one twice) from the block's
    kept copies, after one more read of the block whole if those are too few (with a store:
    the host's copy, read once for all its processes)."""
    if self.store is not None:
      got = self.store.take(
        block, [i - block[1] for i in local], lambda: self._read_block(block, request)
      )
      with self._lock:
        self.taken += len(local)
      return got
    need = collections.Counter(local)
    while True:
      with self._lock:
        kept = self._kept.get(block, {})
        if all(kept.get(i, (b"", 0))[1] >= n for i, n in need.items()):
          self.taken += len(local)
          return [self._pop(block, kept, i) for i in local]
        waiting = self._reading.get(block)
        if waiting is None:
          reading = self._reading[block] = _Reading()
          break
      waiting.done.wait()
      if waiting.error is not None:
        raise _again(waiting.error)
    try:
      records = self._read_block(block, request)
      first = block[1]
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
    except Exception as e:
      reading.error = e
      raise
    finally:
      with self._lock:
        self._reading.pop(block).done.set()

  def _read_block(self, block: tuple[int, int], request: Request) -> list:
    shard, begin = block
    end = self._bounds(shard, begin)[1]
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
