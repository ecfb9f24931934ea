"""Damaged real photos: the undamaged files, every benign fault Rampart repairs or ignores, and cuts that
remove pixel data; decoded in process (tests/unit/test_recovery.py) and sent over HTTP (tests/server/test_damage.py)."""

from __future__ import annotations

import functools
import io
import re
import struct
import zlib
from typing import Callable

from PIL import Image

from tests.support import encode, photo
from tests.support.decoding import png_chunk


CHELSEA = photo("chelsea")  # 451×300: BMP rows of 1353 bytes + 3 bytes of padding


#: The undamaged files, by name: format and Pillow save options.
ORIGINALS: dict[str, tuple[str, dict]] = {
    "jpeg": ("JPEG", {}),
    "progressive_jpeg": ("JPEG", {"progressive": True}),
    "png": ("PNG", {}),
    "gif": ("GIF", {}),
    "webp": ("WEBP", {}),
    "webp_exif": ("WEBP", {"exif": b"II*\x00\x08\x00\x00\x00\x00"}),  # a 9-byte EXIF chunk: padded to 10
    "bmp": ("BMP", {}),
    "tiff": ("TIFF", {}),
}


@functools.lru_cache(maxsize=None)
def original(name: str) -> bytes:
    """The undamaged file ``name`` of ``ORIGINALS``: chelsea in that format."""
    fmt, options = ORIGINALS[name]
    return encode(CHELSEA, fmt, **options)


def bad_crc_text_chunk() -> bytes:
    """A PNG ``tEXt`` chunk whose CRC is wrong."""
    chunk = png_chunk(b"tEXt", b"Comment\x00taken on a phone")
    return chunk[:-4] + struct.pack(">I", zlib.crc32(b"something else"))


def png_after_ihdr(data: bytes, chunk: bytes) -> bytes:
    """``data`` (a PNG) with ``chunk`` inserted right after its IHDR."""
    return data[:33] + chunk + data[33:]  # signature (8) + IHDR (25)


def tiff_with_next_ifd(data: bytes, offset: int) -> bytes:
    """``data`` (a one-IFD TIFF) whose next-IFD offset is ``offset``."""
    (first_ifd,) = struct.unpack("<I", data[4:8])
    (entries,) = struct.unpack("<H", data[first_ifd : first_ifd + 2])
    at = first_ifd + 2 + 12 * entries
    return data[:at] + struct.pack("<I", offset) + data[at + 4 :]


def webp_with_riff_size(data: bytes, size: int) -> bytes:
    """``data`` (a WebP) whose RIFF size field says ``size``."""
    return data[:4] + struct.pack("<I", size) + data[8:]


def bmp_with_file_size(data: bytes, size: int) -> bytes:
    """``data`` (a BMP) whose file-size field says ``size``."""
    return data[:2] + struct.pack("<I", size) + data[6:]


JUNK = bytes(range(32, 127)) * 3


