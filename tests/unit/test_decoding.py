"""``rampart.inputs.decoding`` on inputs each test builds itself: real photos and hostile bytes."""

from __future__ import annotations

import io
import struct
import time

import numpy as np
import pytest
from PIL import Image

from rampart import errors
from rampart.inputs.decoding import DecodeLimits, decode_image, sniff_format
from tests.support import encode, photo
from tests.support.decoding import LIMITS, png_bomb


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF"])
def test_every_supported_format_decodes_to_rgb(fmt):
    decoded = decode_image(encode(photo("chelsea"), fmt), LIMITS)
    assert decoded.format == fmt and decoded.image.mode == "RGB" and decoded.declared_size == (451, 300)


def test_a_bigtiff_decodes_like_a_tiff():
    """BigTIFF (``II+``/``MM\\0+``: 64-bit offsets, what large scans and microscopes write) was refused with 415."""
    image = Image.fromarray(photo("chelsea"))
    tiff = encode(image, "TIFF", big_tiff=True)
    decoded = decode_image(tiff, LIMITS)
    assert tiff[:4] == b"II+\x00" and decoded.format == "TIFF" and decoded.declared_size == (451, 300)
    assert np.array_equal(np.asarray(decoded.image), np.asarray(image))
    assert sniff_format(b"MM\x00+\x00\x08\x00\x00" + bytes(8)) == "TIFF"  # the big-endian form is sniffed alike


def test_png_bomb_is_refused_from_the_header():
    bomb = png_bomb()
    assert len(bomb) < 200
    with pytest.raises(errors.ImageTooLarge) as refused:
        decode_image(bomb, LIMITS)
    assert f"than {LIMITS.max_pixels} pixels, the limit" in str(refused.value)  # Rampart's limit, not only Pillow's


def test_pillow_warning_zone_does_not_slip_through():
    # Between Pillow's MAX_IMAGE_PIXELS and 2x it, Pillow only warns; Rampart's cap decides.
    side = int((Image.MAX_IMAGE_PIXELS * 1.5) ** 0.5)
    with pytest.raises(errors.ImageTooLarge):
        decode_image(png_bomb(side, side), LIMITS)


def test_gif_declaring_a_huge_screen_is_refused():
    gif = bytearray(encode(np.zeros((32, 32, 3), np.uint8), "GIF"))
    gif[6:10] = struct.pack("<HH", 65535, 65535)  # logical screen size
    with pytest.raises(errors.ImageTooLarge):
        decode_image(bytes(gif), LIMITS)


def test_truncated_jpeg_is_corrupt_image():
    jpeg = encode(photo("rocket"))
    with pytest.raises(errors.CorruptImage):
        decode_image(jpeg[: int(len(jpeg) * 0.6)], LIMITS)


