"""Decode emulation: the pipeline with its pixel work replaced by GIL-free waits.

One process's ceiling on a host with many more cores than this one: each image's decode and
resize become one wait of their measured length (`decode_us + resize_us`) that holds no GIL,
taken once per chunk in the decoder's call as the pixel work would be; everything else (reads,
batching, Grain, the Python per image and its resize call, here a copy of a window already at
size) stays real. The library knows nothing of it: `Waits` is the decoder this passes to the
decode stage of `pipeline.dataset.build`'s stages before they are chained.
"""

from __future__ import annotations

import dataclasses
import time

from pipeline import dataset


class Waits:
  """A stand-in for `_jpeg.BatchDecoder` (same call) that decodes nothing: each chunk waits
  `wait_us` per image without the GIL (time.sleep) and hands back every window at `size` x
  `size`, so the stage's resize is a copy (train heads: resize_then_crop's still resizes),
  unless given the batch's `images` to resize into, as the decoder's bilinear resize is."""

  def __init__(self, size: int, wait_us: float):
    self.size, self.wait_s = size, wait_us / 1e6

  def __call__(
    self,
    records,
    epochs,
    indices,
    labels,
    dims,
    arena,
    start,
    stop,
    sizes=None,
    images=None,
    rows=None,
  ):
    # with `images` the decoder resizes into the batch itself: no window left to the stage
    dims[start:stop] = 0 if images is not None else self.size
    if sizes is not None:
      sizes[start:stop] = self.size
    time.sleep(self.wait_s * (stop - start))
    return []


def make_dataset(*args, emulate_us: tuple[float, float] | None = None, **kwargs):
  """`pipeline.make_dataset`, with decode and resize emulated when `emulate_us` is given."""
  stages = dataset.build(dataset.Spec.of(*args, **kwargs))
  if emulate_us is not None:
    waits = Waits(stages.decode.head.image_size, sum(emulate_us))
    stages.decode = dataclasses.replace(stages.decode, decoder=waits)
  return dataset.chain(stages)
