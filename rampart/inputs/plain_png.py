"""The commonest PNG, decoded by libspng: plain 8-bit RGB, its pixel data last.

A 260×260 RGB PNG costs Pillow 13's decoder about 2.0-2.2 ms of CPU (inflate, then
unfiltering and unpacking each row in scalar C); libspng (through ``pyspng-seunglab``,
pinned, whose libspng inflates with miniz) gives the very same pixels in about 1.0 ms,
measured on the 2-core host (docs/decoding.md; ``imagecodecs``' libspng, built with
zlib 1.2.13, took 1.4 ms). PNG is lossless, so any correct decoder yields identical
bytes: the unit tests compare the two on real photos saved with every PNG filter.

Only a file that Pillow has already opened (its header checked against every
limit) and that is *plain* takes this path (``is_plain_rgb_png``):

- colour type 2 (RGB), bit depth 8, not interlaced: what libspng returns as
  H×W×3 uint8 without any conversion; Pillow's mode "RGB" also covers 16-bit RGB,
  which it would shift to 8 bits, so the IHDR bytes decide, not the mode;
- no ``tRNS`` (a transparent colour, which Rampart composites) and no ``acTL``
  (an animation: the first frame is Pillow's to pick);
- nothing but ``IEND`` after the last ``IDAT``: every chunk that can carry an
  orientation (``eXIf``, EXIF or XMP text) precedes the pixels, so
  ``Image.open`` has read it and the orientation is known without Pillow's decode.

Anything libspng refuses (truncated or corrupt data, an error of any kind) returns
None, and the caller decodes with Pillow as before, which decides what the upload's
error is and whether ``rampart.inputs.recovery`` may repair it: this path only ever
answers faster, never differently. A wrong CRC on a pixel-data chunk is decoded by
both, as Pillow does (the chunks before the pixels had theirs checked by
``Image.open``). The caller uses it only when no shrink follows (the frame is
small), so its transient memory (the H×W×3 array, then Pillow's copy) stays within
that of Pillow's own decode.
"""

from __future__ import annotations

import struct

import numpy as np
import pyspng
from PIL import Image

from rampart.inputs.png_rows import png_header

__all__ = ["is_plain_rgb_png", "decode_plain_rgb_png"]

_CHUNK_HEAD = struct.Struct(">I4s")
_COLOUR_TYPE_RGB = 2
_REFUSING_CHUNKS = frozenset({b"tRNS", b"acTL"})


def is_plain_rgb_png(data: bytes) -> bool:
    """Whether ``data`` is a plain 8-bit RGB PNG (module doc): one pass over its chunk heads, no inflate.

    Walks every chunk head (8 bytes each) to ``IEND``; the caller has already bounded their
    number (``rampart.inputs.decode_cost``). Malformed structure gives False, never an error.
    """
    ihdr = png_header(data)
    if ihdr is None:
        return False
    _, _, depth, colour, interlace = ihdr
    if depth != 8 or colour != _COLOUR_TYPE_RGB or interlace != 0:
        return False
    position, after_pixels = 8, False
    while position + 8 <= len(data):
        length, kind = _CHUNK_HEAD.unpack_from(data, position)
        if kind == b"IEND":
            return after_pixels
        if kind in _REFUSING_CHUNKS or (after_pixels and kind != b"IDAT"):
            return False
        after_pixels = kind == b"IDAT" or after_pixels
        position += 12 + length
    return False  # no IEND: truncated, Pillow's to judge


def decode_plain_rgb_png(data: bytes, size: tuple[int, int]) -> Image.Image | None:
    """``data`` (a plain RGB PNG, ``is_plain_rgb_png``) decoded by libspng into an RGB ``PIL.Image``.

    ``size`` is the (width, height) in px that Pillow read from the header. Returns None
    when libspng refuses the data or returns anything but uint8 height×width×3 (the
    caller then decodes with Pillow).
    """
    try:
        pixels = pyspng.load(data, "RGB")
    except Exception:  # RuntimeError from pyspng, or anything else: Pillow decides what the upload's fault is
        return None
    width, height = size
    if pixels.dtype != np.uint8 or pixels.shape != (height, width, 3):
        return None
    return Image.fromarray(pixels)