@pytest.mark.parametrize(
    "body, error",
    [
        (b"", errors.EmptyBody),
        (b"sixteen bytes!!!", errors.UnsupportedFormat),
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n", errors.UnsupportedFormat),
        (b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom", errors.UnsupportedFormat),
        (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", errors.UnsupportedFormat),
    ],
)
def test_not_an_image(body, error):
    with pytest.raises(error):
        decode_image(body, LIMITS)


@pytest.mark.parametrize("body", [b"GIF89a" + bytes(30), b"\x89PNG\r\n\x1a\n" + bytes(30), b"BM" + bytes(40),
                                  b"RIFF\x00\x00\x00\x00WEBPVP8 " + bytes(30), b"II*\x00" + bytes(30)])
def test_a_header_the_decoder_cannot_read_is_named_without_python_internals(body):
    """Pillow's message names the buffer by its repr ("<_io.BytesIO object at 0x7f…>"): a heap address and a
    Python type, nothing a client can use. The answer says "the upload" instead."""
    with pytest.raises((errors.UndecodableImage, errors.CorruptImage)) as refused:
        decode_image(body, LIMITS)
    assert " object at 0x" not in refused.value.message and "BytesIO" not in refused.value.message, refused.value.message


def test_unsupported_format_message_lists_supported_formats():
    with pytest.raises(errors.UnsupportedFormat, match="JPEG, PNG, GIF, WEBP, BMP, TIFF"):
        sniff_format(b"\x00\x00\x00\x18ftypheic")


def test_body_over_the_byte_cap_is_413():
    limits = DecodeLimits(**{**LIMITS.__dict__, "max_body_bytes": 1000})
    with pytest.raises(errors.PayloadTooLarge):
        decode_image(encode(photo("chelsea")), limits)


@pytest.mark.parametrize("size, error", [((2, 2), errors.ImageTooSmall), ((3000, 2), errors.ImageTooSmall),
                                         ((2000, 100), errors.AspectRatioOutOfRange), ((100, 2000), errors.AspectRatioOutOfRange)])
def test_tiny_and_extreme_aspect_images_are_422(size, error):
    with pytest.raises(error) as raised:
        decode_image(encode(Image.new("RGB", size, "gray"), "PNG"), LIMITS)
    assert raised.value.status == 422


def test_transparent_pixels_are_composited_over_white():
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    decoded = decode_image(encode(rgba, "PNG"), LIMITS)
    assert decoded.image.getpixel((10, 10)) == (255, 255, 255)


def test_palette_with_trns_is_composited():
    pal = Image.new("P", (64, 64), 0)
    pal.putpalette([0, 0, 0, 10, 200, 10] + [0] * 762)
    pal.info["transparency"] = 0
    decoded = decode_image(encode(pal, "PNG", transparency=0), LIMITS)
    assert decoded.image.getpixel((5, 5)) == (255, 255, 255)


def test_16_bit_png_is_scaled_not_clipped():
    gradient = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (32, 1))
    decoded = decode_image(encode(Image.fromarray(gradient), "PNG"), LIMITS)
    row = np.asarray(decoded.image)[0, :, 0]
    assert row[0] == 0 and row[-1] == 255 and 120 <= row[128] <= 135


@pytest.mark.parametrize("mode", ["L", "1", "P", "LA", "CMYK", "I", "F"])
def test_every_mode_becomes_rgb(mode):
    image = Image.fromarray(photo("coffee")).convert(mode)
    fmt = "TIFF" if mode in ("I", "F") else ("JPEG" if mode == "CMYK" else "PNG")
    assert decode_image(encode(image, fmt), LIMITS).image.mode == "RGB"


@pytest.mark.parametrize("orientation, undo", [(3, Image.Transpose.ROTATE_180), (6, Image.Transpose.ROTATE_90),
                                               (8, Image.Transpose.ROTATE_270)])
def test_exif_orientation_restores_the_upright_photo(orientation, undo):
    upright = Image.fromarray(photo("chelsea"))
    stored = upright.transpose(undo)
    exif = Image.Exif()
    exif[0x0112] = orientation
    decoded = decode_image(encode(stored, "PNG", exif=exif.tobytes()), LIMITS)
    assert decoded.image.size == upright.size
    assert np.abs(np.asarray(decoded.image, np.int16) - np.asarray(upright, np.int16)).mean() < 1


def test_large_jpeg_is_draft_decoded_not_full_size():
    big = Image.fromarray(photo("rocket")).resize((7680, 4320))
    decoded = decode_image(encode(big, quality=80), LIMITS)
    assert decoded.declared_size == (7680, 4320)
    assert min(decoded.image.size) >= LIMITS.min_decoded_side // 2 and max(decoded.image.size) <= 7680 // 2


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "TIFF"])
def test_multi_frame_images_use_the_first_frame_and_cap_frames(fmt):
    frames = [Image.new("RGB", (32, 32), (i, 0, 0)) for i in range(0, 250, 50)]  # 5 frames, red rising
    buffer = io.BytesIO()
    frames[0].save(buffer, fmt, save_all=True, append_images=frames[1:], **({"lossless": True} if fmt == "WEBP" else {}))
    decoded = decode_image(buffer.getvalue(), LIMITS)
    assert decoded.image.getpixel((0, 0))[0] < 10  # the first frame, not a later one
    assert decode_image(buffer.getvalue(), DecodeLimits(**{**LIMITS.__dict__, "max_frames": 5})).image.size == (32, 32)
    with pytest.raises(errors.TooManyFrames, match="more than 4 frames"):
        decode_image(buffer.getvalue(), DecodeLimits(**{**LIMITS.__dict__, "max_frames": 4}))


