"""Decode-cost bombs, built byte by byte: small files whose decode costs far more than width × height says.

Used by ``bench/decode_bench`` and the tests. Every builder returns ``bytes``:

- ``progressive_jpeg``: a valid greyscale progressive JPEG of ``side``×``side`` with
  ``scans`` scans (one DC scan, then the same AC band again and again, coded as
  end-of-band runs). libjpeg walks every 8×8 block once per scan: 7000×7000 with
  8000 scans is about 0.2 MB and costs tens of seconds.
- ``many_frames(fmt, frames)``: ``frames`` tiny frames in GIF, APNG, WebP, TIFF or
  MPO (Pillow's own encoders; GIF on a 7000×7000 screen, by hand).
- ``many_chunks(fmt, chunks)``: a small noise image behind ``chunks`` empty
  units a parser steps through one by one: JPEG COM segments, PNG private
  chunks or GIF comment extensions.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

__all__ = ["progressive_jpeg", "many_frames", "many_chunks", "MULTI_FRAME_FORMATS", "CHUNK_FORMATS"]

MULTI_FRAME_FORMATS = ("GIF", "PNG", "WEBP", "TIFF", "MPO")
CHUNK_FORMATS = ("JPEG", "PNG", "GIF")


def _segment(marker: int, payload: bytes) -> bytes:
    return b"\xff" + bytes([marker]) + struct.pack(">H", len(payload) + 2) + payload


class _BitWriter:
    """MSB-first bits with JPEG byte stuffing (0xFF is followed by 0x00); padded with 1 bits."""

    def __init__(self) -> None:
        self.out, self.acc, self.count = bytearray(), 0, 0

    def put(self, value: int, length: int) -> None:
        for shift in range(length - 1, -1, -1):
            self.acc = (self.acc << 1) | ((value >> shift) & 1)
            self.count += 1
            if self.count == 8:
                self.out.append(self.acc)
                if self.acc == 0xFF:
                    self.out.append(0)
                self.acc, self.count = 0, 0

    def bytes(self) -> bytes:
        while self.count:
            self.put(1, 1)
        return bytes(self.out)


def progressive_jpeg(side: int = 7000, scans: int = 8000) -> bytes:
    """A greyscale progressive JPEG (SOF2) of ``side``×``side`` px with ``scans`` scans (≥ 1); flat grey."""
    blocks = ((side + 7) // 8) ** 2
    dqt = _segment(0xDB, b"\x00" + bytes([1]) * 64)
    sof = _segment(0xC2, struct.pack(">BHHB", 8, side, side, 1) + b"\x01\x11\x00")
    # DC table 0: one 1-bit code for category 0. AC table 0: 4-bit codes for EOB0..EOB14 (ITU T.81 G.1.2.2).
    dht = _segment(0xC4, b"\x00" + bytes([1] + [0] * 15) + b"\x00"
                   + b"\x10" + bytes([0, 0, 0, 15] + [0] * 12) + bytes(range(0, 0xF0, 0x10)))
    dc = _BitWriter()
    for _ in range(blocks):
        dc.put(0, 1)
    ac, left = _BitWriter(), blocks
    while left:
        run = min(left, 32767)
        size = run.bit_length() - 1
        ac.put(size, 4)
        ac.put(run - (1 << size), size)
        left -= run
    ac_scan = _segment(0xDA, b"\x01\x01\x00\x01\x3f\x00") + ac.bytes()
    dc_scan = _segment(0xDA, b"\x01\x01\x00\x00\x00\x00") + dc.bytes()
    return b"\xff\xd8" + dqt + sof + dht + dc_scan + ac_scan * (scans - 1) + b"\xff\xd9"


def _tiny_frames(count: int, side: int = 16) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(count)]


def many_frames(fmt: str, frames: int) -> bytes:
    """A ``fmt`` file (GIF, PNG = APNG, WEBP, TIFF or MPO) with ``frames`` frames."""
    if fmt == "GIF":  # 1-pixel frames on a 7000×7000 screen: Pillow's seek would paint the screen per frame
        screen = b"GIF89a" + struct.pack("<HH", 7000, 7000) + b"\x00\x00\x00"
        frame = b"\x2c" + struct.pack("<HHHH", 0, 0, 1, 1) + b"\x00\x02\x02\x44\x01\x00"
        return screen + frame * frames + b";"
    first, *rest = _tiny_frames(frames, 64 if fmt == "MPO" else 16)
    buffer = io.BytesIO()
    first.save(buffer, format=fmt, save_all=True, append_images=rest)
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def many_chunks(fmt: str, chunks: int) -> bytes:
    """A valid 64×64 ``fmt`` image (JPEG, PNG or GIF) carrying ``chunks`` extra empty units before its pixels."""
    image = _tiny_frames(1, 64)[0]
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    data = buffer.getvalue()
    if fmt == "JPEG":
        return data[:2] + _segment(0xFE, b"") * chunks + data[2:]
    if fmt == "PNG":
        ihdr_end = 8 + 25
        return data[:ihdr_end] + _png_chunk(b"raNd", b"") * chunks + data[ihdr_end:]
    if fmt == "GIF":
        packed = data[10]
        header_end = 13 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0)
        return data[:header_end] + b"\x21\xfe\x00" * chunks + data[header_end:]
    raise ValueError(f"no chunk bomb for {fmt}")
