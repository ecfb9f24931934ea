"""``rampart.inputs.buckets``: the default bucket shapes, the nearest-aspect choice and the fit to a bucket."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from rampart.inputs.buckets import buckets_for_resolution, choose_bucket, fit_to_bucket


def test_default_buckets_match_the_documented_shapes():
    assert {n: (b.height, b.width) for n, b in buckets_for_resolution(260).items()} == {
        "square": (260, 260), "landscape": (260, 346), "portrait": (346, 260)}
    assert {n: (b.height, b.width) for n, b in buckets_for_resolution(224).items()} == {
        "square": (224, 224), "landscape": (224, 298), "portrait": (298, 224)}


@pytest.mark.parametrize("size, name", [((640, 427), "landscape"), ((427, 640), "portrait"), ((500, 520), "square"),
                                        ((3000, 300), "landscape"), ((300, 3000), "portrait")])
def test_nearest_aspect_bucket(size, name):
    assert choose_bucket(*size, buckets_for_resolution(260)).name == name


def test_fit_to_bucket_gives_exact_shape_and_dtype():
    for bucket in buckets_for_resolution(260).values():
        out = fit_to_bucket(Image.new("RGB", (3000, 300), "red"), bucket, 1.14)
        assert out.shape == bucket.shape and out.dtype == np.uint8
