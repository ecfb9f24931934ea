"""Hardened, memory-bounded image decoding with Pillow.

``decode_image(data, limits)`` turns untrusted bytes into an RGB ``PIL.Image`` or
raises a ``rampart.errors.ImageError``; it raises nothing else, whatever the
input (the fuzz tests hold it to that). The order of checks is what bounds
time and memory:

1. size of the body (``max_body_bytes``) and sniffing the format from its magic
   bytes: the Content-Type header is never trusted;
2. ``Image.open`` reads only the header; the declared size is checked against
   ``max_pixels``, ``min_side_px`` and ``max_aspect_ratio`` and the number of
   frames against ``max_frames``, all before one pixel is decoded;
3. the caller's ``shrink`` rule (``ShrinkRule``) says, from the upright declared size,
   how far the frame may be shrunk and still cover what the model needs (the
   rule of ``rampart.inputs.buckets.shrink_rule``; without one, the short side stays
   ≥ ``min_decoded_side``). A JPEG is decoded with ``Image.draft()``, scaled by 1/2,
   1/4 or 1/8 in the DCT domain, so a phone photo is never decoded at full size;
4. ``load()`` forces the decode here, so truncated or corrupt data fails in this
   function and nowhere later (``LOAD_TRUNCATED_IMAGES`` stays off). A small, plain
   8-bit RGB PNG is decoded by libspng instead (``rampart.inputs.plain_png``: the
   same pixels at about 0.6× the CPU); whatever libspng refuses goes to Pillow, and a PNG that
   Pillow decodes must yield every row its header declares (``rampart.inputs.png_rows``);
5. every mode becomes 8-bit RGB at the reduced size (``shrink_to_rgb``): the rest of
   the shrink is an integer box filter (``Image.reduce``), and a frame that is not
   RGB is converted strip by strip, so the transient memory of any mode stays within
   that of an 8-bit RGB frame of the same size (a 16-bit or float frame is never
   converted whole). Nothing is copied that would not change (an RGB frame with no
   orientation tag is returned as decoded);
6. EXIF orientation is read from the header before decoding and applied to the
   small frame at the end (a malformed EXIF block is logged once and ignored).
   Metadata never refuses pixels: Pillow's warnings about metadata the service does
   not use are silenced, and ``relax_metadata_limits`` (called in decode workers)
   raises the PNG text-chunk limits that would refuse a large embedded ICC profile;
7. an upload Pillow refuses gets one second chance: ``rampart.inputs.recovery.repair``
   rebuilds benign container damage (a missing JPEG EOI, a bad CRC on a PNG
   ancillary chunk, a wrong WebP RIFF size...) and the rebuilt bytes go through
   steps 2-6 again, as strictly. The decoding policy and what counts as pixel data
   materially missing, per format, are in that module's docstring and docs/api.md ("Damaged uploads").
"""

from __future__ import annotations

import io
import logging
import math
import re
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from PIL import ExifTags, Image, ImageCms, PngImagePlugin

from rampart.inputs.decode_cost import DEFAULT_MAX_CHUNKS, DEFAULT_MAX_JPEG_SCANS, check_decode_cost
from rampart.errors import (
    AspectRatioOutOfRange,
    CorruptImage,
    EmptyBody,
    ImageError,
    ImageTooLarge,
    ImageTooSmall,
    PayloadTooLarge,
    TooManyFrames,
    UndecodableImage,
    UnsupportedFormat,
)
from rampart.inputs.plain_png import decode_plain_rgb_png, is_plain_rgb_png
from rampart.inputs.png_rows import last_row_written, yields_every_row
from rampart.inputs.png_rows import sample_bytes_per_pixel as png_sample_bytes_per_pixel
from rampart.inputs.recovery import repair

__all__ = ["DecodeLimits", "DecodedImage", "ShrinkRule", "SUPPORTED_FORMATS", "sniff_format", "decode_image",
           "shrink_to_rgb", "to_rgb", "relax_metadata_limits", "STRIP_PIXELS", "MAX_METADATA_CHUNK_BYTES",
           "WEBP_PIXEL_SHARE", "webp_canvas_size", "MAX_SAMPLE_BYTES_PER_PIXEL", "sample_bytes_per_pixel"]

logger = logging.getLogger("rampart.inputs.decoding")

