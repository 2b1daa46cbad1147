"""Image decoding: read the size from the header, then decode only the crop window.

The batch path decodes in a `pipeline.image._jpeg.BatchDecoder` (`images.batch_decoder`); the rest
are the per-image functions of the Python path. JPEGs go through `pipeline.image._jpeg`
(libjpeg-turbo with `jpeg_crop_scanline` and `jpeg_skip_scanlines`, DCT scaling, GIL
released), the equivalent of tf.data's `decode_and_crop_jpeg`. If the extension was not built,
simplejpeg decodes the whole image. Other formats (PNG, GIF, CMYK JPEG, ...) fall back to
Pillow. Output is always uint8 RGB.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import io
import os
import re

import numpy as np
import PIL
import simplejpeg
from PIL import Image

from pipeline.image import fallback


def _soname_abi(lib: str) -> int | None:
  """The libjpeg API version a library's name promises (libjpeg.so.62 -> 62, .so.8 -> 80)."""
  major = re.search(r"\.so\.(\d+)", os.path.basename(lib))
  if major is None:
    return None
  return int(major.group(1)) * (1 if int(major.group(1)) >= 62 else 10)


def libraries(abi: int | None) -> list[str]:
  """The libjpegs to try for an extension compiled against API version `abi`, best first:
  Pillow's bundled libjpeg-turbo 3 (as fast as simplejpeg's, 15% faster than Debian's 2.1),
  then the system's. A library of another API refuses every image ("Wrong JPEG library
  version"), so those are left out (Ubuntu's headers are API 80, Pillow's library 62)."""
  bundled = glob.glob(
    os.path.join(os.path.dirname(PIL.__file__), os.pardir, "pillow.libs", "libjpeg*.so*")
  )
  names = sorted(bundled) + ["libjpeg.so.62", "libjpeg.so.8", "libjpeg.so.9", "libjpeg.so"]
  return [lib for lib in names if abi is None or _soname_abi(lib) in (abi, None)]


def _compiled_abi() -> int | None:
  """The libjpeg API version `_jpeg` was compiled against, read without importing it."""
  spec = importlib.util.find_spec("pipeline.image._jpeg")
  if spec is None or not spec.origin:
    return None
  try:
    return ctypes.CDLL(spec.origin, mode=os.RTLD_LAZY).pipeline_jpeg_lib_version()
  except (OSError, AttributeError):
    return None


def _load_libjpeg() -> int | None:
  """Loads a libjpeg of the API `_jpeg` was compiled against, before `_jpeg` is imported;
  returns that API version."""
  abi = _compiled_abi()
  for lib in libraries(abi):
    try:
      ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
      break
    except OSError:
      continue
  return abi


_abi = _load_libjpeg()
_missing: str | None = None  # why the extension did not load
try:
  from pipeline.image import _jpeg
except ImportError as e:  # not built, or no libjpeg found: simplejpeg decodes whole images
  _jpeg = None
  _missing = str(e) or type(e).__name__
  if _abi is not None:
    _missing += f" (it needs a libjpeg of API version {_abi})"
_reported = False
MISSING = (
  "pipeline: the C JPEG decoder (pipeline/image/_jpeg.c) is not available ({why}): whole images "
  "are decoded by simplejpeg instead, about half the throughput (176 vs 355 img/s measured "
  "on 2 cores); install libjpeg-dev and rebuild (pip install -e . or make setup)"
)


def native():
  """The C extension (`pipeline/image/_jpeg.c`), or None where it was not built; the first call
  without it says so once per process on stderr, with the cost, as `pip` only says it
  with -v."""
  global _reported
  if _jpeg is None and not _reported:
    _reported = True
    import sys

    print(MISSING.format(why=_missing), file=sys.stderr, flush=True)
  return _jpeg


# Pillow's decompression-bomb limit; the C decoder enforces its own copy (one #define, exported
# as `_jpeg.MAX_PIXELS`) on the frame libjpeg reads, and this is that number.
MAX_PIXELS = _jpeg.MAX_PIXELS if _jpeg is not None else 89_478_485
# Raster formats only: Pillow would hand EPS/PS to Ghostscript if it were installed.
FORMATS = (
  "JPEG",
  "PNG",
  "GIF",
  "BMP",
  "WEBP",
  "TIFF",
  "PPM",
  "TGA",
  "ICO",
  "JPEG2000",
  "AVIF",
  "PSD",
  "PCX",
  "SGI",
  "QOI",
)


class DecodeError(ValueError):
  """Image bytes that cannot be decoded."""


def _is_jpeg(data: bytes) -> bool:
  return data[:2] == b"\xff\xd8"  # what libjpeg takes for one (stray bytes may follow)


_PLAIN_SOF = (0xC0, 0xC1, 0xC2)  # baseline, extended sequential, progressive (Huffman)


def geometry():
  """Whose example key, draws, crop windows, DCT scale and frame walk: the C extension's (the
  functions its batch path calls), or their Python twins (`pipeline.image.fallback`) without it."""
  return _jpeg if _jpeg is not None else fallback


def jpeg_frame(data: bytes) -> tuple[int, int, int, int] | None:
  """(SOF marker, precision, height, width) of the frame libjpeg decodes, or None: the header
  walked as libjpeg walks it (bytes between segments, fill FFs and stuffed `FF 00` skipped)."""
  return geometry().frame(data)


NO_EOI = "no end-of-image marker (FF D9) after the image data: the JPEG is truncated"


