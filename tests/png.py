"""A minimal PNG reader for test screenshots (8-bit RGB/RGBA, not interlaced): no imaging library needed."""
from __future__ import annotations

import struct
import zlib
from typing import List, Tuple

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunks(data: bytes):
    pos = len(SIGNATURE)
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        yield data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length


def _paeth_row(raw: bytes, prev: bytes, bpp: int) -> bytearray:
    """Paeth and Average depend on the pixel to the left: decoded byte by byte."""
    out = bytearray(raw)
    for i in range(len(out)):
        a = out[i - bpp] if i >= bpp else 0
        b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        out[i] = (out[i] + pred) & 0xFF
    return out


def _average_row(raw: bytes, prev: bytes, bpp: int) -> bytearray:
    out = bytearray(raw)
    for i in range(len(out)):
        a = out[i - bpp] if i >= bpp else 0
        out[i] = (out[i] + ((a + prev[i]) >> 1)) & 0xFF
    return out


def read_png(path: str) -> np.ndarray:
    """The image as a ``[height, width, channels]`` uint8 array."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != SIGNATURE:
        raise ValueError(f"{path} is not a PNG file")
    header, idat = None, b""
    for kind, body in _chunks(data):
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    width, height, depth, color_type, _, _, interlace = header
    if depth != 8 or color_type not in (2, 6) or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, color type {color_type}, interlace {interlace}")
    bpp = 3 if color_type == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(idat)
    rows: List[np.ndarray] = []
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)]
        cur = np.frombuffer(line, dtype=np.uint8)
        if kind == 1:  # Sub: a running sum per channel
            row = np.cumsum(cur.reshape(width, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # Up
            row = cur + prev
        elif kind == 3:
            row = np.frombuffer(_average_row(line, prev.tobytes(), bpp), dtype=np.uint8)
        elif kind == 4:
            row = np.frombuffer(_paeth_row(line, prev.tobytes(), bpp), dtype=np.uint8)
        else:
            row = cur.copy()
        rows.append(row)
        prev = row
    return np.stack(rows).reshape(height, width, bpp)


def size_of(path: str) -> Tuple[int, int]:
    """(width, height) from the IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24])
