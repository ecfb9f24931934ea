"""``rampart.inputs.decoding`` and ``decode_job`` decode at the cost of the pixels the model needs.

The DCT scale and box reduce chosen per bucket and size, orientation, the fallback's input made only
when asked, transient memory per Pillow mode against an 8-bit RGB decode of the same size (measured
in a child process, in the same run), and metadata that never refuses pixels nor floods the log.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from PIL import Image

from rampart.config import Settings
from rampart.inputs.buckets import buckets_for_resolution, choose_bucket, cover_scale, shrink_rule
from rampart.inputs.decode_job import prepare
from rampart.errors import ImageTooLarge
from rampart.inputs.decoding import STRIP_PIXELS, WEBP_PIXEL_SHARE, DecodeLimits, decode_image, webp_canvas_size
from rampart.pipeline import decode_plan
from tests.support import ROOT, encode, photo

PRIMARY = buckets_for_resolution(260)
PLAN = decode_plan(Settings(), {"primary": PRIMARY, "fallback": buckets_for_resolution(224)})
RULE = shrink_rule(PRIMARY, PLAN.crop_margin, PLAN.oversample)


def jpeg_of(size: tuple[int, int], orientation: int | None = None) -> bytes:
    """A photo (scikit-image's coffee) resized to ``size`` as a JPEG, with an EXIF orientation if given."""
    image = Image.fromarray(photo("coffee")).resize(size, Image.Resampling.BILINEAR)
    options = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    return encode(image, "JPEG", quality=85, **options)


@pytest.mark.parametrize("stored, orientation, decoded", [
    ((1600, 1200), None, (400, 300)),   # a phone photo: 1/4 scale, not the full frame
    ((1200, 1600), None, (300, 400)),   # portrait
    ((1000, 1000), None, (500, 500)),   # square: 1/2
    ((4032, 3024), None, (504, 378)),   # 12 MP: 1/8
    ((800, 600), None, (400, 300)),
    ((700, 525), None, (700, 525)),     # below 2× the bucket's need: full size
    ((1600, 1200), 6, (300, 400)),      # stored sideways, EXIF-rotated to portrait
    ((1600, 1200), 8, (300, 400)),
    ((1600, 1200), 3, (400, 300)),      # upside down
])
def test_the_dct_scale_follows_the_bucket_and_orientation(stored, orientation, decoded):
    image = decode_image(jpeg_of(stored, orientation), PLAN.limits, RULE).image
    assert image.size == decoded


@pytest.mark.parametrize("size", [(1601, 1201), (2000, 1000), (333, 1111), (5000, 3750), (2600, 2600), (1250, 940)])
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_the_decoded_frame_still_covers_the_bucket_and_is_the_smallest_that_does(size, fmt):
    """The crop box fit_to_bucket takes spans at least the bucket's pixels; half that frame would not."""
    data = encode(Image.new("RGB", size, (120, 80, 40)), fmt)
    decoded = decode_image(data, PLAN.limits, RULE)
    bucket = choose_bucket(*decoded.upright_size, PRIMARY)
    assert cover_scale(*decoded.image.size, bucket, PLAN.crop_margin) <= 1.0 + 1e-6  # resize never enlarges
    if decoded.image.size != size:  # shrunk: once more by 2 would enlarge it
        half = (decoded.image.size[0] / 2, decoded.image.size[1] / 2)
        assert cover_scale(*half, bucket, PLAN.crop_margin) > 1.0


def test_an_exif_rotated_photo_gives_the_upright_pixels():
    """Orientation is applied to the small frame: the same pixels as rotating the full photo first."""
    upright = Image.fromarray(photo("coffee")).resize((1200, 1600))  # portrait, as the viewer sees it
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # stored landscape; orientation 6 turns it back
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = prepare(encode(stored, "PNG", exif=exif.tobytes()), PLAN)
    plain = prepare(encode(upright, "PNG"), PLAN)
    (bucket, pixels), (plain_bucket, plain_pixels) = rotated.inputs["primary"], plain.inputs["primary"]
    assert bucket == plain_bucket and bucket.name == "portrait"
    assert np.abs(pixels.astype(int) - plain_pixels).mean() < 1.0


def test_an_rgb_frame_without_orientation_is_not_copied():
    """``to_rgb`` and the orientation step hand an RGB frame on as it is decoded."""
    from rampart.inputs.decoding import shrink_to_rgb, to_rgb

    image = Image.new("RGB", (64, 48))
    assert to_rgb(image, (255, 255, 255)) is image and shrink_to_rgb(image, 1, (255, 255, 255)) is image


# One child process decodes every body; freed memory is returned to the system (malloc_trim) and its peak
# resident memory reset before each decode (/proc/self/clear_refs), then read after (VmHWM), so each figure
# is that decode's transient alone.
_MEASURE = textwrap.dedent("""
    import ctypes, json, sys
    from PIL import Image
    libc = ctypes.CDLL("libc.so.6")
    Image.core.set_blocks_max(0)  # no block cache: freed image memory leaves the process
    from rampart.config import Settings
    from rampart.inputs.buckets import buckets_for_resolution
    from rampart.inputs.decode_job import prepare
    from rampart.inputs.decoding import DecodeLimits
    from rampart.pipeline import decode_plan
    import dataclasses
    plan = decode_plan(Settings(), {"primary": buckets_for_resolution(260), "fallback": buckets_for_resolution(224)})
    plan = dataclasses.replace(plan, limits=dataclasses.replace(plan.limits, max_body_bytes=10**9, max_pixels=10**9))
    def kib(field):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
    prepare(open(sys.argv[1], "rb").read(), plan)  # warm: imports and codecs
    out = {}
    for path in sys.argv[1:]:
        data = open(path, "rb").read()
        libc.malloc_trim(0)  # memory freed by earlier decodes leaves the process, so it cannot hide this one's
        open("/proc/self/clear_refs", "w").write("5")
        before = kib("VmRSS:")
        prepare(data, plan)
        out[path] = (kib("VmHWM:") - before) * 1024
    print(json.dumps(out))
""")

MODE_SIZE = (2400, 1600)


def mode_bodies() -> dict[str, bytes]:
    """A 2400×1600 gradient in each mode Pillow writes, as PNG (8/16-bit) or deflated TIFF, plus the RGB baseline."""
    width, height = MODE_SIZE
    ramp = np.linspace(0, 1, width, dtype=np.float32)[None, :] * np.linspace(0.2, 1, height, dtype=np.float32)[:, None]
    grey = Image.fromarray((ramp * 255).astype(np.uint8))
    rgb = Image.merge("RGB", (grey, grey.transpose(Image.Transpose.FLIP_LEFT_RIGHT), grey.transpose(Image.Transpose.FLIP_TOP_BOTTOM)))
    tiff = {"compression": "tiff_deflate"}
    return {
        "RGB": encode(rgb, "PNG", compress_level=1),
        "1": encode(grey.convert("1"), "PNG"),
        "L": encode(grey, "PNG", compress_level=1),
        "LA": encode(Image.merge("LA", (grey, grey)), "PNG", compress_level=1),
        "P": encode(rgb.quantize(64), "PNG", compress_level=1),
        "RGBA": encode(Image.merge("RGBA", (*rgb.split(), grey)), "PNG", compress_level=1),
        "I;16": encode(Image.fromarray((ramp * 65535).astype(np.uint16)), "PNG", compress_level=1),
        "I": encode(Image.fromarray((ramp * 65535).astype(np.int32)), "TIFF", **tiff),
        "F": encode(Image.fromarray(ramp), "TIFF", **tiff),
        "CMYK": encode(rgb.convert("CMYK"), "TIFF", **tiff),
        "YCbCr": encode(rgb.convert("YCbCr"), "JPEG", quality=90),
        "LAB": encode(rgb.convert("LAB"), "TIFF", **tiff),
    }


@functools.lru_cache(maxsize=2)
def webp_bodies(size: tuple[int, int] = MODE_SIZE) -> dict[str, bytes]:
    """A ``size`` gradient, RGB and RGBA, as lossy and lossless WebP (``VP8 ``, ``VP8L`` and ``VP8X``); made once."""
    ramp = np.linspace(0, 255, size[0], dtype=np.float32)[None, :] * np.linspace(0.2, 1, size[1], dtype=np.float32)[:, None]
    grey = Image.fromarray(ramp.astype(np.uint8))
    rgb = Image.merge("RGB", (grey, grey.transpose(Image.Transpose.FLIP_LEFT_RIGHT), grey.transpose(Image.Transpose.FLIP_TOP_BOTTOM)))
    rgba = Image.merge("RGBA", (*rgb.split(), grey))
    return {"webp_lossy": encode(rgb, "WEBP", quality=80, method=0),
            "webp_lossless": encode(rgb, "WEBP", lossless=True, quality=0, method=0),
            "webp_alpha": encode(rgba, "WEBP", quality=80, method=0),
            "webp_exif": encode(rgb, "WEBP", quality=80, method=0, exif=b"Exif\x00\x00")}


#: The size of the WebPs whose headers and limits are checked (small: nothing there depends on it).
SMALL = (320, 200)


def test_every_mode_decodes_within_the_memory_of_an_8_bit_rgb_frame_of_its_size(tmp_path):
    """Each mode at the same size within one RGB frame; a WebP (whose decoder holds about 16 bytes a pixel) within
    one RGB frame of ``WEBP_PIXEL_SHARE`` times its size: what its own pixel limit lets through."""
    bodies = {**mode_bodies(), **webp_bodies()}
    paths = {}
    for mode, data in bodies.items():
        paths[mode] = tmp_path / f"{mode.replace(';', '_')}.img"
        paths[mode].write_bytes(data)
        if not mode.startswith("webp"):
            assert Image.open(io.BytesIO(data)).mode == ("RGB" if mode == "YCbCr" else mode)  # the mode under test
    done = subprocess.run([sys.executable, "-c", _MEASURE, *map(str, paths.values())], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=True)
    peaks = {mode: json.loads(done.stdout)[str(path)] for mode, path in paths.items()}
    rgb_frame = peaks["RGB"]
    # Pillow holds an RGB frame in 4 bytes a pixel: the baseline must at least hold that.
    assert rgb_frame >= 0.8 * 4 * MODE_SIZE[0] * MODE_SIZE[1], peaks
    # Plus one strip's temporaries: up to about 24 bytes a pixel of a strip (a copy in the frame's dtype,
    # the 8-bit grey, the RGB strip and its reduction), 12 MiB at STRIP_PIXELS.
    slack = 24 * STRIP_PIXELS
    for mode, peak in peaks.items():
        share = WEBP_PIXEL_SHARE if mode.startswith("webp") else 1
        assert peak <= share * (1.1 * rgb_frame + slack), (mode, peaks)
    # The share is needed: a WebP costs more than twice the RGB frame of its size (16 bytes a pixel measured).
    assert min(peak for mode, peak in peaks.items() if mode.startswith("webp")) > 2 * rgb_frame, peaks


def test_webp_canvas_size_is_read_from_each_header_kind_as_pillow_reads_it():
    for name, data in webp_bodies(SMALL).items():
        assert data[12:16] in (b"VP8 ", b"VP8L", b"VP8X"), name
        assert webp_canvas_size(data) == Image.open(io.BytesIO(data)).size == SMALL, name
    kinds = {data[12:16] for data in webp_bodies(SMALL).values()}
    assert kinds == {b"VP8 ", b"VP8L", b"VP8X"}, kinds
    assert webp_canvas_size(b"RIFF\x00\x00\x00\x00WEBPVP8 ") is None  # too short: the decoder reports it


def test_a_webp_over_its_share_of_the_pixel_limit_is_refused_before_decoding_and_one_within_is_decoded():
    pixels = SMALL[0] * SMALL[1]
    for name, data in webp_bodies(SMALL).items():
        at_limit = dataclasses.replace(PLAN.limits, max_pixels=pixels * WEBP_PIXEL_SHARE)
        assert decode_image(data, at_limit).image.mode == "RGB", name
        below = dataclasses.replace(at_limit, max_pixels=pixels * WEBP_PIXEL_SHARE - 1)
        with pytest.raises(ImageTooLarge, match="the limit for WebP is"):
            decode_image(data, below)
    # Every other format keeps the whole limit.
    png = encode(Image.new("RGB", SMALL, (20, 90, 160)), "PNG")
    assert decode_image(png, dataclasses.replace(PLAN.limits, max_pixels=pixels)).image.mode == "RGB"



def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def test_a_png_with_a_2_mib_icc_profile_decodes():
    """A display profile larger than Pillow's 1 MiB text-chunk limit: the pixels are answered all the same."""
    png = encode(Image.fromarray(photo("chelsea")), "PNG")
    profile = b"\x00" * 128 + bytes(range(256)) * (2 * 4096)  # 2 MiB + 128 bytes; only its size matters here
    iccp = _png_chunk(b"iCCP", b"display\x00\x00" + zlib.compress(profile, 9))
    body = png[:33] + iccp + png[33:]  # after the 8-byte signature and the 25-byte IHDR chunk
    prepared = prepare(body, PLAN)
    assert prepared.inputs["primary"][1].shape == (260, 346, 3)
    # Outside the decode worker's call, Pillow's own limit is what a decode sees (the relaxed one is per worker).
    assert len(zlib.decompress(zlib.compress(profile))) > (1 << 20)


def _exif_with_entries(count: int) -> bytes:
    """An EXIF block (little-endian TIFF) whose first IFD holds ``count`` entries of unknown ASCII tags, each
    declaring 1 MiB of data, more than the block holds: Pillow warns once per entry ("Tag data larger than
    file. Skipping tag ...")."""
    header = b"Exif\x00\x00" + b"II*\x00" + struct.pack("<I", 8)
    entries = b"".join(struct.pack("<HHII", 0xC000 + i, 2, 1 << 20, 0xFFFF00) for i in range(count))
    return header + struct.pack("<H", count) + entries + struct.pack("<I", 0)


#: Entries that fit in a JPEG's one EXIF segment (APP1 holds at most 65533 bytes, 12 bytes an entry).
JPEG_EXIF_ENTRIES = 5_000
_COUNT_LINES = textwrap.dedent("""
    import logging, sys
    records = []
    class Count(logging.Handler):
        def emit(self, record):
            records.append(record)
    logging.basicConfig(level=logging.INFO)  # the service logs at INFO and up
    logging.getLogger().addHandler(Count())
    logging.captureWarnings(True)
    from rampart.config import Settings
    from rampart.inputs.buckets import buckets_for_resolution
    from rampart.inputs.decode_job import prepare
    from rampart.pipeline import decode_plan
    plan = decode_plan(Settings(), {"primary": buckets_for_resolution(260), "fallback": buckets_for_resolution(224)})
    prepared = prepare(sys.stdin.buffer.read(), plan)
    print("shape", prepared.inputs["primary"][1].shape, "records", len(records), file=sys.stdout)
""")


@pytest.mark.parametrize("fmt, entries", [("JPEG", JPEG_EXIF_ENTRIES), ("PNG", 10_000)])
def test_an_exif_block_of_thousands_of_broken_entries_decodes_with_at_most_3_log_lines(fmt, entries):
    """Run as the decode worker runs it (its own process), counting what it writes and logs."""
    body = encode(Image.fromarray(photo("coffee")), fmt, exif=_exif_with_entries(entries))
    done = subprocess.run([sys.executable, "-c", _COUNT_LINES], input=body, cwd=ROOT, capture_output=True,
                          timeout=120, check=True)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert "shape (260, 346, 3)" in out, (out, err[-2000:])
    records = int(out.split("records")[1])
    lines = [line for line in err.splitlines() if line.strip()]
    assert records <= 3 and len(lines) <= 3, (records, lines[:10])


def test_pillow_still_warns_per_entry_on_that_exif_block():
    """The guard above can fail: Pillow itself, unfiltered, warns once per broken entry of the same block."""
    import warnings

    body = encode(Image.fromarray(photo("coffee")), "JPEG", exif=_exif_with_entries(200))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Image.open(io.BytesIO(body)).getexif()  # a JPEG reads its EXIF at open (its resolution)
    assert len(caught) >= 100


def test_decode_limits_without_a_rule_keep_the_short_side():
    """Callers without a model in view (``shrink`` None): the short side stays ≥ ``min_decoded_side``."""
    limits = DecodeLimits(max_body_bytes=20_000_000, max_pixels=50_000_000, min_side_px=16, max_aspect_ratio=10.0,
                          max_frames=100, min_decoded_side=692)
    image = decode_image(encode(Image.new("RGB", (4000, 3000), "gray"), "PNG"), limits).image
    assert min(image.size) >= 692 and min(image.size) < 2 * 692
