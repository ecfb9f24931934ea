"""Mutated real images for property-based fuzzing of the decoder, in process and over HTTP."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from PIL import Image

from tests.support import encode, photo


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
