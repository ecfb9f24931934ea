"""The decoding policy on damaged real photos: benign damage is classified, missing pixel data refused.

Every case is built here from a real photo (skimage's chelsea) in each format:
benign faults decode to exactly the pixels of the undamaged file (with the
documented ``warnings`` where Rampart repaired something), and cuts that remove
10%, 50% or 90% of the pixel data, or a progressive JPEG's later scans, are
``CorruptImage`` (400 ``corrupt_image``). The server tests send the same files
through ``/classify`` once each.
"""

from __future__ import annotations

import asyncio
import functools
import io
import re
import struct
import zlib
from typing import Callable

import pytest
from PIL import Image
from prometheus_client import REGISTRY

from rampart import errors

from rampart.telemetry import metrics

from rampart.inputs import recovery
from rampart.config import Settings
from rampart.overload.deadline import Deadline
from rampart.inputs.decoding import decode_image
from tests.support import ROOT, encode, photo
from tests.unit.test_decoding import LIMITS, png_chunk
from tests.unit.test_pipeline import classifier

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
    fmt, options = ORIGINALS[name]
    return encode(CHELSEA, fmt, **options)


@functools.lru_cache(maxsize=None)
def undamaged_pixels(name: str) -> tuple[tuple[int, int], bytes]:
    """Size and RGB bytes of ``original(name)`` as Rampart decodes it."""
    decoded = decode_image(original(name), LIMITS)
    assert decoded.warnings == ()
    return decoded.image.size, decoded.image.tobytes()


def bad_crc_text_chunk() -> bytes:
    chunk = png_chunk(b"tEXt", b"Comment\x00taken on a phone")
    return chunk[:-4] + struct.pack(">I", zlib.crc32(b"something else"))


def png_after_ihdr(data: bytes, chunk: bytes) -> bytes:
    return data[:33] + chunk + data[33:]  # signature (8) + IHDR (25)


def tiff_with_next_ifd(data: bytes, offset: int) -> bytes:
    (first_ifd,) = struct.unpack("<I", data[4:8])
    (entries,) = struct.unpack("<H", data[first_ifd : first_ifd + 2])
    at = first_ifd + 2 + 12 * entries
    return data[:at] + struct.pack("<I", offset) + data[at + 4 :]


def webp_with_riff_size(data: bytes, size: int) -> bytes:
    return data[:4] + struct.pack("<I", size) + data[8:]


def bmp_with_file_size(data: bytes, size: int) -> bytes:
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
    data = original("progressive_jpeg")
    second_scan = data.index(b"\xff\xda", data.index(b"\xff\xda") + 2)
    return data[:second_scan]


TRUNCATED: list[tuple[str, bytes]] = [
    *[(f"{name}-{round(missing * 100)}%_missing", cut(name, missing))
      for name in ("jpeg", "progressive_jpeg", "png", "gif", "webp", "bmp", "tiff") for missing in (0.1, 0.5, 0.9)],
    ("progressive_jpeg-cut_after_first_scan", progressive_cut_after_first_scan()),
]


@pytest.mark.parametrize("name, fault, damage, warnings", BENIGN, ids=BENIGN_IDS)
def test_benign_damage_decodes_to_the_undamaged_pixels(name, fault, damage, warnings):
    damaged = decode_image(damage(original(name)), LIMITS)
    assert damaged.warnings == warnings
    assert (damaged.image.size, damaged.image.tobytes()) == undamaged_pixels(name)


@pytest.mark.parametrize("name, data", TRUNCATED, ids=[name for name, _ in TRUNCATED])
def test_missing_pixel_data_is_corrupt_image(name, data):
    with pytest.raises(errors.CorruptImage, match="truncated|missing"):
        decode_image(data, LIMITS)


def test_a_jpeg_cut_inside_its_scan_is_refused_although_an_appended_eoi_would_decode():
    """The control decode is what refuses it: Pillow itself accepts the cut file once it ends in an EOI."""
    data = original("jpeg")
    for missing_bytes in (3, 40, len(data) // 3):
        truncated = data[: len(data) - missing_bytes]
        Image.open(io.BytesIO(truncated + b"\xff\xd9")).load()  # libjpeg fills the missing blocks: no error
        with pytest.raises(errors.CorruptImage, match="pixel data is missing"):
            decode_image(truncated, LIMITS)


def test_jpeg_with_restart_markers_missing_eoi_is_repaired_and_cut_at_a_marker_is_refused():
    data = encode(CHELSEA, "JPEG", restart_marker_rows=1)
    whole = decode_image(data, LIMITS).image.tobytes()
    repaired = decode_image(data[:-2], LIMITS)
    assert repaired.warnings == ("jpeg_missing_eoi",) and repaired.image.tobytes() == whole
    last_restart = data.rindex(b"\xff\xd3")
    for end in (last_restart, last_restart + 2):  # before or after the marker: the later rows are missing
        with pytest.raises(errors.CorruptImage, match="pixel data is missing"):
            decode_image(data[:end], LIMITS)


def test_progressive_jpeg_missing_any_later_scan_is_refused():
    data = original("progressive_jpeg")
    scans = [m.start() for m in re.finditer(b"\xff\xda", data)]
    assert len(scans) >= 6
    for end in scans[1:]:
        with pytest.raises(errors.CorruptImage, match="before the scans that complete every component"):
            decode_image(data[:end], LIMITS)


def test_repairs_leave_pixel_chunks_alone():
    """A bad CRC or a cut in a chunk that carries pixels is not benign: no repair is offered or made."""
    png = original("png")
    assert recovery.repair(png[:-12] + png_chunk(b"IDAT", b"\x00" * 8)[:15], "PNG") is None
    with pytest.raises(errors.CorruptImage, match="VP8 chunk declares"):
        recovery.repair(original("webp")[:-100], "WEBP")
    assert recovery.repair(original("gif")[:-100], "GIF") is None


def test_every_warning_is_documented_and_counted():
    api_doc = (ROOT / "docs" / "api.md").read_text()  # its "Damaged uploads" section
    for warning in recovery.INPUT_WARNINGS:
        assert f"`{warning}`" in api_doc, warning
    metrics.init_api_series()
    counted = {sample.labels["warning"] for family in metrics.INPUT_WARNINGS.collect() for sample in family.samples}
    assert counted == set(recovery.INPUT_WARNINGS)


def test_pipeline_answers_carry_the_warnings_and_count_them():
    """With stand-in models: the answer says what was repaired (every answer has the field) and the metric counts it."""
    pipeline = classifier(Settings())

    def counted() -> float:
        return REGISTRY.get_sample_value("rampart_input_warnings_total", {"warning": "jpeg_missing_eoi"}) or 0.0

    before = counted()
    repaired = asyncio.run(pipeline.classify(original("jpeg")[:-2], 3, Deadline(10_000)))
    whole = asyncio.run(pipeline.classify(original("png"), 3, Deadline(10_000)))
    assert repaired["input_warnings"] == ["jpeg_missing_eoi"] and whole["input_warnings"] == []
    assert counted() == before + 1
