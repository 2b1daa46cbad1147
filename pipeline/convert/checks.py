"""Image checks at conversion time: what is stored untouched, what is re-encoded, what is skipped.

Policy: a JPEG (grayscale or YCbCr/RGB) that the pipeline's decoder decodes is stored byte for
byte: one simplejpeg decodes strictly once the bytes between its header segments are dropped
(libjpeg skips them with a warning, and so does `pipeline.image.decode`). Anything else Pillow can
decode (PNG, GIF, BMP, WebP, TIFF, CMYK/YCCK JPEG, a PNG named .jpg, a JPEG with corrupt image
data that libjpeg papers over, 16-bit images) is converted to RGB and re-encoded as a
quality-95 JPEG, so every stored image decodes with the fast JPEG path. Empty, truncated
("premature end" of data) and non-image files, files Pillow cannot decode either, and
decompression bombs raise `BadImage`.
EXIF orientation is not applied: stored bytes keep their tag, re-encoded pixels keep their
stored orientation, as tf.image.decode_jpeg and simplejpeg read them.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import simplejpeg
from PIL import Image

from pipeline.image import decode

MAX_PIXELS = decode.MAX_PIXELS  # Pillow's own decompression-bomb threshold
REENCODE_QUALITY = 95
_JPEG_MAGIC = b"\xff\xd8\xff"
_SIMPLEJPEG_COLORSPACES = ("Gray", "YCbCr", "RGB")


class BadImage(ValueError):
  """An input that cannot become a record; the message is the reason listed in `skipped`."""


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
  if width * height > max_pixels:
    raise BadImage(f"decompression bomb: {width}x{height} pixels > limit {max_pixels}")


def _jpeg_fast_path(data: bytes, max_pixels: int) -> tuple[str | None, tuple[int, int]]:
  """(None, (height, width)) if simplejpeg decodes `data` strictly as libjpeg reads it (bytes
  between header segments dropped), else (why not, size)."""
  data = decode._without_strays(data)[0]
  try:
    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
  except ValueError as e:
    return f"jpeg header unreadable by simplejpeg ({e})", (0, 0)
  _check_pixels(width, height, max_pixels)
  if colorspace not in _SIMPLEJPEG_COLORSPACES:
    return f"{colorspace} jpeg", (height, width)
  if not decode.plain_jpeg(data):  # before simplejpeg's scaled decode, which it can crash
    return f"{_jpeg_mode(data)} jpeg", (height, width)
  try:
    # The smallest DCT scale still entropy-decodes every block, so truncation and corrupt
    # data are caught at about half the cost of a full decode.
    simplejpeg.decode_jpeg(data, "RGB", min_height=1, min_width=1)
  except ValueError as e:
    if "premature end" in str(e).lower():
      raise BadImage(f"truncated or corrupt JPEG: {e}") from None
    return f"jpeg decoder warning ({e})", (height, width)
  return None, (height, width)


_JPEG_MODES = {
  0xC3: "lossless",
  0xC9: "arithmetic-coded",
  0xCA: "arithmetic-coded progressive",
  0xCB: "lossless arithmetic-coded",
}


def _jpeg_mode(data: bytes) -> str:
  """Names what makes a JPEG unfit for the fast path, e.g. "lossless" or "12-bit"."""
  frame = decode.jpeg_frame(data)
  if frame is None:
    return "irregular (no frame header found)"
  marker, precision, _, _ = frame
  if marker in decode._PLAIN_SOF:
    return f"{precision}-bit"
  return _JPEG_MODES.get(marker, "hierarchical")


def _to_rgb(im: Image.Image) -> Image.Image:
  """Converts any Pillow mode to RGB; high bit depth is scaled down, not clipped."""
  if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
    a = np.asarray(im, dtype=np.float64)
    top = 65535.0 if im.mode != "F" and a.max() > 255 else max(float(a.max()), 255.0)
    im = Image.fromarray(np.clip(a * (255.0 / top), 0, 255).astype(np.uint8))
  return im.convert("RGB")


def _decode_pil(data: bytes, max_pixels: int) -> tuple[Image.Image, str]:
  """Fully decodes with Pillow: (RGB image, "format mode"); raises `BadImage` with the reason."""
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", Image.DecompressionBombWarning)
      im = Image.open(io.BytesIO(data), formats=decode.FORMATS)  # no EPS/Ghostscript
    _check_pixels(*im.size, max_pixels)
    kind = f"{(im.format or 'unknown').lower()} {im.mode}"
    im.load()
    return _to_rgb(im), kind
  except BadImage:
    raise
  except Image.UnidentifiedImageError:
    if data.startswith(_JPEG_MAGIC) and not decode.plain_jpeg(data):
      raise BadImage(f"unsupported {_jpeg_mode(data)} JPEG: Pillow cannot decode it") from None
    raise BadImage("not an image: unrecognised format") from None
  except Image.DecompressionBombError as e:
    raise BadImage(f"decompression bomb: {e}") from None
  except (OSError, SyntaxError, ValueError, EOFError) as e:
    raise BadImage(f"truncated or corrupt image: {e}") from None


def encode_jpeg(im: Image.Image) -> bytes:
  buf = io.BytesIO()
  im.save(buf, "JPEG", quality=REENCODE_QUALITY)
  return buf.getvalue()


def _fast(data: bytes, max_pixels: int) -> tuple[str | None, tuple[int, int]]:
  if not data:
    raise BadImage("empty file")
  if data.startswith(_JPEG_MAGIC):
    return _jpeg_fast_path(data, max_pixels)
  return "not a jpeg", (0, 0)


def inspect(data: bytes, max_pixels: int = MAX_PIXELS) -> str | None:
  """Checks an image decodes; returns None if simplejpeg reads it as is, else why not."""
  why, _ = _fast(data, max_pixels)
  if why is None:
    return None
  _, kind = _decode_pil(data, max_pixels)
  return f"{kind}: {why}"


def prepare(
  data: bytes, *, max_size: int | None = None, max_pixels: int = MAX_PIXELS
) -> tuple[bytes, str | None]:
  """Returns (bytes to store, why re-encoded or None); raises `BadImage` for a bad input.

  With `max_size`, images whose shorter side exceeds it are resized to that shorter side.
  """
  why, size = _fast(data, max_pixels)
  if why is None and (max_size is None or min(size) <= max_size):
    return data, None
  im, kind = _decode_pil(data, max_pixels)
  reasons = [f"{kind}: {why}"] if why else []
  side = min(im.size)
  if max_size is not None and side > max_size:
    scale = max_size / side
    im = im.resize(
      (max(1, round(im.width * scale)), max(1, round(im.height * scale))),
      Image.BICUBIC,
      reducing_gap=3.0,
    )
    reasons.append(f"shorter side {side} > {max_size}")
  return encode_jpeg(im), "; ".join(reasons)


def decode_rgb(data: bytes) -> np.ndarray:
  """Fully decodes stored image bytes to RGB uint8 HWC (simplejpeg, else Pillow)."""
  if data.startswith(_JPEG_MAGIC) and decode.plain_jpeg(data):
    try:
      return simplejpeg.decode_jpeg(data, "RGB")
    except ValueError:
      pass
  return np.asarray(_decode_pil(data, max_pixels=1 << 62)[0])
