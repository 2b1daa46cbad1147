"""Stage 4, ops: a decoded `Batch` -> the batch dict the user gets.

Labels are range-checked against the manifest's classes, extra features are filled, your
per-image ops run (on this stage's threads, each image with its own generator, seeing its
example if it asks), failed slots are handled by the error policy, then your batch ops.
An image op's output that has the batch's shape and dtype is written back into the decoded
batch array (no second array, no stacking copy); only ops that change them pay for one.
The output is {"image", "label"[, features][, "mask"]} plus the batch's skip count under
SKIPPED_KEY, which `pipeline.stages.stream` sums and removes. Rows the mask leaves out have
label PAD_LABEL (-1): a one-hot of zeros and never a correct prediction, so a client that does
not read the mask cannot count them as real.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.catalog import records
from pipeline.pp import contract as ops
from pipeline.pp import features as features_lib
from pipeline.stages import errors
from pipeline.stages.ahead import Threads
from pipeline.stages.plan import Batch

SKIPPED_KEY = "_skipped"
PAD_LABEL = -1  # the label of a row the mask leaves out (padding, a skipped record)
_UNLABELED = "; -1 is TFDS's 'no label': this split is unlabeled, read a labeled one"


class FinishBatch:
  """The ops stage, a plain map: `Batch` -> dict."""

  def __init__(
    self,
    *,
    num_classes: int,
    seed: int,
    num_threads: int,
    on_error: str,
    with_mask: bool,
    image_ops: Sequence = (),
    batch_ops: Sequence = (),
    features: dict | None = None,
  ):
    self.num_classes, self.seed, self.num_threads = num_classes, seed, num_threads
    self.on_error, self.with_mask = on_error, with_mask
    self.image_ops, self.batch_ops, self.features = tuple(image_ops), tuple(batch_ops), features
    self.threads = Threads(num_threads, "pipeline-ops")
    self.wants_example = tuple(ops.takes_example(op) for op in self.image_ops)

  def __call__(self, batch: Batch) -> dict[str, np.ndarray]:
    self._check_labels(batch)
    n = len(batch.indices)
    arrays = None
    if self.features:
      arrays = features_lib.allocate(self.features, n)
    op_images: list = [None] * n
    if self.image_ops or arrays is not None:
      todo = np.flatnonzero(batch.real & ~batch.bad).tolist()
      step = max(1, -(-len(todo) // (2 * self.num_threads)))
      chunks = [todo[k : k + step] for k in range(0, len(todo), step)]
      for future in [
        self.threads.submit(self._extras, batch, c, arrays, op_images) for c in chunks
      ]:
        future.result()
    ok = batch.real & ~batch.bad
    reshaped = any(im is not None for im in op_images)
    images = _stack(op_images, ok, batch.images) if reshaped else batch.images
    images[~ok] = 0
    out = {"image": images, "label": batch.labels.astype(np.int32)}
    if arrays is not None:
      out.update(arrays)
    if batch.sources is not None:  # a mixture's (`pipeline.mixture`), with its features
      out["source"] = batch.sources.astype(np.int32)
      out.update(batch.extras or {})
    if self.with_mask:
      out["label"][~ok] = PAD_LABEL
      out["mask"] = ok
    else:
      _fill_skipped(out, ok)
    if self.batch_ops:
      out = ops.apply_batch(self.batch_ops, out, ops.batch_rng(self.seed, batch.index))
    out[SKIPPED_KEY] = np.int64((batch.real & batch.bad).sum())
    return out

  def _check_labels(self, batch: Batch) -> None:
    ok = batch.real & ~batch.bad
    out_of_range = ok & ((batch.labels < 0) | (batch.labels >= self.num_classes))
    for slot in np.flatnonzero(out_of_range):
      why = _UNLABELED if batch.labels[slot] == records.UNLABELED else ""
      error = errors.BadRecordError(
        f"{errors.where(batch, slot)}: label {batch.labels[slot]} outside "
        f"[0, {self.num_classes}) of the manifest's classes{why}"
      )
      errors.fail(batch, slot, error, self.on_error)

  def _extras(self, batch: Batch, slots: list[int], arrays, op_images: list) -> None:
    """Extra features and per-image ops of some good slots."""
    for slot in slots:
      try:
        if arrays is not None:
          features_lib.fill(self.features, batch.records[slot], arrays, slot)
        if self.image_ops:
          rng = ops.reused_example_rng(self.seed, int(batch.epochs[slot]), int(batch.indices[slot]))
          example = None
          if any(self.wants_example):
            own = {k: v[slot] for k, v in arrays.items()} if arrays is not None else None
            example = ops.example_view(batch.labels[slot], own)
          image = batch.images[slot]
          out = ops.apply(self.image_ops, image, rng, example, self.wants_example)
          if out.shape == image.shape and out.dtype == image.dtype:
            if out is not image:
              _write(image, out)  # into the batch: no stacking copy later
          else:
            op_images[slot] = out
      except records.RecordError as e:
        error = errors.BadRecordError(f"{errors.where(batch, slot)}: {e}")
        errors.fail(batch, slot, error, self.on_error)
      except Exception as e:  # a user's op failed: say on which record
        raise ops.OpError(f"{errors.where(batch, slot)}: {type(e).__name__}: {e}") from e


def _write(slot: np.ndarray, image: np.ndarray) -> None:
  """`slot[...] = image`; an HxWx3 uint8 view (e.g. `image[:, ::-1]`) is copied a pixel at a
  time (3-byte items: ~3x numpy's byte-at-a-time copy of a reversed view)."""
  if image.ndim == 3 and image.shape[2] == 3 and image.strides[2] == 1 and slot.strides[2] == 1:
    np.copyto(slot.view("V3"), image.view("V3"))
  else:
    np.copyto(slot, image)


def _stack(images: list[np.ndarray | None], ok: np.ndarray, decoded: np.ndarray) -> np.ndarray:
  """The per-image ops' outputs as one array (failed and padding slots zero); a slot left
  None kept the decoded image's shape and dtype (written back into `decoded`)."""
  images = [decoded[k] if im is None else im for k, im in enumerate(images)]
  done = [im for im, good in zip(images, ok) if good]
  if not done:
    raise errors.BadRecordError("every record of a batch was bad; see the warnings above")
  first = done[0]
  out = np.zeros((len(images), *first.shape), first.dtype)
  for slot, (im, good) in enumerate(zip(images, ok)):
    if good:
      if im.shape != first.shape or im.dtype != first.dtype:
        raise ValueError(
          f"per-image ops gave {im.dtype}{list(im.shape)} and "
          f"{first.dtype}{list(first.shape)} in one batch: they must agree"
        )
      out[slot] = im
  return out


def _fill_skipped(batch: dict[str, np.ndarray], ok: np.ndarray) -> None:
  """Train batches keep their shape: a skipped slot repeats a good example of the batch."""
  bad, good = np.flatnonzero(~ok), np.flatnonzero(ok)
  if len(bad) and not len(good):
    raise errors.BadRecordError("every record of a batch was bad; see the warnings above")
  for k, slot in enumerate(bad):
    for v in batch.values():
      v[slot] = v[good[k % len(good)]]
