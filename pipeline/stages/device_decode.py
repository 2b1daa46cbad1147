"""Stage 3 with `decoding.on="device"`: windows decoded by nvImageCodec (`pipeline.image.nvdecode`)
on this process's GPUs (its CPU backend without one), in place of the C decoder.

The host parses each record and reads its header, draws the window and flip from (seed, epoch,
index) exactly as the C path does (`augment.Head`), and hands the compressed bytes and windows to
nvImageCodec in one batch call per task; each window comes back to the host, is flipped and
resized into its batch slot (OpenCV, the host path's filters). What nvImageCodec cannot decode, and
what is not a plain JPEG, takes the host's Python path, which decodes it or names the record in
today's words. Batches stay host arrays: `device_prefetch` moves them as it moves the C path's.
"""

from __future__ import annotations

import dataclasses

from pipeline.catalog import records
from pipeline.image import augment, decode, nvdecode
from pipeline.stages.decode import DecodeImages
from pipeline.stages.plan import Batch
from pipeline.storage.source import CorruptRecordsError


def check(decoding) -> None:
  """Refuses, in one line each, what `decoding.on="device"` cannot do."""
  if not nvdecode.available():
    raise ValueError(f"decoding.on='device' needs nvImageCodec: {nvdecode.EXTRA}")
  if decoding.cache_mb:
    raise ValueError(
      "decoding.on='device' decodes every window from its JPEG: set decoding.cache_mb=0 "
      "(the decoded-image cache is the host path's)"
    )
  if decoding.fast_dct:
    raise ValueError("decoding.fast_dct is the C decoder's (nvImageCodec has none): set it False")


@dataclasses.dataclass(eq=False)
class DeviceDecodeImages(DecodeImages):
  """`DecodeImages` with windows decoded by `windows` (an `nvdecode.Windows`)."""

  windows: nvdecode.Windows | None = None

  def load(self, batch: Batch, native_records: list, start: int, stop: int) -> None:
    """Slots [start, stop): windows of plain JPEGs in one nvImageCodec call, the rest (and what it
    refused) on the Python path, which decodes them or raises today's error line."""
    head, real = self.head, batch.real.tolist()
    jobs, host = [], []  # (slot, data, full size, box, flips); slots for the Python path
    for slot in range(start, stop):
      record = batch.records[slot]
      if not real[slot]:
        continue
      if isinstance(record, CorruptRecordsError):
        self._fail(batch, slot, f"corrupt record ({record})")
        continue
      try:
        data, batch.labels[slot], _ = records.parse(record, self.keys)
        if not decode.plain_jpeg(data):
          host.append(slot)
          continue
        full = decode.image_size(data)
      except (records.RecordError, decode.DecodeError) as e:
        self._fail(batch, slot, str(e))
        continue
      key = augment.example_key(self.seed, int(batch.epochs[slot]), int(batch.indices[slot]))
      jobs.append((slot, data, full, head.box(*full, key), head.flips(key)))
    windows = self.windows.decode([j[1] for j in jobs], [j[3] for j in jobs]) if jobs else []
    for (slot, _, full, _, flips), window in zip(jobs, windows):
      if window is None:
        host.append(slot)
      else:
        head.finish(window[:, ::-1] if flips else window, full, batch.images[slot])
    for slot in host:
      self._python_slot(batch, slot)


def stage(decode_stage: DecodeImages, gpus: list[int]) -> DeviceDecodeImages:
  """`decode_stage` (the C path's, as `dataset.build` makes it) decoding on `gpus` instead."""
  fields = {f.name: getattr(decode_stage, f.name) for f in dataclasses.fields(DecodeImages)}
  fields.update(decoder=None, windows=nvdecode.Windows(gpus))
  head = fields.pop("head")
  return DeviceDecodeImages(head, **fields)
