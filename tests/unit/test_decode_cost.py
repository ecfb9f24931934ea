"""``rampart.inputs.decode_cost``, decode cost counted before decoding: bombs of every kind refused, real images not."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from bench.bombs import CHUNK_FORMATS, MULTI_FRAME_FORMATS, many_chunks, many_frames, progressive_jpeg
from rampart import errors
from rampart.inputs.decode_cost import check_decode_cost
from rampart.inputs.decoding import DecodeLimits, decode_image, sniff_format
from tests.support import encode, photo
from tests.support.bombs import BOMBS, SETTINGS
from tests.support.decoding import LIMITS


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_each_bomb_is_refused_from_its_headers(name):
    data, error = BOMBS[name]
    with pytest.raises(error):
        decode_image(data, LIMITS)


@pytest.mark.parametrize("fmt", MULTI_FRAME_FORMATS)
def test_a_few_frames_are_accepted_and_the_first_is_classified(fmt):
    data = many_frames(fmt, 3)
    cost = check_decode_cost(data, sniff_format(data), LIMITS.max_frames)
    assert cost.frames == 3
    if fmt != "GIF":  # the GIF builder's frames are one pixel on a 7000×7000 screen
        assert decode_image(data, LIMITS).image.mode == "RGB"


def test_scan_limit_is_exact_and_real_progressive_photos_pass():
    limits = DecodeLimits(**{**LIMITS.__dict__, "max_jpeg_scans": 20})
    assert decode_image(progressive_jpeg(256, 20), limits).image.size == (256, 256)
    with pytest.raises(errors.DecodeCostTooHigh, match="more than 20 scans"):
        decode_image(progressive_jpeg(256, 21), limits)
    for name in ("chelsea", "china"):
        for progressive in (False, True):
            data = encode(photo(name), progressive=progressive)
            assert check_decode_cost(data, "JPEG", LIMITS.max_frames).scans == (10 if progressive else 1)
            decode_image(data, LIMITS)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF"])
def test_real_photos_cost_one_frame_and_few_chunks(fmt):
    data = encode(photo("china"), fmt)
    cost = check_decode_cost(data, fmt, LIMITS.max_frames)
    assert cost.frames == 1 and cost.chunks < 2_000 and cost.scans <= 1


@pytest.mark.parametrize("fmt", CHUNK_FORMATS)
def test_chunk_walk_stops_at_the_limit_not_at_the_end(fmt):
    """400,000 empty chunks: refused after max_chunks steps, a fraction of what Pillow's own header parse costs."""
    data = many_chunks(fmt, 4 * SETTINGS.inputs.max_chunks)
    start = time.perf_counter()
    with pytest.raises(errors.DecodeCostTooHigh):
        check_decode_cost(data, fmt, LIMITS.max_frames, max_chunks=SETTINGS.inputs.max_chunks)
    capped_s = time.perf_counter() - start
    start = time.perf_counter()
    try:
        Image.open(io.BytesIO(data)).load()  # the same bytes through Pillow alone, same run
    except Exception:
        pass
    pillow_s = time.perf_counter() - start
    assert capped_s < 0.5 * pillow_s, (capped_s, pillow_s)


@pytest.mark.parametrize("pages", [3, LIMITS.max_frames + 1])
def test_a_bigtiffs_pages_are_counted_as_a_tiffs(pages):
    """BigTIFF's IFDs have 64-bit offsets and counts and 20-byte entries; read as a classic TIFF's, its pages were
    not counted before decoding (Pillow's own page walk caught too many later, at more cost)."""
    frames = [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(pages)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "TIFF", save_all=True, append_images=frames[1:], big_tiff=True)
    data = buffer.getvalue()
    assert data[:4] == b"II+\x00"
    if pages <= LIMITS.max_frames:
        assert check_decode_cost(data, "TIFF", LIMITS.max_frames).frames == pages
    else:
        with pytest.raises(errors.TooManyFrames):
            check_decode_cost(data, "TIFF", LIMITS.max_frames)  # from the header walk, before Pillow opens it