# Rampart's own pixel cap decides for every format; Pillow's warning zone
# (MAX_IMAGE_PIXELS .. 2×) would otherwise only warn.
warnings.simplefilter("ignore", Image.DecompressionBombWarning)
# Pillow warns once per damaged metadata entry (an EXIF block of thousands of bad entries
# writes thousands of lines): metadata the service does not use never reaches the log.
# Damaged pixel data raises instead, so nothing that matters is hidden. "ignore" keeps no
# per-message registry, so distinct messages cost no memory either.
warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL(\.|$)")

#: A caller's shrink rule: from the upright declared (width, height) in px, the largest
#: factor (≥ 1, a float) by which the decoded frame may be shrunk on both axes.
ShrinkRule = Callable[[int, int], float]
#: Pixels per strip when a frame that is not RGB is converted and shrunk strip by strip (``shrink_to_rgb``):
#: 2^19 px is 2 MiB as RGB (a few such temporaries per strip), and few enough strips (12 for 6 MP)
#: that the per-strip cost stays small.
STRIP_PIXELS = 1 << 19
#: EXIF orientations (tag 0x0112) that swap width and height.
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
#: ``info`` keys that ``Image.getexif`` reads an orientation from (a TIFF's own tags, ``tag_v2``, are its EXIF).
_ORIENTATION_SOURCES = frozenset({"exif", "Raw profile type exif", "XML:com.adobe.xmp", "xmp"})
#: How to make each EXIF orientation upright (the transposes ``ImageOps.exif_transpose`` uses).
_ORIENTATION_FIX = {
    2: (Image.Transpose.FLIP_LEFT_RIGHT,),
    3: (Image.Transpose.ROTATE_180,),
    4: (Image.Transpose.FLIP_TOP_BOTTOM,),
    5: (Image.Transpose.TRANSPOSE,),
    6: (Image.Transpose.ROTATE_270,),
    7: (Image.Transpose.TRANSVERSE,),
    8: (Image.Transpose.ROTATE_90,),
}

#: Pillow format names Rampart accepts, in the order the error message lists them.
SUPPORTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")

#: A WebP may declare at most ``max_pixels // WEBP_PIXEL_SHARE`` pixels. Pillow 13 decodes every WebP through
#: libwebp's ``WebPAnimDecoder``, which holds RGBA canvases, and copies the frame out of it and into the image:
#: 16.1-16.4 bytes of transient memory a declared pixel (lossy and lossless, with and without alpha; 2400×1600,
#: ``tests/unit/test_decoding_scale.py``), against 4.3 for an 8-bit RGB PNG and at most 6 for any other format and
#: mode. At a quarter of the pixels a WebP decode costs what an RGB frame at ``max_pixels`` costs.
WEBP_PIXEL_SHARE = 4

#: Bytes a declared pixel of a PNG or TIFF may hold in the file's own samples, at the pixel cap: an 8-bit RGBA
#: frame's. Decoding unpacks every sample, so its CPU grows with them: at 49 MP of zeros (zlib TIFF, the 2-core
#: host, 2026-12-08) 2 bytes a pixel (16-bit grey) took 0.31 s, 3 (8-bit RGB) 0.47, 4 (RGBA) 0.64, 6 (16-bit
#: RGB) 0.75 and 8 (16-bit CMYK) 1.10 s, from a file of 434 KB. A file with deeper samples may declare at most
#: ``max_pixels × MAX_SAMPLE_BYTES_PER_PIXEL / its bytes a pixel`` pixels (``_check_sample_bytes``).
MAX_SAMPLE_BYTES_PER_PIXEL = 4

_SUPPORTED_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\xff\xd8\xff", "JPEG"),
    (0, b"\x89PNG\r\n\x1a\n", "PNG"),
    (0, b"GIF87a", "GIF"),
    (0, b"GIF89a", "GIF"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
    (0, b"II+\x00", "TIFF"),  # BigTIFF (64-bit offsets; Pillow reads it): was a 415 "not a recognised image"
    (0, b"MM\x00+", "TIFF"),
    (0, b"BM", "BMP"),
)
# Recognised but unsupported containers, named in the 415 message.
_KNOWN_UNSUPPORTED: tuple[tuple[int, bytes, str], ...] = (
    (0, b"%PDF", "PDF"),
    (4, b"ftyp", "ISO-BMFF (HEIC/AVIF/MP4)"),
    (0, b"PK\x03\x04", "ZIP"),
    (0, b"\x1f\x8b", "gzip"),
    (0, b"\x00\x00\x01\x00", "ICO"),
    (0, b"8BPS", "PSD"),
    (0, b"\x1aE\xdf\xa3", "Matroska/WebM"),
)


