"""Decoding cases several test modules share: the decode limits of the in-process decoding tests and
hostile PNG builders."""

from __future__ import annotations

import struct
import zlib

from rampart.inputs.decoding import DecodeLimits


LIMITS = DecodeLimits(
    max_body_bytes=20_000_000, max_pixels=50_000_000, min_side_px=16, max_aspect_ratio=10.0,
    max_frames=100, min_decoded_side=692,
)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, ``kind``, ``data`` and its CRC-32."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """An 8-bit grayscale PNG whose IHDR claims width×height, with one compressed row."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" + b"\x00" * width, 9)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
