"""Plain-Python parts: buckets, top-k, errors, settings."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
from PIL import Image

from rampart import errors
from rampart.inputs.buckets import buckets_for_resolution, choose_bucket, fit_to_bucket
from rampart.config import Settings
from rampart.results import softmax, top_labels
from tests.support import ROOT


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


def test_top_labels_sorted_and_validated():
    probs = softmax(np.array([[0.1, 3.0, 2.0, -1.0]]))[0]
    assert abs(probs.sum() - 1) < 1e-6
    out = top_labels(probs, ["a", "b", "c", "d"], 3)
    assert [o["label"] for o in out] == ["b", "c", "a"]
    with pytest.raises(ValueError):
        top_labels(probs, ["a"], 1)


def test_every_error_has_a_unique_code_and_a_proper_status():
    codes = [cls.code for cls in errors.ERROR_CLASSES]
    assert len(codes) == len(set(codes))
    for cls in errors.ERROR_CLASSES:
        if issubclass(cls, errors.RequestError):
            assert 400 <= cls.status < 500 and cls.status != 429
    assert errors.Overloaded.status == 429 and errors.InternalError.status == 500
    api_doc = (ROOT / "docs" / "api.md").read_text()
    missing = [code for code in codes if f"`{code}`" not in api_doc]
    assert not missing, f"error codes not documented in docs/api.md: {missing}"


def test_settings_from_env_validates_and_names_bad_values():
    settings = Settings.from_env({"RAMPART_MAX_PIXELS": "1000", "RAMPART_ALPHA_BACKGROUND": "0,0,0"})
    assert settings.max_pixels == 1000 and settings.alpha_background == (0, 0, 0)
    with pytest.raises(pydantic.ValidationError, match="max_pixels"):
        Settings.from_env({"RAMPART_MAX_PIXELS": "-1"})
    with pytest.raises(pydantic.ValidationError):
        Settings.from_env({"RAMPART_DEFAULT_DEADLINE_MS": "90000", "RAMPART_MAX_DEADLINE_MS": "1000"})


def test_default_cpu_threads_rule():
    """The rule of rampart.config.default_cpu_threads: a 2-core CPU host gives each model one
    thread; a big CPU host gives most cores to the primary and keeps one free; a GPU host feeds
    the primary with one thread and lets the fallback take half the cores."""
    from rampart.config import default_cpu_threads

    assert (default_cpu_threads("primary", 2, gpu=False), default_cpu_threads("fallback", 2, gpu=False)) == (1, 1)
    assert (default_cpu_threads("primary", 16, gpu=False), default_cpu_threads("fallback", 16, gpu=False)) == (11, 4)
    assert (default_cpu_threads("primary", 16, gpu=True), default_cpu_threads("fallback", 16, gpu=True)) == (1, 8)
    assert default_cpu_threads("primary", 1, gpu=False) == default_cpu_threads("fallback", 1, gpu=False) == 1