@dataclass(frozen=True)
class DecodeLimits:
    """Limits applied by ``decode_image``; see ``rampart.config.Settings`` for defaults.

    ``png_decoder`` (the ``decode_png_decoder`` setting) is the one choice of decoder here:
    ``libspng`` decodes a small plain RGB PNG with libspng, ``pillow`` never does.
    """

    max_body_bytes: int
    max_pixels: int
    min_side_px: int
    max_aspect_ratio: float
    max_frames: int
    min_decoded_side: int
    alpha_background: tuple[int, int, int] = (255, 255, 255)
    max_jpeg_scans: int = DEFAULT_MAX_JPEG_SCANS  # decode-cost limits: see rampart.inputs.decode_cost
    max_chunks: int = DEFAULT_MAX_CHUNKS
    png_decoder: str = "libspng"  # "pillow": never rampart.inputs.plain_png's libspng path


@dataclass(frozen=True)
class DecodedImage:
    """A decoded upload: ``image`` is RGB, upright; sizes are in pixels.

    ``declared_size`` is (width, height) from the file header, before draft
    scaling and orientation; ``upright_size`` is the declared size after EXIF
    orientation (width and height swapped for a rotated photo); ``image.size`` is
    what was actually decoded, after the shrink.
    ``warnings`` names the benign damage repaired to decode it (``rampart.inputs.recovery``,
    e.g. ``("jpeg_missing_eoi",)``); empty for an undamaged file.
    """

    image: Image.Image
    format: str
    declared_size: tuple[int, int]
    warnings: tuple[str, ...] = ()
    upright_size: tuple[int, int] = (0, 0)


def sniff_format(data: bytes) -> str:
    """The Pillow format name of ``data``, from its magic bytes alone.

    Raises ``UnsupportedFormat`` (415) for anything that is not a supported format.
    """
    for offset, magic, name in _SUPPORTED_MAGIC:
        if data[offset : offset + len(magic)] == magic:
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    supported = ", ".join(SUPPORTED_FORMATS)
    for offset, magic, name in _KNOWN_UNSUPPORTED:
        if data[offset : offset + len(magic)] == magic:
            raise UnsupportedFormat(f"{name} is not a supported image format; supported: {supported}")
    raise UnsupportedFormat(f"the body is not a recognised image; supported formats: {supported}")


def decode_image(data: bytes, limits: DecodeLimits, shrink: ShrinkRule | None = None) -> DecodedImage:
    """Decode untrusted ``data`` into an upright RGB image within ``limits``, shrunk as far as ``shrink`` allows.

    ``shrink`` (``ShrinkRule``) gives the largest shrink factor from the upright
    declared size; None keeps the short side ≥ ``limits.min_decoded_side``.
    Returns a ``DecodedImage`` whose image is RGB, uint8 per channel.
    Raises only ``rampart.errors.ImageError`` subclasses: ``EmptyBody``,
    ``PayloadTooLarge``, ``UnsupportedFormat``, ``UndecodableImage``,
    ``ImageTooLarge``, ``ImageTooSmall``, ``AspectRatioOutOfRange``,
    ``TooManyFrames``, ``DecodeCostTooHigh`` or ``CorruptImage``. An upload decoded after a repair of
    benign damage carries its ``warnings``.
    """
    if not data:
        raise EmptyBody("the request carried no image bytes")
    if len(data) > limits.max_body_bytes:
        raise PayloadTooLarge(f"the image is {len(data)} bytes; the limit is {limits.max_body_bytes} bytes")
    fmt = sniff_format(data)
    check_decode_cost(data, fmt, limits.max_frames, limits.max_jpeg_scans, limits.max_chunks)
    if shrink is None:
        shrink = _short_side_rule(limits.min_decoded_side)
    try:
        return _decode(data, fmt, limits, shrink)
    except (UndecodableImage, CorruptImage) as refused:
        fixed = repair(data, fmt)
        if fixed is None:
            raise
        try:
            decoded = _decode(fixed.data, fmt, limits, shrink)
            control = None if fixed.control is None else _decode(fixed.control, fmt, limits, shrink)
        except (UndecodableImage, CorruptImage):
            raise refused from None
    if control is not None and not _same_pixels(decoded, control):
        raise CorruptImage(f"the {fmt} data ends inside its last scan, before every block is coded: "
                           "pixel data is missing")
    return replace(decoded, warnings=fixed.warnings + decoded.warnings)


