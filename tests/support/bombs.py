"""The decode-cost bombs, built from ``bench.bombs``: refused from their headers in process and over HTTP."""

from __future__ import annotations

from bench.bombs import CHUNK_FORMATS, MULTI_FRAME_FORMATS, many_chunks, many_frames, progressive_jpeg
from rampart import errors
from rampart.config import Settings


#: The default settings: the bombs are refused under the limits Rampart serves with.
SETTINGS = Settings()
#: Each bomb, by name: its bytes and the error its headers must raise.
BOMBS = {
    "progressive_jpeg_8000_scans": (progressive_jpeg(7000, 8000), errors.DecodeCostTooHigh),
    **{f"{fmt.lower()}_101_frames": (many_frames(fmt, 101), errors.TooManyFrames) for fmt in MULTI_FRAME_FORMATS},
    **{f"{fmt.lower()}_200k_chunks": (many_chunks(fmt, 200_000), errors.DecodeCostTooHigh) for fmt in CHUNK_FORMATS},
}
