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
3. a JPEG is decoded with ``Image.draft()``, scaled by 1/2, 1/4 or 1/8 in the DCT
   domain to no less than ``min_decoded_side`` px, so an 8K photo never exists at
   full size in memory;
4. ``load()`` forces the decode here, so truncated or corrupt data fails in this
   function and nowhere later (``LOAD_TRUNCATED_IMAGES`` stays off);
5. EXIF orientation is applied (a malformed EXIF block is logged and ignored),
   and every mode becomes RGB: see ``to_rgb``;
6. an upload Pillow refuses gets one second chance: ``rampart.inputs.recovery.repair``
   rebuilds benign container damage (a missing JPEG EOI, a bad CRC on a PNG
   ancillary chunk, a wrong WebP RIFF size...) and the rebuilt bytes go through
   steps 2-5 again, as strictly. The decoding policy and what counts as pixel data
   materially missing, per format, are in that module's docstring and the README.
"""

from __future__ import annotations

import io
import logging
import warnings
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image, ImageCms, ImageOps

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
from rampart.inputs.recovery import repair

__all__ = ["DecodeLimits", "DecodedImage", "SUPPORTED_FORMATS", "sniff_format", "decode_image", "to_rgb"]

logger = logging.getLogger("rampart.inputs.decoding")

# Rampart's own pixel cap decides for every format; Pillow's warning zone
# (MAX_IMAGE_PIXELS .. 2×) would otherwise only warn.
warnings.simplefilter("ignore", Image.DecompressionBombWarning)

#: Pillow format names Rampart accepts, in the order the error message lists them.
SUPPORTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")

_SUPPORTED_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\xff\xd8\xff", "JPEG"),
    (0, b"\x89PNG\r\n\x1a\n", "PNG"),
    (0, b"GIF87a", "GIF"),
    (0, b"GIF89a", "GIF"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
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
    """Limits applied by ``decode_image``; see ``rampart.config.Settings`` for defaults."""

    max_body_bytes: int
    max_pixels: int
    min_side_px: int
    max_aspect_ratio: float
    max_frames: int
    min_decoded_side: int
    alpha_background: tuple[int, int, int] = (255, 255, 255)
    max_jpeg_scans: int = DEFAULT_MAX_JPEG_SCANS  # decode-cost limits: see rampart.inputs.decode_cost
    max_chunks: int = DEFAULT_MAX_CHUNKS


@dataclass(frozen=True)
class DecodedImage:
    """A decoded upload: ``image`` is RGB, upright; sizes are in pixels.

    ``declared_size`` is (width, height) from the file header, before draft
    scaling and orientation; ``image.size`` is what was actually decoded.
    ``warnings`` names the benign damage repaired to decode it (``rampart.inputs.recovery``,
    e.g. ``("jpeg_missing_eoi",)``); empty for an undamaged file.
    """

    image: Image.Image
    format: str
    declared_size: tuple[int, int]
    warnings: tuple[str, ...] = ()


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


def decode_image(data: bytes, limits: DecodeLimits) -> DecodedImage:
    """Decode untrusted ``data`` into an upright RGB image within ``limits``.

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
    try:
        return _decode(data, fmt, limits)
    except (UndecodableImage, CorruptImage) as refused:
        fixed = repair(data, fmt)
        if fixed is None:
            raise
        try:
            decoded = _decode(fixed.data, fmt, limits)
            control = None if fixed.control is None else _decode(fixed.control, fmt, limits)
        except (UndecodableImage, CorruptImage):
            raise refused from None
    if control is not None and not _same_pixels(decoded, control):
        raise CorruptImage(f"the {fmt} data ends inside its last scan, before every block is coded: "
                           "pixel data is missing")
    return replace(decoded, warnings=fixed.warnings + decoded.warnings)


def _same_pixels(first: DecodedImage, second: DecodedImage) -> bool:
    return first.image.size == second.image.size and first.image.tobytes() == second.image.tobytes()


def _decode(data: bytes, fmt: str, limits: DecodeLimits) -> DecodedImage:
    """Decode ``data`` (sniffed as ``fmt``) strictly; ``decode_image`` without the repair."""
    try:
        image = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"the image declares too many pixels: {exc}") from exc
    except Exception as exc:  # Pillow raises many types for a bad header
        raise UndecodableImage(f"the bytes look like {fmt} but cannot be read: {exc}") from exc
    declared = image.size
    _check_declared_size(declared, limits)
    frame_warnings = _check_frames(image, limits.max_frames)
    try:
        if fmt == "JPEG":
            image.draft(None, (limits.min_decoded_side, limits.min_decoded_side))
        image.load()
        image = _upright(image)
        rgb = to_rgb(image, limits.alpha_background)
    except ImageError:
        raise
    except Exception as exc:  # every decoder failure is the input's fault: 4xx, never 5xx
        raise CorruptImage(f"the {fmt} data is truncated or corrupt: {type(exc).__name__}: {exc}") from exc
    return DecodedImage(image=rgb, format=fmt, declared_size=declared, warnings=frame_warnings)


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
        raise CorruptImage(f"the first frame cannot be read: {type(exc).__name__}: {exc}") from exc
    return unreadable


def _upright(image: Image.Image) -> Image.Image:
    """Apply EXIF orientation; a malformed EXIF block is logged and the raw pixels kept."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception as exc:
        logger.warning("ignoring malformed EXIF orientation: %s: %s", type(exc).__name__, exc)
        return image


_SRGB_PROFILE = ImageCms.createProfile("sRGB")


def to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB.

    - 16-bit and 32-bit integer modes (``I;16*``, ``I``) are scaled from 0..65535
      to 0..255 (right shift by 8), not clipped; ``F`` in 0..1 is scaled by 255,
      otherwise clipped to 0..255.
    - Images with alpha (``RGBA``, ``LA``, ``PA``, ``P``/``L``/``RGB`` with a
      ``transparency`` entry) are composited over ``background``.
    - ``CMYK`` (including Adobe YCCK JPEGs, which Pillow decodes to CMYK) goes
      through the embedded ICC profile to sRGB when there is one.
    """
    if image.mode.startswith("I") or image.mode == "F":
        return _high_depth_to_rgb(image)
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, background)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    if image.mode == "CMYK" and image.info.get("icc_profile"):
        try:
            source = ImageCms.ImageCmsProfile(io.BytesIO(image.info["icc_profile"]))
            return ImageCms.profileToProfile(image, source, _SRGB_PROFILE, outputMode="RGB")
        except Exception as exc:
            logger.warning("ignoring unusable CMYK ICC profile: %s", exc)
    return image.convert("RGB")


def _high_depth_to_rgb(image: Image.Image) -> Image.Image:
    values = np.asarray(image)
    if image.mode == "F":
        scale = 255.0 if float(np.nanmax(values, initial=0.0)) <= 1.0 else 1.0
        gray = np.clip(np.nan_to_num(values) * scale, 0, 255).astype(np.uint8)
    else:
        gray = (np.clip(values.astype(np.int64), 0, 65535) >> 8).astype(np.uint8)
    return Image.fromarray(gray, mode="L").convert("RGB")