def _same_pixels(first: DecodedImage, second: DecodedImage) -> bool:
    return first.image.size == second.image.size and first.image.tobytes() == second.image.tobytes()


def _short_side_rule(min_side: int) -> ShrinkRule:
    """The shrink rule without a model in view: the short side stays ≥ ``min_side`` px."""
    return lambda width, height: min(width, height) / min_side


def _decode(data: bytes, fmt: str, limits: DecodeLimits, shrink: ShrinkRule) -> DecodedImage:
    """Decode ``data`` (sniffed as ``fmt``) strictly; ``decode_image`` without the repair."""
    if fmt == "WEBP":  # Pillow's WebP decoder allocates its canvases when the file is opened: check first
        _check_webp_canvas(data, limits)
    try:
        image = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"the image declares more than {limits.max_pixels} pixels, the limit (Pillow refused "
                            f"its header: {_decoder_message(exc)})") from exc
    except Exception as exc:  # Pillow raises many types for a bad header
        raise UndecodableImage(f"the bytes look like {fmt} but cannot be read: {_decoder_message(exc)}") from exc
    declared = image.size
    _check_declared_size(declared, limits)
    _check_sample_bytes(image, fmt, data, limits)
    frame_warnings = _check_frames(image, limits.max_frames)
    try:
        if fmt == "JPEG":  # the orientation is in the header: known before the (reduced) decode
            orientation = _orientation(image)
            upright = _upright_size(declared, orientation)
            factor = max(float(shrink(*upright)), 1.0)
            scale = _draft_scale(factor)
            if scale > 1:  # Pillow picks the largest DCT scale keeping each side ≥ the size asked for
                image.draft(None, (declared[0] // scale, declared[1] // scale))
            image.load()
        else:
            # A PNG's eXIf chunk may follow its pixels, and Pillow reads it only once they are decoded; in a
            # plain RGB PNG (rampart.inputs.plain_png) every such chunk precedes them, so Image.open has read it.
            plain = fmt == "PNG" and limits.png_decoder == "libspng" and is_plain_rgb_png(data)
            if not plain:
                image.load()
            orientation = _orientation(image)
            upright = _upright_size(declared, orientation)
            factor = max(float(shrink(*upright)), 1.0)
            # libspng only for a frame no reduce follows: its array and Pillow's copy stay within one RGB frame
            fast = decode_plain_rgb_png(data, declared) if plain and factor < 2 and image.tile else None
            if fast is not None:
                image = fast
            image.load()  # what libspng did not decode (a no-op for what is already loaded)
            if fmt == "PNG" and fast is None:  # libspng refuses a short IDAT stream itself; Pillow does not
                _check_png_rows(data, image)
        rgb = shrink_to_rgb(image, int(factor * image.size[0] / declared[0]), limits.alpha_background)
        for transpose in _ORIENTATION_FIX.get(orientation, ()):
            rgb = rgb.transpose(transpose)
    except ImageError:
        raise
    except Exception as exc:  # every decoder failure is the input's fault: 4xx, never 5xx
        raise CorruptImage(f"the {fmt} data is truncated or corrupt: {type(exc).__name__}: {_decoder_message(exc)}") from exc
    return DecodedImage(image=rgb, format=fmt, declared_size=declared, warnings=frame_warnings,
                        upright_size=upright)


def _check_png_rows(data: bytes, image: Image.Image) -> None:
    """Raise ``CorruptImage`` when the PNG ``data``, decoded by Pillow into ``image``, did not yield every row:
    Pillow leaves rows after a zlib stream that ends early as zeros (``rampart.inputs.png_rows``)."""
    if not image.info.get("interlace") and last_row_written(image):
        return
    if not yields_every_row(data):
        raise CorruptImage("the PNG data is truncated or corrupt: its IDAT stream does not yield every row "
                           "(pixel data is missing)")


#: An object's default repr inside a decoder's message ("cannot identify image file <_io.BytesIO object at 0x7f…>").
_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _decoder_message(exc: BaseException) -> str:
    """``exc``'s message for a client: object reprs (a heap address, the buffer's type) read "the upload"."""
    return _OBJECT_REPR.sub("the upload", str(exc))


def _upright_size(declared: tuple[int, int], orientation: int) -> tuple[int, int]:
    """(width, height) of a frame of ``declared`` size once EXIF ``orientation`` is applied."""
    return (declared[1], declared[0]) if orientation in _SWAPPING_ORIENTATIONS else declared


def _draft_scale(factor: float) -> int:
    """The JPEG DCT scale (1, 2, 4 or 8) for a frame that may be shrunk by ``factor``: the largest not above it."""
    return next(scale for scale in (8, 4, 2, 1) if scale <= factor)


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation (1-8) of an opened ``image``; 1 when absent or malformed (logged once).

    For a JPEG this reads only the header; call it after ``load()`` for other formats
    (a PNG's eXIf chunk may follow its pixel data).
    """
    if not hasattr(image, "tag_v2") and not _ORIENTATION_SOURCES.intersection(image.info):
        return 1  # no EXIF or XMP block to read it from: skip Pillow's parse
    try:
        value = image.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception as exc:
        logger.warning("ignoring malformed EXIF: %s: %s", type(exc).__name__, exc)
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1

def webp_canvas_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) in pixels of a WebP's canvas from its first chunk's header (``VP8 ``, ``VP8L`` or
    ``VP8X``, as the WebP container specification lays them out), without decoding; None when the header
    is too short or not one of them (the decoder then reports it)."""
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":  # key frame start code
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:  # lossless signature, then 14 + 14 bits
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(data) >= 30:  # extended: 24-bit canvas width and height, each less one
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def _check_webp_canvas(data: bytes, limits: DecodeLimits) -> None:
    """Raise ``ImageTooLarge`` for a WebP canvas over ``limits.max_pixels // WEBP_PIXEL_SHARE`` pixels."""
    size = webp_canvas_size(data)
    limit = limits.max_pixels // WEBP_PIXEL_SHARE
    if size is not None and size[0] * size[1] > limit:
        raise ImageTooLarge(
            f"the WebP image declares {size[0]}x{size[1]} = {size[0] * size[1]} pixels; the limit for WebP is "
            f"{limit} (1/{WEBP_PIXEL_SHARE} of the {limits.max_pixels}-pixel limit: its decoder holds about "
            f"{WEBP_PIXEL_SHARE} times the memory a pixel of other formats holds)"
        )


def sample_bytes_per_pixel(image: Image.Image, fmt: str, data: bytes) -> float | None:
    """Bytes a pixel holds in the file's own samples, from the header: a PNG's bit depth × channels (IHDR),
    a TIFF's bits per sample summed over its samples (tags 258 and 277); None for other formats (a JPEG is
    decoded at a reduced DCT scale, a WebP has its own share, BMP and GIF hold at most 4 bytes a pixel) and
    for a header that does not say."""
    if fmt == "PNG":
        return png_sample_bytes_per_pixel(data)
    if fmt != "TIFF":
        return None
    try:
        tags = image.tag_v2
        bits, samples = tags.get(258), tags.get(277, 1)
    except Exception:  # a tag Pillow cannot read: the decode decides what the upload's fault is
        return None
    bits = (bits,) if isinstance(bits, int) else bits
    if not isinstance(bits, tuple) or not bits or not all(isinstance(b, int) for b in bits) or not isinstance(samples, int):
        return None
    return (sum(bits) if len(bits) == samples else bits[0] * samples) / 8


def _check_sample_bytes(image: Image.Image, fmt: str, data: bytes, limits: DecodeLimits) -> None:
    """Raise ``ImageTooLarge`` when the declared pixels hold more sample bytes than ``MAX_SAMPLE_BYTES_PER_PIXEL``
    a pixel at ``limits.max_pixels``: a 16-bit CMYK TIFF (8 bytes a pixel) may declare half the pixel cap."""
    per_pixel = sample_bytes_per_pixel(image, fmt, data)
    if per_pixel is None or per_pixel <= MAX_SAMPLE_BYTES_PER_PIXEL:
        return
    width, height = image.size
    limit = int(limits.max_pixels * MAX_SAMPLE_BYTES_PER_PIXEL / per_pixel)
    if width * height > limit:
        raise ImageTooLarge(
            f"the {fmt} image declares {width}x{height} = {width * height} pixels of {per_pixel:g} bytes each; the "
            f"limit at that depth is {limit} pixels ({MAX_SAMPLE_BYTES_PER_PIXEL} bytes a pixel at the "
            f"{limits.max_pixels}-pixel limit: decoding unpacks every sample)"
        )


def _check_declared_size(size: tuple[int, int], limits: DecodeLimits) -> None:
    width, height = size
    if width * height > limits.max_pixels:
        raise ImageTooLarge(
            f"the image declares {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels}"
        )
    if min(width, height) < limits.min_side_px:
        raise ImageTooSmall(f"the image is {width}x{height}; each side must be at least {limits.min_side_px} px")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise AspectRatioOutOfRange(
            f"the image is {width}x{height}; the long side may be at most {limits.max_aspect_ratio:g} times the short side"
        )


def _check_frames(image: Image.Image, max_frames: int) -> tuple[str, ...]:
    """Policy: the first frame is classified; files with more than ``max_frames`` are refused.

    Only frames up to index ``max_frames`` are ever inspected, and none is decoded:
    ``n_frames`` would walk the whole file (a 20 MB GIF of tiny frames takes over a
    second), and Pillow's GIF ``seek(n)`` decodes every earlier frame at full screen
    size (seconds for a 7000×7000 animation), so GIF frames are skipped with
    ``_seek(n, update_image=False)``, the header walk ``n_frames`` itself uses
    (Pillow 13.0, pinned).

    A frame header that cannot be read (the file is cut, or damaged, after the
    first frame) ends the walk like the end of the file: the frames after it are
    not there to count or decode. Returns ``("later_frames_unreadable",)`` then,
    else ``()``. Raises ``TooManyFrames``, or ``CorruptImage`` when the first frame
    cannot be sought back to.
    """
    unreadable: tuple[str, ...] = ()
    try:
        if not getattr(image, "is_animated", False):  # a GIF walks its second frame's header here
            return ()
        if image.format == "GIF":
            for frame in range(1, max_frames + 1):
                image._seek(frame, False)
        else:
            image.seek(max_frames)
    except EOFError:
        pass
    except Exception as exc:
        logger.debug("frame table unreadable after the first frame: %s: %s", type(exc).__name__, exc)
        unreadable = ("later_frames_unreadable",)
    else:
        raise TooManyFrames(f"the image has more than {max_frames} frames; the limit is {max_frames}")
    try:
        image.seek(0)
    except Exception as exc:
        raise CorruptImage(f"the first frame cannot be read: {type(exc).__name__}: {_decoder_message(exc)}") from exc
    return unreadable


_SRGB_PROFILE = ImageCms.createProfile("sRGB")


def shrink_to_rgb(image: Image.Image, factor: int, background: tuple[int, int, int]) -> Image.Image:
    """``image`` (any mode, loaded) as 8-bit RGB, shrunk by the integer ``factor`` with a box filter.

    The result is ⌈W/factor⌉×⌈H/factor⌉ (``Image.reduce``). An RGB frame is reduced as
    it is (and returned as is, no copy, when ``factor`` < 2). Any other mode is, with
    ``factor`` ≥ 2, cropped into strips of about ``STRIP_PIXELS`` px, each converted
    by ``to_rgb``'s rules, reduced and pasted into the output: a 16-bit, float or
    CMYK frame is never converted whole, so the transient memory is one strip plus
    the output. ``factor`` < 2 converts the whole (small) frame.
    """
    if factor < 2:
        return to_rgb(image, background)
    if image.mode == "RGB" and "transparency" not in image.info:
        return image.reduce(factor)
    width, height = image.size
    rows = max(factor, STRIP_PIXELS // width // factor * factor)
    convert = _rgb_converter(image, background)
    out = Image.new("RGB", (math.ceil(width / factor), math.ceil(height / factor)))
    for top in range(0, height, rows):
        strip = image.crop((0, top, width, min(top + rows, height)))
        out.paste(convert(strip).reduce(factor), (0, top // factor))
    return out


def to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB; an RGB image without transparency is returned as is (no copy).

    - 16-bit and 32-bit integer modes (``I;16*``, ``I``) are scaled from 0..65535
      to 0..255 (right shift by 8), not clipped; ``F`` in 0..1 is scaled by 255,
      otherwise clipped to 0..255.
    - Images with alpha (``RGBA``, ``LA``, ``PA``, ``P``/``L``/``RGB`` with a
      ``transparency`` entry) are composited over ``background``.
    - ``CMYK`` (including Adobe YCCK JPEGs, which Pillow decodes to CMYK) goes
      through the embedded ICC profile to sRGB when there is one.
    """
    return _rgb_converter(image, background)(image)


def _rgb_converter(image: Image.Image, background: tuple[int, int, int]) -> Callable[[Image.Image], Image.Image]:
    """``to_rgb``'s conversion for ``image``'s mode and metadata, decided (and an ICC transform built) once,
    so that ``shrink_to_rgb`` applies the same conversion to every strip of one frame."""
    if image.mode == "F":
        finite = max((float(np.nanmax(np.asarray(strip), initial=0.0)) for strip in _strips(image)), default=0.0)
        return _float_to_rgb(255.0 if finite <= 1.0 else 1.0)
    if image.mode.startswith("I"):
        return _integer_to_rgb
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        return lambda part: _flatten(part, background)
    if image.mode == "CMYK" and image.info.get("icc_profile"):
        try:
            source = ImageCms.ImageCmsProfile(io.BytesIO(image.info["icc_profile"]))
            transform = ImageCms.buildTransform(source, _SRGB_PROFILE, "CMYK", "RGB")
            return lambda part: ImageCms.applyTransform(part, transform)
        except Exception as exc:
            logger.warning("ignoring unusable CMYK ICC profile: %s", exc)
    if image.mode == "RGB":
        return lambda part: part
    return lambda part: part.convert("RGB")


def _strips(image: Image.Image):
    """``image`` cropped into horizontal strips of about ``STRIP_PIXELS`` px, top to bottom."""
    width, height = image.size
    rows = max(1, STRIP_PIXELS // width)
    for top in range(0, height, rows):
        yield image.crop((0, top, width, min(top + rows, height)))


def _flatten(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    rgba = image.convert("RGBA")
    flat = Image.new("RGB", rgba.size, background)
    flat.paste(rgba, mask=rgba.getchannel("A"))
    return flat


def _float_to_rgb(scale: float) -> Callable[[Image.Image], Image.Image]:
    def convert(image: Image.Image) -> Image.Image:
        values = np.array(image, dtype=np.float32)  # one float copy of the strip, then worked in place
        np.nan_to_num(values, copy=False)
        np.multiply(values, scale, out=values)
        np.clip(values, 0, 255, out=values)
        return Image.fromarray(values.astype(np.uint8), mode="L").convert("RGB")
    return convert


def _integer_to_rgb(image: Image.Image) -> Image.Image:
    """16- or 32-bit integer grey to RGB: 0..65535 shifted to 0..255, in the frame's own dtype (no int64 copy)."""
    values = np.asarray(image)
    if values.dtype.kind != "u":  # "I" is int32: negative and > 65535 values are clipped first
        values = np.clip(values, 0, 65535)
    return Image.fromarray((values >> 8).astype(np.uint8), mode="L").convert("RGB")


#: The largest PNG text or ICC chunk a decode worker inflates (``relax_metadata_limits``), bytes.
MAX_METADATA_CHUNK_BYTES = 16 << 20


def relax_metadata_limits(max_body_bytes: int) -> None:
    """Let Pillow read PNG metadata as large as a real upload carries: for decode workers only.

    Pillow refuses a PNG whose compressed text or ICC chunk inflates past
    ``PngImagePlugin.MAX_TEXT_CHUNK`` (1 MiB), so a valid photo with a large embedded
    display profile was answered ``undecodable_image``. Raised to the smaller of
    ``max_body_bytes`` and ``MAX_METADATA_CHUNK_BYTES`` (16 MiB) per chunk, and all
    text chunks together to 4× that (at least Pillow's 64 MiB): each inflate stays
    bounded, so a deflate bomb in a chunk costs at most that, and
    ``Image.MAX_IMAGE_PIXELS`` (the decompression-bomb check) is untouched.
    """
    chunk = max(PngImagePlugin.MAX_TEXT_CHUNK, min(max_body_bytes, MAX_METADATA_CHUNK_BYTES))
    PngImagePlugin.MAX_TEXT_CHUNK = chunk
    PngImagePlugin.MAX_TEXT_MEMORY = max(PngImagePlugin.MAX_TEXT_MEMORY, 4 * chunk)