def tiny_frame_gif(width: int, height: int, frames: int) -> bytes:
    """A GIF with a ``width``×``height`` logical screen and ``frames`` one-pixel frames."""
    screen = b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00"
    frame = b"\x2c" + struct.pack("<HHHH", 0, 0, 1, 1) + b"\x00\x02\x02\x44\x01\x00"
    return screen + frame * frames + b";"


def test_frame_cap_stops_inspecting_at_the_cap():
    """A 20 MB GIF of 1.3 million 1-pixel frames: refused after max_frames frames, not after a full scan."""
    data = tiny_frame_gif(64, 64, 1_300_000)
    start = time.perf_counter()
    with pytest.raises(errors.TooManyFrames):
        decode_image(data, LIMITS)
    capped_s = time.perf_counter() - start
    start = time.perf_counter()
    assert Image.open(io.BytesIO(data)).n_frames == 1_300_000  # what a full scan costs, same run
    full_scan_s = time.perf_counter() - start
    assert capped_s < 0.1 * full_scan_s


def s15_fixed16(value: float) -> bytes:
    return struct.pack(">i", int(round(value * 65536)))


def cmyk_to_grey_icc_profile() -> bytes:
    """A minimal ICC v2 CMYK printer profile whose A2B0 (lut16) maps every ink mix to a neutral grey.

    Pillow ships no CMYK profile, so the test builds one (ICC.1:2001-04: header,
    tag table, ``desc``, ``wtpt``, ``cprt``, ``A2B0``): output that comes out grey
    proves the embedded profile, not Pillow's naive conversion, was used.
    """
    desc_text = b"Rampart test CMYK to grey\0"
    desc = (b"desc" + bytes(4) + struct.pack(">I", len(desc_text)) + desc_text + struct.pack(">IIHB", 0, 0, 0, 0)
            + bytes(67))
    d50 = s15_fixed16(0.9642) + s15_fixed16(1.0) + s15_fixed16(0.8249)
    clut = []
    for c, m, y, k in np.ndindex(2, 2, 2, 2):
        lightness = 90.0 * (1 - c) * (1 - m) * (1 - y) * (1 - k) + 5.0
        clut += [int(lightness * 65280 / 100), 128 * 256, 128 * 256]  # L*, a* = b* = 0 (16-bit Lab)
    a2b0 = (b"mft2" + bytes(4) + struct.pack(">BBBB", 4, 3, 2, 0)
            + b"".join(s15_fixed16(v) for v in (1, 0, 0, 0, 1, 0, 0, 0, 1)) + struct.pack(">HH", 2, 2)
            + struct.pack(">8H", *[0, 65535] * 4) + struct.pack(f">{len(clut)}H", *clut)
            + struct.pack(">6H", *[0, 65535] * 3))
    tags = [(b"desc", desc), (b"wtpt", b"XYZ " + bytes(4) + d50), (b"cprt", b"text" + bytes(4) + b"none\0"),
            (b"A2B0", a2b0)]
    offset, table, data = 128 + 4 + 12 * len(tags), b"", b""
    for signature, body in tags:
        table += signature + struct.pack(">II", offset + len(data), len(body))
        data += body + bytes(-len(body) % 4)
    header = (struct.pack(">I", offset + len(data)) + bytes(4) + struct.pack(">I", 0x02100000) + b"prtrCMYKLab "
              + bytes(12) + b"acsp" + bytes(28) + d50 + bytes(48))
    return header + struct.pack(">I", len(tags)) + table + data


def test_gif_frames_past_the_cap_are_counted_from_headers_on_a_huge_screen():
    """120 one-pixel frames on a 7000×7000 screen: refused by walking frame headers only (no canvas per frame)."""
    with pytest.raises(errors.TooManyFrames):
        decode_image(tiny_frame_gif(7000, 7000, 120), LIMITS)
    assert decode_image(tiny_frame_gif(7000, 7000, 100), LIMITS).image.size[0] >= LIMITS.min_decoded_side


def test_cmyk_jpeg_goes_through_its_embedded_icc_profile():
    cmyk = Image.fromarray(photo("coffee")).convert("CMYK")
    rgb = np.asarray(decode_image(encode(cmyk, "JPEG", icc_profile=cmyk_to_grey_icc_profile()), LIMITS).image, np.int32)
    naive = np.asarray(cmyk.convert("RGB"), np.int32)
    assert np.abs(rgb[..., 0] - rgb[..., 2]).mean() < 2  # the profile's neutral greys
    assert np.abs(naive[..., 0] - naive[..., 2]).mean() > 50  # what ignoring it would give


