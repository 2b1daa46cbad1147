"""A mixture's plan and decode stages (`pipeline.mixture`): each slot's source, and each
source's slots decoded by its own head on the one decode pool, checked, its ops run and its
features read, and mapped into one batch (a source's slots gathered into a pooled buffer,
decoded, then copied into place; or, where its head makes the batch's images as they are,
decoded straight into its rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.host.pool import BatchPool
from pipeline.pp import features as features_lib
from pipeline.stages.decode import task_size
from pipeline.stages.plan import Batch, PlanBatches


@dataclasses.dataclass(frozen=True)
class MixPlan(PlanBatches):
  """`PlanBatches` that also says each slot's source."""

  def __call__(self, batch_index: int) -> Batch:
    first = batch_index * self.batch_size
    epochs, indices, sources = self.sampler.planned(np.arange(first, first + self.batch_size))
    return Batch(int(batch_index), epochs, indices, sources=sources)


@dataclasses.dataclass(eq=False)
class MixDecode:
  """The decode stage of a mixture: each source's slots decoded by its own head (`parts`)
  on the one pool of threads, its labels checked and its ops run (`checks`), its labels
  mapped to the mixture's (`tables`), all into one batch."""

  parts: list
  checks: list
  tables: list
  names: list
  prefetch: int
  image: tuple | None = None  # (shape, dtype) of every source's images; None: the heads'
  features: dict | None = None  # each source's features (alike: `pipeline.mixture`)
  allocate: object = None

  def __post_init__(self):
    self.allocate = self.allocate or BatchPool().empty
    self.threads = self.parts[0].threads
    self._pool = BatchPool(keep=len(self.parts))
    for part in self.parts:  # one pool of threads; each source's slots in a pooled buffer
      part.threads, part.allocate = self.threads, self._pool.empty

  @property
  def head(self):
    return self.parts[0].head

  def depth(self) -> int:
    return self.prefetch

  def start(self, batch: Batch) -> tuple[Batch, list]:
    n, size = len(batch.indices), self.head.image_size
    shape, dtype = self.image or ((size, size, 3), np.uint8)
    batch.images = self.allocate((n, *shape), dtype)
    batch.labels, batch.bad = np.zeros(n, np.int64), np.zeros(n, bool)
    if self.features:
      batch.extras = features_lib.allocate(self.features, n)
    started, step = [], task_size(n, self.parts[0].num_threads)  # the batch's tasks, not more
    for s in np.unique(batch.sources).tolist():
      slots = np.flatnonzero(batch.sources == s)
      sub = Batch(
        batch.index,
        batch.epochs[slots],
        batch.indices[slots],
        records=[batch.records[k] for k in slots],
        where=batch.where,
      )
      if self._in_place(s, batch.images):  # decoded straight into its rows: no copy
        sub.images, sub.rows = batch.images, slots
      started.append((s, slots, self.parts[s].start(sub, step)))
    return batch, started

  def _in_place(self, s: int, images: np.ndarray) -> bool:
    """Whether source `s`'s head makes the batch's images as they are (no image ops after it)."""
    size = self.parts[s].head.image_size
    return (
      not self.checks[s].image_ops
      and images.shape[1:] == (size, size, 3)
      and (images.dtype == np.uint8)
    )

  def finish(self, started: tuple[Batch, list]) -> Batch:
    batch, parts = started
    for s, slots, part in parts:
      sub = self.parts[s].finish(part)
      if sub.rows is not None:  # its images in place: the checks see none (it has no ops)
        sub.images = np.empty((len(slots), 0, 0, 3), np.uint8)
      out = self.checks[s](sub)
      image = out["image"]
      if sub.rows is None:
        if image.shape[1:] != batch.images.shape[1:] or image.dtype != batch.images.dtype:
          raise ValueError(
            f"source {self.names[s]!r}'s ops give {image.dtype}{list(image.shape[1:])}, the "
            f"mixture's images are {batch.images.dtype}{list(batch.images.shape[1:])}: every "
            "source's images must come out alike (its image_size=, pp= or ops=)"
          )
        batch.images[slots] = image
      for key, array in (batch.extras or {}).items():
        array[slots] = out[key]
      batch.bad[slots] = ~out["mask"]
      batch.labels[slots] = self.tables[s][np.where(out["mask"], sub.labels, 0)]
    return batch
