"""``rampart.inputs.png_rows``: a PNG whose zlib stream ends cleanly before its last row is refused, a whole one is not.

Pillow decodes such a file without an error and leaves the rows it never reached black; the damaged files themselves
(every PNG layout, 10-99% of the image data kept) are in ``tests.support.damage.TRUNCATED``, refused in
``test_recovery.py`` and over HTTP in ``tests/server/test_damage.py``.
"""

from __future__ import annotations

import dataclasses
import io
import re
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from rampart import errors
from rampart.inputs.decoding import decode_image
from rampart.inputs.png_rows import declared_data_bytes, last_row_written, yields_every_row
from tests.support import encode
from tests.support.damage import CHELSEA, PNG_LAYOUTS, png_short_stream
from tests.support.decoding import LIMITS


def image_data(png: bytes) -> bytes:
    """The inflated image data of ``png``'s IDAT chunks."""
    payloads, position = [], 8
    while position < len(png):
        length, kind = struct.unpack_from(">I4s", png, position)
        if kind == b"IDAT":
            payloads.append(png[position + 8:position + 8 + length])
        position += 12 + length
    return zlib.decompress(b"".join(payloads))


def header(png: bytes) -> tuple[int, ...]:
    return struct.unpack_from(">IIBBBBB", png, 16)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "I;16"])
def test_the_declared_size_is_what_pillow_writes_for_every_mode(mode):
    image = Image.fromarray(CHELSEA).convert("L" if mode == "I;16" else mode)
    png = encode(image.convert(mode) if mode == "I;16" else image, "PNG")
    width, height, depth, colour, _, _, interlace = header(png)
    assert declared_data_bytes(width, height, depth, colour, interlace) == len(image_data(png))
    assert yields_every_row(png)


@pytest.mark.parametrize("layout", PNG_LAYOUTS)
def test_a_whole_file_of_each_layout_decodes_and_counts_as_whole(layout):
    png = png_short_stream(layout)
    width, height, depth, colour, _, _, interlace = header(png)
    assert declared_data_bytes(width, height, depth, colour, interlace) == len(image_data(png))
    assert yields_every_row(png)
    decoded = decode_image(png, LIMITS)
    assert decoded.image.size == (451, 300)
    if layout in ("rgb", "interlaced_rgb"):
        assert np.array_equal(np.asarray(decoded.image), CHELSEA)


@pytest.mark.parametrize("layout", PNG_LAYOUTS)
def test_a_stream_that_ends_one_byte_short_is_refused(layout):
    png = png_short_stream(layout)
    kept = 1 - 1 / len(image_data(png))
    with pytest.raises(errors.CorruptImage, match="does not yield every row|truncated"):
        decode_image(png_short_stream(layout, kept), LIMITS)


def test_a_whole_photo_with_a_black_last_row_is_classified():
    """The last row is black, so the quick look cannot tell; the count of the image data does."""
    pixels = CHELSEA.copy()
    pixels[-3:] = 0
    png = encode(Image.fromarray(pixels), "PNG")
    loaded = Image.open(io.BytesIO(png))
    loaded.load()
    assert not last_row_written(loaded)
    pillow = dataclasses.replace(LIMITS, png_decoder="pillow")  # not libspng, which checks the rows itself
    assert np.array_equal(np.asarray(decode_image(png, pillow).image), pixels)


def test_the_count_stops_at_the_declared_size_and_ignores_what_follows():
    """Extra inflated bytes after the last row, and a stream cut after it (no Adler-32), are not missing pixels."""
    png = png_short_stream("rgb")
    data = image_data(png)
    idat = re.search(rb"IDAT", png).start()
    compressed = zlib.compress(data + b"\0" * 1000)
    extra = png[:idat - 4] + struct.pack(">I", len(compressed)) + b"IDAT" + compressed + b"\0\0\0\0" + png[-12:]
    assert yields_every_row(extra)
    cut_trailer = zlib.compress(data)[:-4]
    no_adler = png[:idat - 4] + struct.pack(">I", len(cut_trailer)) + b"IDAT" + cut_trailer + b"\0\0\0\0" + png[-12:]
    assert yields_every_row(no_adler)
    assert not yields_every_row(png[:idat + 100])  # cut inside the IDAT chunk
    assert not yields_every_row(b"\x89PNG\r\n\x1a\n")
