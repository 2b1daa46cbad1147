"""Stage 5 with worker processes: batches cross to the main process through a reused ring of
shared-memory blocks (`pipeline.host.shm`), written once and never copied.

Grain's own hand-off (`mp_prefetch` alone) copies every array of a batch into a fresh
shared-memory block in the worker; the main process faults the new pages in, then unmaps and
unlinks each block on ONE deletion thread: per-byte work in the one process that serves the
whole host, which capped it near 25,000 img/s (../shared/PITFALLS.md). Here:

- worker: the decode stage takes each batch's image array from this worker's ring
  (`shm.Writer`), so resize writes the pixels straight into shared memory. `Send`, the
  worker's last step, copies into a block only arrays made elsewhere (your ops' output),
  inlines arrays under INLINE_BYTES, and gives Grain a small `Sent` descriptor: no ndarray,
  nothing to copy.
- main process: `Receive` maps each block once and returns numpy views of it. A block goes
  back to its worker's ring when the last view of it is dropped, so a batch you keep is never
  overwritten; the ring grows instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

from pipeline.host import shm
from pipeline.storage import stalled

INLINE_BYTES = 64 * 1024  # arrays this small travel in the descriptor


@dataclasses.dataclass(frozen=True)
class Sent:
  """A batch in flight: per key, ("ring", block, generation, offset, dtype, shape),
  ("inline", bytes, dtype, shape), or ("value", anything else)."""

  entries: dict


class SendIterDataset(grain.IterDataset):
  """The worker's last step: each batch dict becomes a `Sent` descriptor."""

  def __init__(self, parent: grain.IterDataset, writer: shm.Writer):
    super().__init__(parent)
    self.writer = writer

  def __iter__(self) -> grain.DatasetIterator:
    return _SendIterator(self._parent.__iter__(), self.writer)

  def __str__(self) -> str:
    return "SendIterDataset"


class _SendIterator(grain.DatasetIterator):
  def __init__(self, parent: grain.DatasetIterator, writer: shm.Writer):
    super().__init__(parent)
    self.writer = writer

  def __next__(self) -> Sent:
    batch = next(self._parent)
    ring = self.writer.ring()
    entries = {}
    for key, value in batch.items():
      if not isinstance(value, np.ndarray) or value.dtype.hasobject:
        entries[key] = ("value", value)
      elif value.nbytes <= INLINE_BYTES:
        entries[key] = ("inline", value.tobytes(), value.dtype.str, value.shape)
      else:
        entries[key] = ("ring", *ring.send(value), value.dtype.str, value.shape)
    return Sent(entries)

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    self.writer.ring().abandon_sent()
    self._parent.set_state(state)


class ReceiveIterDataset(grain.IterDataset):
  """The main process's first step after `mp_prefetch`: `Sent` -> the batch dict."""

  def __iter__(self) -> grain.DatasetIterator:
    return _ReceiveIterator(self._parent.__iter__())

  def __str__(self) -> str:
    return "ReceiveIterDataset"


class _ReceiveIterator(grain.DatasetIterator):
  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)
    self.reader = shm.Reader()

  def __next__(self) -> dict[str, Any]:
    sent = next(self._parent)
    out, leases = {}, {}
    for key, entry in sent.entries.items():
      kind = entry[0]
      if kind == "value":
        out[key] = entry[1]
      elif kind == "inline":
        _, raw, dtype, shape = entry
        out[key] = np.frombuffer(raw, dtype).reshape(shape).copy()
      else:
        _, name, generation, offset, dtype, shape = entry
        lease = leases.get(name)
        if lease is None:
          lease = leases[name] = self.reader.lease(name, generation)
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        base = np.asarray(lease)[offset : offset + count * dtype.itemsize]
        out[key] = base.view(dtype).reshape(shape)
    return out

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state)

  def close(self) -> None:
    super().close()  # stops the workers first
    shm.sweep_writers()


stalled.on_leave(shm.close_rings)  # a worker's own ring
stalled.on_leave(shm.sweep_own)  # its workers' rings
