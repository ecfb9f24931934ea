"""Property-based fuzzing of the decoder and the server with mutated real images."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from rampart.decoding import decode_image
from rampart.errors import ImageError
from tests.conftest import encode, photo
from tests.test_decoding import LIMITS

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


@pytest.fixture(scope="module")
def mutated_bodies() -> list[bytes]:
    bodies: list[bytes] = []

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mutated_images())
    def collect(data):
        bodies.append(data)

    collect()
    return bodies


def test_server_answers_mutated_bodies_with_2xx_or_4xx(server, mutated_bodies):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        statuses = [client.post("/classify", content=body).status_code for body in mutated_bodies]
    assert all(200 <= s < 500 for s in statuses), sorted(set(statuses))
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses)