#: (original, fault, damage, warnings expected): every benign fault Rampart knows, per format where it applies.
BENIGN: list[tuple[str, str, Callable[[bytes], bytes], tuple[str, ...]]] = [
    # libjpeg decodes a baseline JPEG to its last row before it looks for the EOI, so Pillow itself
    # accepts one whose EOI is replaced by enough bytes; a progressive JPEG needs the repair then too.
    *[(name, fault, damage, warnings if name == "progressive_jpeg" or not baseline_tolerates else ())
      for name in ("jpeg", "progressive_jpeg") for fault, damage, warnings, baseline_tolerates in [
        ("eoi_missing", lambda d: d[:-2], ("jpeg_missing_eoi",), False),
        ("eoi_half_missing", lambda d: d[:-1], ("jpeg_missing_eoi",), False),
        ("eoi_zeroed", lambda d: d[:-2] + b"\x00\x00", ("jpeg_missing_eoi",), False),
        ("eoi_replaced_by_junk", lambda d: d[:-2] + JUNK, ("jpeg_missing_eoi",), True),
        ("eoi_missing_after_a_comment", lambda d: d[:-2] + b"\xff\xfe\x00\x08phone!", ("jpeg_missing_eoi",), True),
        ("cut_inside_a_trailing_comment", lambda d: d[:-2] + b"\xff\xfe\x00\x40pho", ("jpeg_missing_eoi",), True),
        ("junk_after_eoi", lambda d: d + JUNK, (), True),
        ("zero_padding_after_eoi", lambda d: d + bytes(4096), (), True),
    ]],
    ("png", "iend_missing", lambda d: d[:-12], ()),
    ("png", "adler32_idat_crc_and_iend_missing", lambda d: d[:-20], ()),
    ("png", "junk_after_iend", lambda d: d + JUNK, ()),
    ("png", "bad_iend_crc", lambda d: d[:-4] + b"\x00\x00\x00\x00", ()),
    ("png", "bad_ancillary_crc_before_idat", lambda d: png_after_ihdr(d, bad_crc_text_chunk()),
     ("png_bad_ancillary_crc",)),
    ("png", "bad_ancillary_crc_after_idat", lambda d: d[:-12] + bad_crc_text_chunk() + d[-12:], ()),
    ("png", "cut_inside_an_ancillary_chunk_after_idat", lambda d: d[:-12] + bad_crc_text_chunk()[:15],
     ("png_truncated_ancillary",)),
    ("gif", "trailer_missing", lambda d: d[:-1], ()),
    ("gif", "block_terminator_and_trailer_missing", lambda d: d[:-2], ()),
    ("gif", "junk_instead_of_trailer", lambda d: d[:-1] + JUNK, ()),
    ("gif", "junk_after_trailer", lambda d: d + JUNK, ()),
    ("gif", "cut_inside_a_trailing_extension", lambda d: d[:-1] + b"!\xfe\x10abc", ()),
    ("gif", "cut_after_an_extension_introducer", lambda d: d[:-1] + b"!", ("later_frames_unreadable",)),
    ("webp", "junk_after_riff", lambda d: d + JUNK, ()),
    ("webp", "riff_size_too_large", lambda d: webp_with_riff_size(d, len(d) + 1000), ("webp_bad_riff_size",)),
    ("webp", "riff_size_zero", lambda d: webp_with_riff_size(d, 0), ("webp_bad_riff_size",)),
    ("webp_exif", "pad_byte_missing", lambda d: d[:-1], ("webp_missing_padding",)),
    ("webp_exif", "cut_inside_the_exif_chunk", lambda d: d[:-5], ("webp_truncated_metadata", "webp_bad_riff_size")),
    ("bmp", "junk_after_pixels", lambda d: d + JUNK, ()),
    ("bmp", "last_row_padding_missing", lambda d: d[:-3], ()),
    ("bmp", "wrong_file_size_field", lambda d: bmp_with_file_size(d, 12345), ()),
    ("tiff", "junk_after_pixels", lambda d: d + JUNK, ()),
    ("tiff", "next_ifd_offset_past_the_end", lambda d: tiff_with_next_ifd(d, 0x7FFFFFFF), ()),
    ("tiff", "next_ifd_offset_into_pixels", lambda d: tiff_with_next_ifd(d, len(d) - 4), ()),
]


BENIGN_IDS = [f"{name}-{fault}" for name, fault, _, _ in BENIGN]


def pixel_span(data: bytes, name: str) -> tuple[int, int]:
    """(first, end) byte offsets of the pixel data of an undamaged ``original(name)``."""
    fmt = ORIGINALS[name][0]
    if fmt == "JPEG":  # entropy-coded data from the first scan to the EOI
        sos = data.index(b"\xff\xda")
        return sos + 2 + struct.unpack(">H", data[sos + 2 : sos + 4])[0], len(data) - 2
    if fmt == "PNG":
        idats = [m.start() for m in re.finditer(b"IDAT", data)]
        last_length = struct.unpack(">I", data[idats[-1] - 4 : idats[-1]])[0]
        return idats[0] + 4, idats[-1] + 4 + last_length
    if fmt == "WEBP":  # a simple lossy file: the VP8 chunk right after the RIFF header
        assert data[12:16] == b"VP8 "
        return 20, 20 + struct.unpack("<I", data[16:20])[0]
    start = Image.open(io.BytesIO(data)).tile[0].offset  # GIF, BMP, TIFF: one tile, data to the end
    return start, len(data) - (2 if fmt == "GIF" else 0)  # GIF: block terminator and trailer


