"""``rampart.inputs.plain_png``: which PNGs libspng decodes, and that it answers exactly as Pillow would."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from rampart import errors
from rampart.inputs import plain_png
from rampart.inputs.decoding import decode_image
from tests.support import encode, photo
from tests.support.decoding import LIMITS, png_chunk

PILLOW = replace(LIMITS, png_decoder="pillow")
SIGNATURE = b"\x89PNG\r\n\x1a\n"


def paeth(left: np.ndarray, up: np.ndarray, up_left: np.ndarray) -> np.ndarray:
    """The PNG Paeth predictor, element-wise on int16 arrays."""
    estimate = left + up - up_left
    to_left, to_up, to_up_left = np.abs(estimate - left), np.abs(estimate - up), np.abs(estimate - up_left)
    return np.where((to_left <= to_up) & (to_left <= to_up_left), left, np.where(to_up <= to_up_left, up, up_left))


def png_with_filters(pixels: np.ndarray, filters: list[int], before_pixels: list[bytes] = (),
                     after_pixels: list[bytes] = (), interlace: int = 0) -> bytes:
    """An 8-bit RGB PNG of ``pixels`` (H×W×3 uint8) whose row ``y`` uses filter ``filters[y % len]``
    (0 None, 1 Sub, 2 Up, 3 Average, 4 Paeth), with extra chunks before and after the pixel data."""
    height, width, _ = pixels.shape
    raw = pixels.reshape(height, width * 3).astype(np.int16)
    rows = []
    for y in range(height):
        kind = filters[y % len(filters)]
        row = raw[y]
        up = raw[y - 1] if y else np.zeros_like(row)
        left = np.concatenate([np.zeros(3, np.int16), row[:-3]])
        up_left = np.concatenate([np.zeros(3, np.int16), up[:-3]])
        predicted = [np.zeros_like(row), left, up, (left + up) // 2, paeth(left, up, up_left)][kind]
        rows.append(bytes([kind]) + ((row - predicted) % 256).astype(np.uint8).tobytes())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)
    data = zlib.compress(b"".join(rows), 6)
    idats = [png_chunk(b"IDAT", data[i:i + 8192]) for i in range(0, len(data), 8192)]
    return (SIGNATURE + png_chunk(b"IHDR", ihdr) + b"".join(before_pixels) + b"".join(idats)
            + b"".join(after_pixels) + png_chunk(b"IEND", b""))


def outcome(data: bytes, limits=LIMITS):
    """What ``decode_image`` answers: ("pixels", size, bytes) or ("error", the error's class)."""
    try:
        decoded = decode_image(data, limits)
    except errors.ImageError as refused:
        return ("error", type(refused))
    return ("pixels", decoded.image.size, decoded.image.tobytes())


def crop(name: str, height: int = 200, width: int = 240) -> np.ndarray:
    return np.ascontiguousarray(photo(name)[:height, :width])


@pytest.mark.parametrize("name", ["chelsea", "coffee", "rocket", "china"])
def test_libspng_gives_pillows_pixels_for_every_filter(name):
    pixels = crop(name)
    for filters in ([0], [1], [2], [3], [4], [0, 1, 2, 3, 4]):
        data = png_with_filters(pixels, filters)
        assert plain_png.is_plain_rgb_png(data)
        fast = plain_png.decode_plain_rgb_png(data, (pixels.shape[1], pixels.shape[0]))
        assert fast is not None and np.array_equal(np.asarray(fast), pixels), filters
        assert outcome(data) == outcome(data, PILLOW)


@pytest.mark.parametrize("level", [0, 1, 9])
def test_pillow_written_photos_decode_the_same_both_ways(level):
    data = encode(photo("chelsea"), "PNG", compress_level=level)
    assert plain_png.is_plain_rgb_png(data)
    assert outcome(data) == outcome(data, PILLOW)


def test_the_service_decodes_a_plain_png_with_libspng(monkeypatch):
    calls = []
    real = plain_png.decode_plain_rgb_png
    monkeypatch.setattr("rampart.inputs.decoding.decode_plain_rgb_png", lambda *a: calls.append(a) or real(*a))
    decode_image(encode(crop("coffee"), "PNG"), LIMITS)
    assert len(calls) == 1
    decode_image(encode(crop("coffee"), "PNG"), PILLOW)
    assert len(calls) == 1  # the "pillow" setting never takes the path


def rgba(name: str) -> np.ndarray:
    pixels = crop(name)
    return np.dstack([pixels, np.full(pixels.shape[:2], 200, np.uint8)])


@pytest.mark.parametrize("data", [
    pytest.param(encode(rgba("chelsea"), "PNG"), id="rgba"),
    pytest.param(encode(crop("chelsea")[:, :, 0], "PNG"), id="grey"),
    pytest.param(encode(Image.fromarray(crop("chelsea")).convert("P"), "PNG"), id="palette"),
    pytest.param(encode(crop("chelsea"), "PNG", transparency=(0, 0, 0)), id="rgb-with-trns"),
    pytest.param(encode(Image.fromarray(crop("chelsea")), "PNG", save_all=True,
                        append_images=[Image.fromarray(crop("coffee"))]), id="apng"),
    pytest.param(png_with_filters(crop("chelsea"), [4], interlace=1), id="interlaced-flag"),
    pytest.param(png_with_filters(crop("chelsea"), [4], after_pixels=[png_chunk(b"tEXt", b"k\x00v")]),
                 id="text-after-pixels"),
    pytest.param(png_with_filters(crop("chelsea"), [4])[:-12], id="no-iend"),
    pytest.param(b"\x89PNG\r\n\x1a\n\x00\x00", id="cut-in-the-signature"),
])
def test_anything_but_a_plain_rgb_png_is_left_to_pillow(data):
    assert not plain_png.is_plain_rgb_png(data)


def test_a_16_bit_rgb_png_is_left_to_pillow():
    rows = b"".join(b"\x00" + bytes(240 * 6) for _ in range(200))
    ihdr = struct.pack(">IIBBBBB", 240, 200, 16, 2, 0, 0, 0)  # Pillow's mode is "RGB" here too
    data = SIGNATURE + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(rows)) + png_chunk(b"IEND", b"")
    assert Image.open(io.BytesIO(data)).mode == "RGB" and not plain_png.is_plain_rgb_png(data)


