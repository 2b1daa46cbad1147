"""Tiny JPEGs in the rare modes (lossless, 12-bit, arithmetic-coded, hierarchical), built byte
by byte so no test depends on an encoder that writes them.

Every file is one 8x8 grayscale frame whose entropy-coded data decodes to a flat image: each
Huffman table holds a single 1-bit code for "difference 0" (and, for DCT frames, "end of block").
Arithmetic-coded frames carry zero bytes as their data: any bytes decode to something.
"""

from __future__ import annotations

import struct

SOI, EOI = b"\xff\xd8", b"\xff\xd9"


def segment(marker: int, payload: bytes) -> bytes:
  return struct.pack(">BBH", 0xFF, marker, len(payload) + 2) + payload


def frame(marker: int, height: int, width: int, precision: int = 8, ids: bytes = b"\x01") -> bytes:
  """A frame header (SOFn): one component per id, no subsampling, quantization table 0."""
  comps = b"".join(bytes([c, 0x11, 0]) for c in ids)
  return segment(marker, struct.pack(">BHHB", precision, height, width, len(ids)) + comps)


def huffman(table_class: int, symbol: int = 0) -> bytes:
  """DHT with one 1-bit code for `symbol` (class 0: DC or lossless, 1: AC), table 0."""
  return segment(0xC4, bytes([table_class << 4, 1] + [0] * 15 + [symbol]))


def scan(ss: int, se: int, ah_al: int = 0, ids: bytes = b"\x01") -> bytes:
  comps = b"".join(bytes([c, 0x00]) for c in ids)
  return segment(0xDA, bytes([len(ids)]) + comps + bytes([ss, se, ah_al]))


QUANT = segment(0xDB, bytes([0x00] + [1] * 64))


def lossless(precision: int = 8, arithmetic: bool = False, ids: bytes = b"\x01") -> bytes:
  """SOF3 (Huffman) or SOF11 (arithmetic) lossless, predictor 1; ids b"RGB" make an RGB one."""
  head = frame(0xCB if arithmetic else 0xC3, 8, 8, precision, ids) + scan(1, 0, ids=ids)
  if arithmetic:
    return SOI + head + bytes(16) + EOI
  return SOI + huffman(0) + head + bytes(8 * len(ids)) + EOI


def sequential(precision: int = 12, marker: int = 0xC1) -> bytes:
  """A DCT frame (SOF0/SOF1, 8 or 12 bits): one block, DC difference 0, end of block."""
  tables = QUANT + huffman(0) + huffman(1)
  return SOI + tables + frame(marker, 8, 8, precision) + scan(0, 63) + b"\x3f" + EOI


def arithmetic(marker: int = 0xC9, precision: int = 8) -> bytes:
  """SOF9 (sequential) or SOF10 (progressive DC scan) arithmetic-coded, default conditioning."""
  se = 63 if marker == 0xC9 else 0
  return SOI + QUANT + frame(marker, 8, 8, precision) + scan(0, se) + bytes(16) + EOI


def hierarchical(marker: int = 0xC5) -> bytes:
  """A differential frame marker (SOF5-7, SOF13-15) where a plain frame is expected."""
  tables = QUANT + huffman(0) + huffman(1)
  return SOI + tables + frame(marker, 8, 8) + scan(0, 63) + b"\x3f" + EOI


RARE = {
  "lossless8": lossless(8),
  "lossless12": lossless(12),
  "lossless16": lossless(16),
  "lossless_rgb": lossless(8, ids=b"RGB"),
  "lossless_ycc": lossless(8, ids=b"\x01\x02\x03"),
  "lossless_rgb12": lossless(12, ids=b"RGB"),
  "lossless_rgb_arith": lossless(8, arithmetic=True, ids=b"RGB"),
  "lossless_arith": lossless(8, arithmetic=True),
  "extended12": sequential(12, 0xC1),
  "baseline12": sequential(12, 0xC0),
  "arith_sequential": arithmetic(0xC9),
  "arith_progressive": arithmetic(0xCA),
  "arith12": arithmetic(0xC9, 12),
  "hierarchical": hierarchical(0xC5),
  "hierarchical_arith": hierarchical(0xCD),
}


def hidden_frame_bomb() -> bytes:
  """A 64x64 JPEG whose first frame, hidden behind `FF 00 LL LL`, is a progressive 65500x65500.

  A marker walk that reads `FF 00 LL LL` as a segment of length LLLL sees only the 64x64 frame;
  libjpeg skips `FF 00` and the length bytes as stray data and decodes the hidden frame, whose
  coefficient buffer (progressive) takes gigabytes: issue 20's 313-byte file, rebuilt.
  """
  hidden = QUANT + huffman(0) + frame(0xC2, 65500, 65500) + scan(0, 0)
  visible = QUANT + huffman(0) + huffman(1) + frame(0xC0, 64, 64) + scan(0, 63)
  blocks = bytes([0b00000000] * 16)  # 64 blocks x ('0' DC, '0' EOB) = 128 bits
  return SOI + b"\xff\x00" + struct.pack(">H", len(hidden) + 2) + hidden + visible + blocks + EOI
