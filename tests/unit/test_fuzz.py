"""Property-based fuzzing of the decoder with mutated real images (the server: tests/server/test_fuzz.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from rampart.inputs.decoding import decode_image
from rampart.errors import ImageError
from tests.support import encode, photo
from tests.unit.test_decoding import LIMITS

SMALL = np.asarray(Image.fromarray(photo("chelsea")).resize((96, 64)))
SEEDS = {fmt: encode(SMALL, fmt) for fmt in ("PNG", "JPEG", "GIF", "WEBP")}


@st.composite
def mutated_images(draw) -> bytes:
    """A valid PNG/JPEG/GIF/WebP, then truncated, byte-flipped and/or spliced with another header."""
    data = bytearray(SEEDS[draw(st.sampled_from(sorted(SEEDS)))])
    for _ in range(draw(st.integers(0, 8))):
        position = draw(st.integers(0, len(data) - 1))
        data[position] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        other = SEEDS[draw(st.sampled_from(sorted(SEEDS)))]
        cut = draw(st.integers(1, 64))
        data = bytearray(other[:cut]) + data[cut:]
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_images())
def test_decoder_raises_only_image_errors(data):
    try:
        decoded = decode_image(data, LIMITS)
    except ImageError:
        return
    assert decoded.image.mode == "RGB" and min(decoded.image.size) > 0