def test_an_orientation_before_the_pixels_is_applied_on_the_libspng_path():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: turn 90° clockwise to view
    data = encode(crop("rocket"), "PNG", exif=exif.tobytes())
    assert plain_png.is_plain_rgb_png(data)  # Pillow writes eXIf before IDAT
    fast, slow = outcome(data), outcome(data, PILLOW)
    assert fast == slow and fast[1] == (200, 240)


def test_a_large_plain_png_that_will_be_shrunk_is_decoded_by_pillow(monkeypatch):
    calls = []
    monkeypatch.setattr("rampart.inputs.decoding.decode_plain_rgb_png", lambda *a: calls.append(a))
    big = np.tile(crop("coffee"), (8, 8, 1))  # 1600×1920: shrunk by a box filter afterwards
    decode_image(encode(big, "PNG", compress_level=1), LIMITS)
    assert calls == []


@pytest.mark.parametrize("damage", ["bad-idat-crc", "corrupt-deflate", "short-pixel-data", "zeroed-tail"])
def test_damaged_plain_pngs_get_the_answer_pillow_gives(damage):
    pixels = crop("coffee")
    good = png_with_filters(pixels, [1, 4])
    ihdr_end = 8 + 25
    idat_length = struct.unpack(">I", good[ihdr_end:ihdr_end + 4])[0]
    body = good[ihdr_end + 8:ihdr_end + 8 + idat_length]
    if damage == "bad-idat-crc":
        data = good[:ihdr_end + 8 + idat_length] + b"\x00\x00\x00\x00" + good[ihdr_end + 12 + idat_length:]
    else:
        if damage == "corrupt-deflate":
            body = body[:2] + bytes(b ^ 0x5A for b in body[2:40]) + body[40:]
        elif damage == "short-pixel-data":
            body = zlib.compress((b"\x00" + b"\x80" * pixels.shape[1] * 3) * 10)  # 10 of 200 rows
        else:
            body = body[: len(body) // 2] + b"\x00" * (len(body) - len(body) // 2)
        data = good[:ihdr_end] + png_chunk(b"IDAT", body) + png_chunk(b"IEND", b"")
    assert plain_png.is_plain_rgb_png(data)
    assert outcome(data) == outcome(data, PILLOW)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_single_byte_change_in_the_pixel_data_gets_pillows_answer(data):
    good = png_with_filters(crop("chelsea", 48, 64), [0, 1, 2, 3, 4])
    start, end = 8 + 25 + 8, len(good) - 12 - 4  # the IDAT's data (one chunk for this size)
    position = data.draw(st.integers(start, end - 1), label="position")
    value = data.draw(st.integers(0, 255), label="value")
    body = bytearray(good[start:end])
    body[position - start] = value
    damaged = good[:start - 8] + png_chunk(b"IDAT", bytes(body)) + png_chunk(b"IEND", b"")
    assert outcome(damaged) == outcome(damaged, PILLOW)
