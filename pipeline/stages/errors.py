"""The error policy: a bad record raises, or under `on_error="skip"` is logged and skipped.

Errors name the shard file and the record's index in it, whichever stage found them.
"""

from __future__ import annotations

from absl import logging

from pipeline.stages.plan import Batch


class BadRecordError(ValueError):
  """A record that cannot be used; the message names its shard file and index."""


def where(batch: Batch, slot: int) -> str:
  """'train.array_record-00003-of-00016 record 17' for a slot of a batch."""
  return batch.where(int(batch.indices[slot]))


def fail(batch: Batch, slot: int, error: BadRecordError, on_error: str) -> None:
  """Raises `error`, or marks the slot bad ("skip")."""
  if on_error == "raise":
    raise error
  logging.warning("skipping %s", error)
  batch.bad[slot] = True
