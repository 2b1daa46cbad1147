"""Decode emulation: the pipeline with its pixel work replaced by GIL-free waits.

One process's ceiling on a host with many more cores than this one: each image's decode and
resize become waits of their measured length (`decode_us`, `resize_us`) that hold no GIL,
taken once per chunk inside the native call as the pixel work would be; everything else
(reads, parse, crop draws, the per-image resize call on a 1x1 window, batching, Grain)
stays real. The library knows nothing of it: this swaps the decode stage of
`pipeline.dataset.build`'s stages before they are chained.
"""

from __future__ import annotations

import threading

import cv2
import numpy as np

from pipeline import dataset
from pipeline.images import DecodeImages


class EmulatedDecode(DecodeImages):
  """`DecodeImages` whose pixel work is a GIL-free wait (pickles to worker processes)."""

  def __init__(self, decode: DecodeImages, decode_us: float, resize_us: float):
    self.__setstate__(decode.__getstate__())
    self.emulate_ns = int((decode_us + resize_us) * 1000)

  def _init_runtime(self):
    super()._init_runtime()
    self._scratch = threading.local()

  def __getstate__(self):
    return {k: v for k, v in super().__getstate__().items() if k != "_scratch"}

  def resize(self, window: np.ndarray, out: np.ndarray) -> None:
    """The per-image call without its pixel work (waited for in the native call)."""
    one = getattr(self._scratch, "one", None)
    if one is None:
      one = self._scratch.one = np.empty((1, 1, 3), np.uint8)
    cv2.resize(window, (1, 1), dst=one)


def make_dataset(*args, emulate_us: tuple[float, float] | None = None, **kwargs):
  """`pipeline.make_dataset`, with decode and resize emulated when `emulate_us` is given."""
  stages = dataset.build(dataset.Spec.of(*args, **kwargs))
  if emulate_us is not None:
    stages.decode = EmulatedDecode(stages.decode, *emulate_us)
  return dataset.chain(stages)
