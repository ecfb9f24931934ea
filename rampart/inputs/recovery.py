"""Repairs of benign container damage: the decoding policy's second chance.

The policy (docs/api.md, "Damaged uploads"): **a file whose pixel data is complete is
classified, whatever the state of its trailing bytes, end markers and ancillary
metadata; a file whose pixel data is materially missing is refused.** Pillow, strict
(``ImageFile.LOAD_TRUNCATED_IMAGES`` stays off), already accepts most benign damage
(trailing bytes, a missing PNG ``IEND`` or GIF trailer, missing BMP row padding, a
dangling TIFF next-IFD offset). ``repair`` handles what it refuses although every
pixel is there. It works on the container alone, with no decoder, and returns
rebuilt bytes that ``rampart.inputs.decoding`` decodes again, as strictly as the first time:

=========================== =====================================================
warning                     damage and repair
=========================== =====================================================
``jpeg_missing_eoi``        the JPEG has no ``FF D9`` after its last scan
                            (absent, zeroed, or replaced by other bytes): the
                            marker is appended (after dropping a marker segment
                            the file ends inside). Only when every scan the frame
                            needs is present (``_jpeg_scans_complete``) and the
                            decoder proves the last scan's data whole,
                            ``Repair.control`` putting filler (and the next
                            restart marker) before the EOI; the two decodes must
                            give identical pixels. Also where the scan ended at a
                            marker: a stray one (a damaged byte inside the scan)
                            looks like the start of a trailing segment.
``png_bad_ancillary_crc``   an ancillary chunk (lower-case first letter: text,
                            gamma, ICC, EXIF...) fails its CRC-32: it is dropped,
                            as libpng does.
``png_truncated_ancillary`` the file ends inside an ancillary chunk after the
                            image data: the chunk is dropped and ``IEND`` added.
``webp_bad_riff_size``      the RIFF header's size disagrees with the chunks that
                            are there: it is rewritten.
``webp_missing_padding``    the last chunk has an odd size and lacks its pad byte
                            (RIFF chunks are padded to even sizes): it is added.
``webp_truncated_metadata`` the file ends inside a chunk that carries no pixels
                            (``EXIF``, ``XMP``, ``ICCP``, unknown): it is dropped.
``later_frames_unreadable`` (any multi-frame format; found by the decoder's frame
                            walk, not here) a frame header after the first frame
                            cannot be read, e.g. a GIF cut inside a trailing
                            extension: the walk ends there, as at the end of file.
=========================== =====================================================

What counts as *materially missing*, per format (these raise ``CorruptImage``):
JPEG entropy-coded data whose absence changes the decoded pixels (the ``control``
decode, at the DCT scale Rampart decodes at: any cut of a sequential scan, whose
every block has a DC term), or any scan missing (a component never coded; in a
progressive JPEG, a coefficient of a component that never reaches its last bit,
e.g. a file cut after its first scan); PNG IDAT data that does not yield every
row, or a cut inside a pixel chunk; GIF LZW data that does not yield every pixel
of the first frame; any byte of a WebP ``VP8``/``VP8L``/``ALPH``/``ANMF`` chunk;
any byte of a BMP or TIFF pixel row (row padding is not pixel data). There is no
tolerated share of missing rows: a grey band of unknown size is not the photo.

Only bytes are handled here (no Pillow import), so the module is cheap to call
from the decoder and easy to test.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass, field

from rampart.errors import CorruptImage

__all__ = ["Repair", "INPUT_WARNINGS", "repair"]

#: Every warning ``repair`` can report, for the metric's initial series and docs/api.md.
INPUT_WARNINGS: tuple[str, ...] = (
    "jpeg_missing_eoi",
    "png_bad_ancillary_crc",
    "png_truncated_ancillary",
    "webp_bad_riff_size",
    "webp_missing_padding",
    "webp_truncated_metadata",
    "later_frames_unreadable",  # reported by rampart.inputs.decoding's frame walk, not by ``repair``
)


@dataclass(frozen=True)
class Repair:
    """Rebuilt bytes of a damaged upload and the ``warnings`` saying what was repaired.

    ``control``, when set, is the same repair with different bytes standing in for
    whatever may be missing: if the decoded pixels of ``data`` and ``control``
    differ, the missing bytes mattered and the upload is refused.
    """

    data: bytes
    warnings: tuple[str, ...]
    control: bytes | None = None


def repair(data: bytes, fmt: str) -> Repair | None:
    """A repair of benign damage in ``data`` (a ``fmt`` file Pillow refused), or None when there is none.

    ``fmt`` is a Pillow format name (``rampart.inputs.decoding.SUPPORTED_FORMATS``). Raises
    ``CorruptImage`` when the container itself shows pixel data cut off (a clearer
    message than the decoder's). Never raises anything else, whatever ``data`` is.
    """
    if fmt == "JPEG":
        return _repair_jpeg(data)
    if fmt == "PNG":
        return _repair_png(data)
    if fmt == "WEBP":
        return _repair_webp(data)
    return None  # GIF, BMP, TIFF: Pillow already accepts their benign faults (docs/api.md)


# --- JPEG (ITU-T T.81) -------------------------------------------------------------

_EOI = b"\xff\xd9"
#: Bytes with no 0xFF (so no marker) that start with 1-bits, unlike the zero bits
#: libjpeg substitutes when a scan's data runs out: decoded in place of missing
#: entropy-coded data, they give different pixels.
_JPEG_FILLER = bytes(range(0xFE, 0x00, -1))
#: A marker inside entropy-coded data: 0xFF not followed by a stuffed 0x00 or RST0-7.
_ECS_MARKER = re.compile(rb"\xff(?=[^\x00\xd0-\xd7])")
_RESTART_MARKER = re.compile(rb"\xff[\xd0-\xd7]")
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # C4 DHT, C8 JPG, CC DAC
_PROGRESSIVE_SOF = frozenset({0xC2, 0xC6, 0xCA, 0xCE})


@dataclass
class _JpegLayout:
    """What ``_jpeg_layout`` read: frame components, scans, and where the data stops."""

    components: tuple[int, ...] = ()
    progressive: bool = False
    scans: list[tuple[tuple[int, ...], int, int, int]] = field(default_factory=list)  # (components, Ss, Se, Al)
    whole_up_to: int = 0  # bytes before the first cut marker segment, or the whole file
    ends_in_scan: bool = False  # the data stops inside a scan's entropy-coded data
    last_scan_data: int = 0  # where the last scan's entropy-coded data starts


def _repair_jpeg(data: bytes) -> Repair | None:
    layout = _jpeg_layout(data)
    if layout is None or not layout.scans:
        return None  # an EOI is there, or the file stops before its first scan: the decoder's verdict stands
    if not _jpeg_scans_complete(layout):
        raise CorruptImage(
            f"the JPEG stops after {len(layout.scans)} scan(s), before the scans that complete every "
            "component: pixel data is missing"
        )
    body = data[: layout.whole_up_to]
    if layout.ends_in_scan:
        body = body.rstrip(b"\xff")  # a lone 0xFF at the end is half a marker
    # Ending at a marker does not make the scan whole: a stray marker inside its data (a flipped byte) ends the
    # walk as a trailing segment would, with the rest of the scan after it. The control decode tells them apart.
    return Repair(body + _EOI, ("jpeg_missing_eoi",), control=body + _jpeg_control_tail(body, layout) + _EOI)


def _jpeg_control_tail(body: bytes, layout: _JpegLayout) -> bytes:
    """What stands in for the missing rest of the last scan in the control decode.

    Filler, the restart marker the decoder would expect next, and filler again. Where
    the scan is whole, the decoder skips all of it (bytes before a marker, and a
    restart marker outside a scan, are ignored). Where it is cut inside a restart
    interval, or anywhere without restart markers, the first filler is decoded as
    the missing data; where it is cut at the end of an interval, the decoder skips
    the first filler looking for the marker, finds the one it expects and decodes the
    second filler as the next interval. Either way the pixels change.
    """
    restarts = len(_RESTART_MARKER.findall(body, layout.last_scan_data))
    return _JPEG_FILLER + bytes((0xFF, 0xD0 + restarts % 8)) + _JPEG_FILLER


def _jpeg_layout(data: bytes) -> _JpegLayout | None:
    """Walk the marker segments of a JPEG with no EOI; None when it has one or is not walkable."""
    layout = _JpegLayout()
    pos, size = 2, len(data)
    while pos < size:
        layout.whole_up_to = pos
        if data[pos] != 0xFF:
            return None
        while pos < size and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= size:
            return layout
        marker = data[pos]
        pos += 1
        if marker == 0xD9:  # EOI: the file is complete; the decoder refused it for another reason
            return None
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # stand-alone markers
            continue
        if pos + 2 > size:
            return layout
        (length,) = struct.unpack(">H", data[pos : pos + 2])
        if length < 2:
            return None
        if pos + length > size:
            return layout  # cut inside a marker segment
        segment = data[pos + 2 : pos + length]
        pos += length
        if marker in _SOF_MARKERS:
            if len(segment) < 6 or len(segment) < 6 + 3 * segment[5]:
                return None
            layout.components = tuple(segment[6 + 3 * i] for i in range(segment[5]))
            layout.progressive = marker in _PROGRESSIVE_SOF
        elif marker == 0xDA:
            count = segment[0] if segment else 0
            if len(segment) < 1 + 2 * count + 3:
                return None
            components = tuple(segment[1 + 2 * i] for i in range(count))
            ss, se, approximation = segment[1 + 2 * count : 4 + 2 * count]
            layout.scans.append((components, ss, se, approximation & 0x0F))
            layout.last_scan_data = pos
            found = _ECS_MARKER.search(data, pos)
            if found is None:
                layout.whole_up_to, layout.ends_in_scan = size, True
                return layout
            pos = found.start()
    layout.whole_up_to = size
    return layout


def _jpeg_scans_complete(layout: _JpegLayout) -> bool:
    """Whether the scans present code every component fully.

    Sequential: each frame component appears in some scan. Progressive: each
    coefficient 0..63 of each component is in a scan whose successive-approximation
    low bit ``Al`` is 0 (its last bit has arrived).
    """
    if not layout.components or not layout.scans:
        return False
    if not layout.progressive:
        coded = {component for components, _, _, _ in layout.scans for component in components}
        return set(layout.components) <= coded
    final = {component: set() for component in layout.components}
    for components, ss, se, al in layout.scans:
        if al == 0 and ss <= se <= 63:
            for component in components:
                final.get(component, set()).update(range(ss, se + 1))
    return all(len(coefficients) == 64 for coefficients in final.values())


# --- PNG (ISO/IEC 15948) -----------------------------------------------------------

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _repair_png(data: bytes) -> Repair | None:
    if not data.startswith(_PNG_SIGNATURE):
        return None
    kept, warnings = [_PNG_SIGNATURE], []
    pos, size, seen_idat, seen_iend = len(_PNG_SIGNATURE), len(data), False, False
    while pos + 8 <= size and not seen_iend:
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        end = pos + 12 + length
        ancillary = bool(kind[0] & 0x20)  # bit 5 of the first byte: lower case
        if end > size:
            if ancillary and seen_idat:
                warnings.append("png_truncated_ancillary")
                break
            return None  # cut inside the header or the image data: the decoder's refusal stands
        (crc,) = struct.unpack(">I", data[end - 4 : end])
        if ancillary and zlib.crc32(data[pos + 4 : end - 4]) != crc:
            warnings.append("png_bad_ancillary_crc")
        else:
            kept.append(data[pos:end])
        seen_idat |= kind == b"IDAT"
        seen_iend = kind == b"IEND"
        pos = end
    if not warnings:
        return None
    if not seen_iend:
        kept.append(_png_chunk(b"IEND", b""))
    return Repair(b"".join(kept), tuple(dict.fromkeys(warnings)))


# --- WebP (RIFF container, RFC 9649) -----------------------------------------------

#: Chunks that carry pixels or the canvas; a cut inside one of these is truncation.
_WEBP_IMAGE_CHUNKS = frozenset({b"VP8 ", b"VP8L", b"VP8X", b"ALPH", b"ANIM", b"ANMF"})


def _repair_webp(data: bytes) -> Repair | None:
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    kept, warnings = [], []
    pos, size = 12, len(data)
    while pos + 8 <= size:
        kind = data[pos : pos + 4]
        if not all(0x20 <= byte < 0x7F for byte in kind):
            break  # trailing bytes that are not a chunk: dropped
        (length,) = struct.unpack("<I", data[pos + 4 : pos + 8])
        end = pos + 8 + length
        padded_end = end + (length & 1)
        if end > size:
            if kind in _WEBP_IMAGE_CHUNKS:
                raise CorruptImage(
                    f"the WEBP {kind.decode('ascii').strip()} chunk declares {length} bytes but only "
                    f"{size - pos - 8} are present: pixel data is missing"
                )
            warnings.append("webp_truncated_metadata")
            break
        chunk = data[pos:padded_end]
        if padded_end > size:
            warnings.append("webp_missing_padding")
            chunk += b"\x00"
        kept.append(chunk)
        pos = padded_end
    body = b"WEBP" + b"".join(kept)
    if struct.unpack("<I", data[4:8])[0] != len(body):
        warnings.append("webp_bad_riff_size")
    if not warnings:
        return None
    return Repair(b"RIFF" + struct.pack("<I", len(body)) + body, tuple(dict.fromkeys(warnings)))