def test_cmyk_with_an_unusable_icc_profile_still_decodes():
    cmyk = Image.fromarray(photo("coffee")).convert("CMYK")
    data = encode(cmyk, "JPEG", icc_profile=b"not an ICC profile" * 10)
    rgb = np.asarray(decode_image(data, LIMITS).image, dtype=np.float32)
    reference = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32)
    assert rgb.shape == reference.shape and np.abs(rgb - reference).mean() < 2.0  # plain conversion, logged




def tiff(pixels: np.ndarray, **options) -> bytes:
    """``pixels`` as a deflate-compressed TIFF (tifffile)."""
    import tifffile

    buffer = io.BytesIO()
    tifffile.imwrite(buffer, pixels, compression="zlib", **options)
    return buffer.getvalue()


def with_declared_size(data: bytes, width: int, height: int) -> bytes:
    """A TIFF whose ImageWidth and ImageLength tags say ``width`` × ``height`` (its strips unchanged)."""
    import tifffile

    patched = bytearray(data)
    with tifffile.TiffFile(io.BytesIO(data)) as parsed:
        tags = parsed.pages[0].tags
        for name, value in (("ImageWidth", width), ("ImageLength", height)):
            tag = tags[name]
            struct.pack_into("<I" if tag.dtype == 4 else "<H", patched, tag.valueoffset, value)
    return bytes(patched)


SMALL_CAP = DecodeLimits(**{**LIMITS.__dict__, "max_pixels": 10_000, "min_side_px": 16})


@pytest.mark.parametrize("name, data, allowed", [
    ("8-bit RGBA PNG, 4 bytes a pixel, at the cap", encode(np.zeros((100, 100, 4), np.uint8), "PNG"), True),
    ("16-bit grey PNG, 2 bytes a pixel, at the cap", encode(Image.fromarray(np.zeros((100, 100), np.uint16)), "PNG"), True),
    ("16-bit CMYK TIFF, 8 bytes a pixel, half the cap", tiff(np.zeros((50, 100, 4), np.uint16), photometric="separated"), True),
    ("16-bit CMYK TIFF, 8 bytes a pixel, over half the cap", tiff(np.zeros((51, 100, 4), np.uint16), photometric="separated"), False),
    ("16-bit RGB TIFF, 6 bytes a pixel, two thirds of the cap", tiff(np.zeros((66, 100, 3), np.uint16), photometric="rgb"), True),
    ("16-bit RGB TIFF, 6 bytes a pixel, over two thirds", tiff(np.zeros((67, 100, 3), np.uint16), photometric="rgb"), False),
    ("16-bit RGBA TIFF, 8 bytes a pixel, over half the cap", tiff(np.zeros((51, 100, 4), np.uint16), photometric="rgb",
                                                                 extrasamples=[2]), False),
])
def test_a_file_whose_samples_are_deeper_than_rgba_may_declare_fewer_pixels(name, data, allowed):
    """Decoding unpacks every sample: past 4 bytes a pixel, a PNG or TIFF may declare pixels up to 4 bytes a pixel at
    the pixel cap, no more (413 before any pixel is decoded)."""
    if allowed:
        assert decode_image(data, SMALL_CAP).image.mode == "RGB", name
    else:
        with pytest.raises(errors.ImageTooLarge, match="bytes each; the limit at that depth is"):
            decode_image(data, SMALL_CAP)


def test_a_small_tiff_declaring_49_megapixels_of_16_bit_cmyk_is_refused_at_its_header():
    """A hostile-client check: 434 KB of zlib zeros, 7000×7000 16-bit CMYK, under the 50 MP cap, cost 1.1-3 s of
    decode each. Declared at 8 bytes a pixel it may have at most 25 MP."""
    data = with_declared_size(tiff(np.zeros((70, 70, 4), np.uint16), photometric="separated"), 7000, 7000)
    with pytest.raises(errors.ImageTooLarge, match="7000x7000 = 49000000 pixels of 8 bytes each; the limit at that "
                                                   "depth is 25000000"):
        decode_image(data, LIMITS)