def cut(name: str, missing: float) -> bytes:
    """``original(name)`` cut so that ``missing`` (0..1) of its pixel data is gone."""
    data = original(name)
    first, end = pixel_span(data, name)
    return data[: first + round((end - first) * (1 - missing))]


def progressive_cut_after_first_scan() -> bytes:
    """The progressive JPEG original cut right before its second scan."""
    data = original("progressive_jpeg")
    second_scan = data.index(b"\xff\xda", data.index(b"\xff\xda") + 2)
    return data[:second_scan]


def stray_marker_mid_scan(name: str) -> bytes:
    """``original(name)`` (a JPEG) with a reserved marker (``FF B3``, JPGn) put in the middle of its last scan's data:
    libjpeg stops there, so the rest of the scan is lost although the file keeps its EOI."""
    data = original(name)
    middle = data.rindex(b"\xff\xda") + (len(data) - data.rindex(b"\xff\xda")) // 2
    return data[:middle] + b"\xff\xb3" + data[middle:]


#: The PNG images of ``png_short_stream``: colour type, bit depth and the photo's samples in that layout.
PNG_LAYOUTS = ("rgb", "palette", "rgba", "gray16", "interlaced_rgb")


def png_raw_rows(pixels, interlace: bool) -> bytes:
    """A PNG's image data before compression: each row a filter byte (0, none) and its samples; for Adam7, the
    rows of each of the seven passes' sub-images in turn. ``pixels``: an (H, W[, C]) array of big-endian samples."""
    passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
    images = [pixels[y0::dy, x0::dx] for x0, y0, dx, dy in passes] if interlace else [pixels]
    return b"".join(b"\0" + row.tobytes() for image in images if image.size for row in image)


@functools.lru_cache(maxsize=None)
def png_short_stream(layout: str, kept: float = 1.0) -> bytes:
    """Chelsea as a PNG of ``layout`` (``PNG_LAYOUTS``) whose zlib stream carries only the first ``kept`` (0..1)
    of the image data its IHDR declares, and ends cleanly there (Adler-32, IEND: a whole file but for the rows)."""
    import numpy as np

    image = Image.fromarray(CHELSEA).convert({"palette": "P", "rgba": "RGBA", "gray16": "L"}.get(layout, "RGB"))
    pixels = np.asarray(image)
    if layout == "gray16":
        pixels = (pixels.astype(">u2") * 257)
    colour, depth = {"rgb": (2, 8), "interlaced_rgb": (2, 8), "palette": (3, 8), "rgba": (6, 8), "gray16": (0, 16)}[layout]
    raw = png_raw_rows(pixels, layout == "interlaced_rgb")
    header = struct.pack(">IIBBBBB", image.width, image.height, depth, colour, 0, 0, int(layout == "interlaced_rgb"))
    palette = png_chunk(b"PLTE", bytes(image.getpalette()[:768])) if layout == "palette" else b""
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + palette
            + png_chunk(b"IDAT", zlib.compress(raw[: round(len(raw) * kept)])) + png_chunk(b"IEND", b""))


TRUNCATED: list[tuple[str, bytes]] = [
    *[(f"{name}-{round(missing * 100)}%_missing", cut(name, missing))
      for name in ("jpeg", "progressive_jpeg", "png", "gif", "webp", "bmp", "tiff") for missing in (0.1, 0.5, 0.9)],
    ("progressive_jpeg-cut_after_first_scan", progressive_cut_after_first_scan()),
    *[(f"{name}-stray_marker_mid_scan", stray_marker_mid_scan(name)) for name in ("jpeg", "progressive_jpeg")],
    *[(f"png_{layout}-stream_ends_{round(kept * 100)}%_in", png_short_stream(layout, kept))
      for layout in PNG_LAYOUTS for kept in (0.1, 0.6, 0.99)],
]
