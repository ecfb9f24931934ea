"""``rampart.inputs.decoding`` fuzzed: property-based tests of the decoder with mutated real images (the server:
tests/server/test_fuzz.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from rampart.inputs.decoding import decode_image
from rampart.errors import ImageError
from tests.support.decoding import LIMITS
from tests.support.fuzz import mutated_images


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_images())
def test_decoder_raises_only_image_errors(data):
    try:
        decoded = decode_image(data, LIMITS)
    except ImageError:
        return
    assert decoded.image.mode == "RGB" and min(decoded.image.size) > 0
