"""Decode cost estimated from the container structure, before any pixel is decoded.

Width × height bounds the memory of a decode but not its time. What else a
decoder steps through is counted here, on the raw bytes, and refused above the
limits (``rampart.config.Settings``, docs/configuration.md):

- **scans** of a JPEG (SOS markers of the first image): a progressive decoder
  walks every 8×8 block of the image once per scan, so an 88 KB file declaring
  7000×7000 with 8000 tiny scans costs libjpeg tens of seconds (about 4 ms per
  scan per 50 megapixels, measured on the 2-core CI machine). At most
  ``max_jpeg_scans``; libjpeg's own progressive scripts use 6 (grey) or 10
  (colour) scans.
- **frames** of every multi-frame format: GIF image descriptors, APNG ``acTL``
  and ``fcTL``, WebP ``ANMF`` chunks, TIFF IFDs (pages) and the MPO image count
  (``MPF`` NumberOfImages). At most ``max_frames``; only the first frame is
  classified.
- **chunks**: every length-prefixed unit a parser steps through one at a time,
  mostly in Pillow's Python code: JPEG marker segments, PNG chunks, GIF blocks
  and data sub-blocks, RIFF chunks, TIFF IFD entries. At most ``max_chunks``; a
  20 MB GIF of 255-byte sub-blocks has about 80,000.

Each walk stops as soon as a count passes its limit, so the check itself costs
at most ``max_chunks`` steps (about 0.1 s). A structure the walk cannot follow
(truncated, malformed) ends the walk without an error: the decoder then reports
it as it does today. Only ``TooManyFrames`` and ``DecodeCostTooHigh`` are raised.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from rampart.errors import DecodeCostTooHigh, TooManyFrames

__all__ = ["DEFAULT_MAX_JPEG_SCANS", "DEFAULT_MAX_CHUNKS", "DecodeCost", "check_decode_cost"]

#: Default scan limit; libjpeg writes 6 (grey) or 10 (colour) scans per progressive JPEG.
DEFAULT_MAX_JPEG_SCANS = 100
#: Default chunk limit; a 20 MB GIF of full 255-byte sub-blocks has about 80,000.
DEFAULT_MAX_CHUNKS = 100_000

# A JPEG marker after entropy-coded data: 0xFF then anything but a stuffed 0x00, RST0-7 or fill.
_MARKER_AFTER_SCAN = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_STANDALONE_MARKERS = frozenset([0x01, *range(0xD0, 0xD9)])


@dataclass
class DecodeCost:
    """What a decode of one upload will step through: ``frames``, JPEG ``scans`` and ``chunks`` (counts)."""

    format: str
    frames: int = 1
    scans: int = 0
    chunks: int = 0


class _Walk:
    """Counts as a walk goes and raises the moment a count passes its limit."""

    def __init__(self, fmt: str, max_frames: int, max_scans: int, max_chunks: int) -> None:
        self.cost = DecodeCost(fmt, frames=0)
        self.max_frames, self.max_scans, self.max_chunks = max_frames, max_scans, max_chunks

    def chunks(self, count: int = 1) -> None:
        self.cost.chunks += count
        if self.cost.chunks > self.max_chunks:
            raise DecodeCostTooHigh(
                f"the {self.cost.format} file has more than {self.max_chunks} chunks (markers, blocks or entries) "
                f"to parse; the limit is {self.max_chunks}"
            )

    def frames(self, count: int = 1, declared: bool = False) -> None:
        self.cost.frames = count if declared else self.cost.frames + count
        if self.cost.frames > self.max_frames:
            raise TooManyFrames(
                f"the image has more than {self.max_frames} frames; the limit is {self.max_frames}"
            )

    def scan(self) -> None:
        self.cost.scans += 1
        if self.cost.scans > self.max_scans:
            raise DecodeCostTooHigh(
                f"the JPEG has more than {self.max_scans} scans (a progressive decode walks the whole image once "
                f"per scan); the limit is {self.max_scans}"
            )


def check_decode_cost(data: bytes, fmt: str, max_frames: int, max_scans: int = DEFAULT_MAX_JPEG_SCANS,
                      max_chunks: int = DEFAULT_MAX_CHUNKS) -> DecodeCost:
    """Count what decoding ``data`` (sniffed as Pillow format ``fmt``) would step through.

    Returns the ``DecodeCost`` (``frames`` is at least 1). Raises ``TooManyFrames``
    (422) above ``max_frames`` frames and ``DecodeCostTooHigh`` (422) above
    ``max_scans`` JPEG scans or ``max_chunks`` chunks. Reads only ``data``; costs at
    most ``max_chunks`` loop steps plus C-speed searches of the bytes.
    """
    walk = _Walk(fmt, max_frames, max_scans, max_chunks)
    walker = _WALKERS.get(fmt)
    if walker is not None:
        try:
            walker(data, walk)
        except (IndexError, struct.error):
            pass  # a structure that cannot be followed: the decoder will say what is wrong with it
    walk.cost.frames = max(walk.cost.frames, 1)
    return walk.cost


def _walk_jpeg(data: bytes, walk: _Walk) -> None:
    """Marker segments of the first image up to EOI; scans; the MPO image count from an ``MPF`` APP2 segment."""
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            found = _MARKER_AFTER_SCAN.search(data, pos)
            if found is None:
                return
            pos = found.start()
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        walk.chunks()
        if marker == 0xD9:  # EOI: what follows (further MPO images) is not decoded
            return
        if marker in _STANDALONE_MARKERS:
            pos += 2
            continue
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if marker == 0xE2 and data[pos + 4 : pos + 8] == b"MPF\x00":
            images = _mpo_image_count(data[pos + 8 : pos + 2 + length])
            if images:
                walk.frames(images, declared=True)
        pos += 2 + length
        if marker == 0xDA:
            walk.scan()
            found = _MARKER_AFTER_SCAN.search(data, pos)
            if found is None:
                return
            pos = found.start()


def _mpo_image_count(block: bytes) -> int:
    """NumberOfImages (tag 0xB001) of an MP Index IFD (CIPA DC-007), or 0 when it cannot be read."""
    order = {b"II": "<", b"MM": ">"}.get(block[:2])
    if order is None:
        return 0
    (offset,) = struct.unpack_from(order + "I", block, 4)
    (count,) = struct.unpack_from(order + "H", block, offset)
    for index in range(min(count, 64)):
        tag, _, _, value = struct.unpack_from(order + "HHII", block, offset + 2 + 12 * index)
        if tag == 0xB001:
            return value
    return 0


def _walk_png(data: bytes, walk: _Walk) -> None:
    """Chunks up to IEND; APNG frames from ``acTL`` (declared) and ``fcTL`` (present)."""
    pos, end, controls = 8, len(data), 0
    while pos + 8 <= end:
        length, kind = struct.unpack_from(">I4s", data, pos)
        walk.chunks()
        if kind == b"acTL":
            walk.frames(struct.unpack_from(">I", data, pos + 8)[0], declared=True)
        elif kind == b"fcTL":
            controls += 1
            walk.frames(max(controls, walk.cost.frames), declared=True)
        elif kind == b"IEND":
            return
        pos += 12 + length


def _walk_gif(data: bytes, walk: _Walk) -> None:
    """Extension blocks, image descriptors (frames) and every data sub-block, up to the trailer."""
    end = len(data)
    packed = data[10]
    pos = 13 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0)
    while pos < end:
        introducer = data[pos]
        if introducer == 0x21:  # extension: label, then sub-blocks
            walk.chunks()
            pos += 2
        elif introducer == 0x2C:  # image descriptor, optional local colour table, LZW code size
            walk.frames()
            walk.chunks()
            packed = data[pos + 9]
            pos += 10 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0) + 1
        else:  # 0x3B trailer, or anything Pillow would stop at
            return
        while pos < end:
            size = data[pos]
            walk.chunks()
            pos += 1 + size
            if size == 0:
                break


def _walk_webp(data: bytes, walk: _Walk) -> None:
    """RIFF chunks after the ``WEBP`` form type; ``ANMF`` chunks are frames."""
    pos, end = 12, len(data)
    while pos + 8 <= end:
        fourcc, size = struct.unpack_from("<4sI", data, pos)
        walk.chunks()
        if fourcc == b"ANMF":
            walk.frames()
        pos += 8 + size + (size & 1)


def _walk_tiff(data: bytes, walk: _Walk) -> None:
    """The IFD chain (pages) and the entries of each IFD; a loop in the chain ends the walk. Classic TIFF: 32-bit
    offsets, 16-bit entry counts, 12-byte entries; BigTIFF (``II+``/``MM\\0+``): 64-bit offsets and counts,
    20-byte entries (read as classic, its pages would not have been counted)."""
    order = "<" if data[:2] == b"II" else ">"
    if data[2:4] in (b"+\x00", b"\x00+"):
        offset_format, count_format, entry_bytes, first_at = "Q", "Q", 20, 8
    else:
        offset_format, count_format, entry_bytes, first_at = "I", "H", 12, 4
    (offset,) = struct.unpack_from(order + offset_format, data, first_at)
    seen: set[int] = set()
    while offset and offset not in seen:
        seen.add(offset)
        (entries,) = struct.unpack_from(order + count_format, data, offset)
        walk.frames()
        walk.chunks(entries)
        next_at = offset + struct.calcsize(count_format) + entry_bytes * entries
        (offset,) = struct.unpack_from(order + offset_format, data, next_at)


_WALKERS = {"JPEG": _walk_jpeg, "PNG": _walk_png, "GIF": _walk_gif, "WEBP": _walk_webp, "TIFF": _walk_tiff}
