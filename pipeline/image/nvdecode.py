"""Crop windows of JPEGs decoded by nvImageCodec: on the process's local GPUs, else its CPU backend.

The optional `gpu` extra installs nvImageCodec and nvJPEG (`pip install 'grain-pipeline[gpu]'`).
Each thread that asks gets its own `nvimgcodec.Decoder` (GPUs taken in turn by threads); a window
is one region decode, no DCT scaling, EXIF orientation ignored and libjpeg's "fancy" chroma
upsampling, as the C decoder (`pipeline/image/_jpeg.c`). On the CPU backend (libjpeg-turbo's
ISLOW IDCT) windows are the C decoder's to the bit; nvJPEG's IDCT on a GPU differs slightly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import re
import sys
import tempfile
import threading

import numpy as np

EXTRA = (
  "pip install 'grain-pipeline[gpu]' (nvImageCodec for CUDA 13; nvidia-nvimgcodec-cu12 for 12)"
)
# nvImageCodec's loader prints these for codecs it has no library for (JPEG 2000, TIFF).
_UNUSED_CODECS = re.compile(r"nvjpeg2k|nvtiff|nvTIFF|nvJPEG2000|Note: If using nvImageCodec")
_OPTIONS = ":fancy_upsampling=1"  # libjpeg's default chroma upsampling, as the C decoder's


def available() -> bool:
  """Whether nvImageCodec is installed (the `gpu` extra)."""
  return importlib.util.find_spec("nvidia.nvimgcodec") is not None


def local_gpus() -> list[int]:
  """The CUDA ordinals of this process's local GPUs as JAX sees them; [] without one."""
  import jax

  return [d.local_hardware_id for d in jax.local_devices() if d.platform == "gpu"]


def describe(gpus: list[int]) -> str:
  """Where windows are decoded, for the plan line."""
  if not gpus:
    return "nvImageCodec's CPU backend (no GPU here)"
  return f"nvImageCodec on GPU {', '.join(map(str, gpus))}"


@contextlib.contextmanager
def _quiet_codec_loader():
  """Drops nvImageCodec's lines about codecs without a library (printed by its C++ loader on
  file descriptor 2); every other line it wrote is written back."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      kept = [
        line
        for line in caught.read().decode(errors="replace").splitlines(keepends=True)
        if not _UNUSED_CODECS.search(line)
      ]
      sys.stderr.write("".join(kept))


def _module():
  os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")  # failures fall back to the host path
  with _quiet_codec_loader():
    from nvidia import nvimgcodec

  return nvimgcodec


class Windows:
  """`decode(jpegs, boxes)`: each (y, x, h, w) window as a uint8 h x w x 3 host array, or None
  where nvImageCodec could not decode it. `gpus`: CUDA ordinals ([]: the CPU backend)."""

  def __init__(self, gpus: list[int]):
    self.gpus = list(gpus)
    self._local = threading.local()
    self._turn = itertools.count()
    self._nv = None

  def __getstate__(self):
    return {"gpus": self.gpus}

  def __setstate__(self, state):
    self.__init__(state["gpus"])

  def _decoder(self):
    decoder = getattr(self._local, "decoder", None)
    if decoder is None:
      nv = self._nv = self._nv or _module()
      with _quiet_codec_loader():
        if self.gpus:
          device = self.gpus[next(self._turn) % len(self.gpus)]
          decoder = nv.Decoder(device_id=device, max_num_cpu_threads=1, options=_OPTIONS)
        else:
          cpu = [nv.Backend(nv.BackendKind.CPU_ONLY)]
          device = nv.NVIMGCODEC_DEVICE_CPU_ONLY
          decoder = nv.Decoder(
            device_id=device, max_num_cpu_threads=1, backends=cpu, options=_OPTIONS
          )
      params = nv.DecodeParams(
        apply_exif_orientation=False,
        color_spec=nv.ColorSpec.SRGB,
        sample_format=nv.SampleFormat.I_RGB,
      )
      self._local.decoder, self._local.params = decoder, params
    return decoder, self._local.params

  def decode_on_device(self, jpegs: list[bytes], boxes: list[tuple]) -> list:
    """The windows as nvImageCodec `Image`s, where they were decoded (a GPU's memory: DLPack
    and `__cuda_array_interface__` hand them on without a copy), None where one failed."""
    decoder, params = self._decoder()
    nv = self._nv
    streams = []
    for data, (y, x, h, w) in zip(jpegs, boxes):
      try:
        region = nv.Region(y, x, y + h, x + w)
        streams.append(nv.CodeStream(data).get_sub_code_stream(region=region))
      except RuntimeError:  # a header nvImageCodec cannot parse
        streams.append(None)
    todo = [s for s in streams if s is not None]
    done = iter(decoder.decode(todo, params=params) if todo else [])
    return [None if s is None else next(done) for s in streams]

  def decode(self, jpegs: list[bytes], boxes: list[tuple]) -> list[np.ndarray | None]:
    out = []
    for image in self.decode_on_device(jpegs, boxes):
      if image is not None:
        image = np.asarray(image.cpu())
        image = image if image.ndim == 3 and image.shape[2] == 3 else None
      out.append(image)
    return out