def _without_strays(data: bytes) -> tuple[bytes, int]:
  """(the JPEG without bytes between its header segments, which libjpeg skips and strict
  decoders refuse; where its image data starts)."""
  parts, at = [data[:2]], 2
  for m, start, end in fallback.segments(data):
    parts.append(data[start:end])
    at = end
    if m == 0xDA:
      break
  header = b"".join(parts)
  return (data, at) if data.startswith(header) else (header + data[at:], len(header))


def _as_libjpeg_reads_it(data: bytes) -> bytes:
  """The JPEG `_without_strays`; a DecodeError if no end-of-image marker follows its image
  data, whatever part of it a decoder would read: the C decoder's checks, for the others."""
  data, at = _without_strays(data)
  if data.rfind(b"\xff\xd9", at) < 0:
    raise DecodeError(f"JPEG decode failed: {NO_EOI}")
  return data


def plain_jpeg(data: bytes) -> bool:
  """True for 8-bit Huffman-coded baseline/progressive JPEGs, the ones the fast decoders take.

  Lossless, 12-bit, arithmetic-coded and hierarchical JPEGs are not: simplejpeg's scaled
  decode corrupts the heap on a lossless one, so they go to Pillow, which decodes them whole
  or refuses them.
  """
  f = jpeg_frame(data)
  return f is not None and f[0] in _PLAIN_SOF and f[1] == 8


def image_size(data: bytes) -> tuple[int, int]:
  """(height, width) from the header alone; refuses decompression bombs."""
  try:
    if _is_jpeg(data):
      if _jpeg:
        h, w = _jpeg.header(data)
      else:
        h, w = simplejpeg.decode_jpeg_header(_without_strays(data)[0])[:2]
    else:
      with Image.open(io.BytesIO(data), formats=FORMATS) as im:
        w, h = im.size
  except Exception as e:  # noqa: BLE001 - any header failure is a bad image
    raise DecodeError(f"unreadable image header ({type(e).__name__}: {e})") from None
  if h * w > MAX_PIXELS:
    raise DecodeError(f"{w}x{h} image exceeds the {MAX_PIXELS}-pixel limit")
  if h < 1 or w < 1:
    raise DecodeError(f"empty image ({w}x{h})")
  return h, w


def _pil_rgb(data: bytes) -> np.ndarray:
  try:
    with Image.open(io.BytesIO(data), formats=FORMATS) as im:
      im.seek(0)
      if im.mode not in ("RGB", "L"):
        im = im.convert("RGBA").convert("RGB") if "A" in im.mode or im.mode == "P" else im
      return np.asarray(im.convert("RGB"))
  except Exception as e:  # noqa: BLE001 - Pillow raises many kinds
    raise DecodeError(f"cannot decode image ({type(e).__name__}: {e})") from None


def decode_crop(
  data: bytes, box: tuple[int, int, int, int], scale: int = 1, fast_dct: bool = False
) -> np.ndarray:
  """Decodes window `box` = (y, x, h, w) at 1/`scale` resolution (1, 2, 4 or 8) as uint8 RGB.

  `fast_dct` uses libjpeg's fast integer IDCT (tf.data's default), slightly less exact.
  """
  y, x, h, w = box
  jpeg = _is_jpeg(data)
  if jpeg and plain_jpeg(data):
    if _jpeg is not None:
      try:
        buf, oh, ow = _jpeg.decode_crop(data, y, x, h, w, scale, fast_dct)
        return np.frombuffer(buf, np.uint8).reshape(oh, ow, 3)
      except ValueError as e:
        if "not for this decoder" not in str(e):  # CMYK/YCCK, lossless, 12-bit: Pillow
          raise DecodeError(str(e)) from None
    else:
      data = _as_libjpeg_reads_it(data)  # the pixels libjpeg (and the C decoder) gives
      try:
        full_h, full_w = image_size(data)  # simplejpeg scales the whole image, then we crop
        _inside(box, full_h, full_w, jpeg)
        img = simplejpeg.decode_jpeg(
          data,
          colorspace="RGB",
          strict=True,
          fastdct=fast_dct,
          min_height=-(-full_h // scale),
          min_width=-(-full_w // scale),
        )
        f = img.shape[0] / full_h
        return img[
          int(y * f) : int(y * f) + max(1, int(h * f)), int(x * f) : int(x * f) + max(1, int(w * f))
        ]
      except ValueError as e:
        if "colorspace" not in str(e).lower():
          raise DecodeError(str(e)) from None
  img = _pil_rgb(_as_libjpeg_reads_it(data) if jpeg else data)
  _inside(box, *img.shape[:2], jpeg)
  return img[y : y + h, x : x + w]


def _inside(box: tuple[int, int, int, int], h: int, w: int, jpeg: bool) -> None:
  """Refuses a window that is not inside the h x w image, in the C decoder's words."""
  y, x, ch, cw = box
  if y < 0 or x < 0 or ch <= 0 or cw <= 0 or y + ch > h or x + cw > w:
    what = "JPEG decode failed: " if jpeg else ""
    raise DecodeError(f"{what}crop (y={y}, x={x}, h={ch}, w={cw}) outside {h}x{w}")


def decode(data: bytes) -> np.ndarray:
  """Decodes a whole image as uint8 RGB (any format Pillow reads)."""
  h, w = image_size(data)
  return decode_crop(data, (0, 0, h, w))
