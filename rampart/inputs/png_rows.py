"""Whether a PNG's image data yields every row its header declares.

Pillow's PNG decoder stops without an error when the zlib stream in the ``IDAT`` chunks
ends cleanly before the last row: the rows never decoded stay as the image buffer was
allocated (zeros, black), and ``load()`` returns as for a whole file. libspng refuses such
a file ("IDAT stream too short"), and so does Rampart's rule for damaged uploads (pixel data
materially missing: 400 ``corrupt_image``, docs/api.md "Damaged uploads").

Rows are decoded in order, so a non-interlaced image whose last row holds any non-zero
byte was decoded to its end (``last_row_written``: a look at one row, the common case).
Otherwise, and for every Adam7-interlaced image, ``yields_every_row`` inflates the ``IDAT``
stream again and counts its bytes against what the header declares (PNG specification,
sections 7.2 and 8.2: each row is a filter byte and its packed pixels; Adam7's seven
passes are rows of sub-images), keeping none of them.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
from PIL import Image

__all__ = ["declared_data_bytes", "last_row_written", "png_header", "sample_bytes_per_pixel", "yields_every_row"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHUNK_HEAD = struct.Struct(">I4s")
#: IHDR's data: width, height (px), bit depth, colour type, compression, filter, interlace method.
_IHDR = struct.Struct(">IIBBBBB")
#: Samples per pixel by colour type (PNG specification, table 11.1).
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
#: Adam7's passes: first column, first row, column step, row step (PNG specification, section 8.2).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
#: Inflated bytes counted per step: the count keeps at most this much in memory.
_STEP_BYTES = 1 << 18


def png_header(data: bytes) -> tuple[int, int, int, int, int] | None:
    """(width px, height px, bit depth, colour type, interlace method) from the ``IHDR`` chunk that must follow
    the PNG signature at the start of ``data``; None when either is not there."""
    if not data.startswith(_SIGNATURE) or len(data) < 8 + 8 + _IHDR.size:
        return None
    length, kind = _CHUNK_HEAD.unpack_from(data, 8)
    if kind != b"IHDR" or length != _IHDR.size:
        return None
    width, height, depth, colour, _, _, interlace = _IHDR.unpack_from(data, 16)
    return width, height, depth, colour, interlace


def sample_bytes_per_pixel(data: bytes) -> float | None:
    """Bytes a pixel of the PNG ``data`` holds in its samples (bit depth × channels, from IHDR); None when the
    header cannot be read or names an unknown colour type."""
    ihdr = png_header(data)
    channels = None if ihdr is None else _CHANNELS.get(ihdr[3])
    return None if channels is None else ihdr[2] * channels / 8


def declared_data_bytes(width: int, height: int, depth: int, colour: int, interlace: int) -> int:
    """Bytes the inflated image data must hold for an image of this header: per row, a filter byte and
    ``ceil(width × channels × depth / 8)`` bytes of pixels; for Adam7 (``interlace`` 1), summed over the
    non-empty passes. Raises ``KeyError`` for an unknown colour type."""
    bits = _CHANNELS[colour] * depth
    if not interlace:
        return height * (1 + (width * bits + 7) // 8)
    total = 0
    for x0, y0, dx, dy in _ADAM7:
        columns, rows = max(0, -(-(width - x0) // dx)), max(0, -(-(height - y0) // dy))
        if columns and rows:
            total += rows * (1 + (columns * bits + 7) // 8)
    return total


def last_row_written(image: Image.Image) -> bool:
    """Whether the last row of a loaded, non-interlaced PNG frame holds a non-zero byte: then the decoder
    reached it, and every row before it. False says nothing (a black last row is common)."""
    width, height = image.size
    return bool(np.asarray(image.crop((0, height - 1, width, height))).any())


def yields_every_row(data: bytes) -> bool:
    """Whether the ``IDAT`` chunks of the PNG ``data`` inflate to at least the bytes its ``IHDR`` declares.

    Walks the chunk heads to ``IEND`` (or the end of ``data``), inflating each ``IDAT`` payload in steps of
    ``_STEP_BYTES`` and stopping once the declared count is reached. A zlib error before that, a header that
    cannot be read or a stream that ends short gives False. CPU: one more inflate of the image data, at most.
    """
    ihdr = png_header(data)
    if ihdr is None:
        return False
    width, height, depth, colour, interlace = ihdr
    try:
        needed = declared_data_bytes(width, height, depth, colour, interlace)
    except KeyError:
        return False
    inflate, counted, position = zlib.decompressobj(), 0, 8
    view = memoryview(data)
    while position + 8 <= len(data) and counted < needed:
        length, kind = _CHUNK_HEAD.unpack_from(data, position)
        if kind == b"IEND":
            break
        if kind == b"IDAT":
            pending = view[position + 8:position + 8 + length]
            try:
                while pending and counted < needed and not inflate.eof:
                    counted += len(inflate.decompress(pending, min(_STEP_BYTES, needed - counted)))
                    pending = inflate.unconsumed_tail
            except zlib.error:
                return counted >= needed
            if inflate.eof:
                break
        position += 12 + length
    return counted >= needed
