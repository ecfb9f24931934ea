"""``rampart.inputs.recovery`` with ``rampart.inputs.decoding``, the decoding policy on damaged real photos: benign
damage is classified, missing pixel data refused.

Every case is built here from a real photo (skimage's chelsea) in each format:
benign faults decode to exactly the pixels of the undamaged file (with the
documented ``warnings`` where Rampart repaired something), and cuts that remove
10%, 50% or 90% of the pixel data, or a progressive JPEG's later scans, are
``CorruptImage`` (400 ``corrupt_image``). The server tests send the same files
through ``/classify`` once each.
"""

from __future__ import annotations

import asyncio
import functools
import io
import re

import pytest
from PIL import Image
from prometheus_client import REGISTRY

from rampart import errors

from rampart.telemetry import metrics

from rampart.inputs import recovery
from rampart.config import Settings
from rampart.overload.deadline import Deadline
from rampart.inputs.decoding import decode_image
from tests.support import ROOT, encode
from tests.support.damage import BENIGN, BENIGN_IDS, CHELSEA, TRUNCATED, original, stray_marker_mid_scan
from tests.support.decoding import LIMITS, png_chunk
from tests.unit.standins import stand_in_chain


@functools.lru_cache(maxsize=None)
def undamaged_pixels(name: str) -> tuple[tuple[int, int], bytes]:
    """Size and RGB bytes of ``original(name)`` as Rampart decodes it."""
    decoded = decode_image(original(name), LIMITS)
    assert decoded.warnings == ()
    return decoded.image.size, decoded.image.tobytes()


@pytest.mark.parametrize("name, fault, damage, warnings", BENIGN, ids=BENIGN_IDS)
def test_benign_damage_decodes_to_the_undamaged_pixels(name, fault, damage, warnings):
    damaged = decode_image(damage(original(name)), LIMITS)
    assert damaged.warnings == warnings
    assert (damaged.image.size, damaged.image.tobytes()) == undamaged_pixels(name)


@pytest.mark.parametrize("name, data", TRUNCATED, ids=[name for name, _ in TRUNCATED])
def test_missing_pixel_data_is_corrupt_image(name, data):
    with pytest.raises(errors.CorruptImage, match="truncated|missing"):
        decode_image(data, LIMITS)


def test_a_jpeg_cut_inside_its_scan_is_refused_although_an_appended_eoi_would_decode():
    """The control decode is what refuses it: Pillow itself accepts the cut file once it ends in an EOI."""
    data = original("jpeg")
    for missing_bytes in (3, 40, len(data) // 3):
        truncated = data[: len(data) - missing_bytes]
        Image.open(io.BytesIO(truncated + b"\xff\xd9")).load()  # libjpeg fills the missing blocks: no error
        with pytest.raises(errors.CorruptImage, match="pixel data is missing"):
            decode_image(truncated, LIMITS)


def test_jpeg_with_restart_markers_missing_eoi_is_repaired_and_cut_at_a_marker_is_refused():
    data = encode(CHELSEA, "JPEG", restart_marker_rows=1)
    whole = decode_image(data, LIMITS).image.tobytes()
    repaired = decode_image(data[:-2], LIMITS)
    assert repaired.warnings == ("jpeg_missing_eoi",) and repaired.image.tobytes() == whole
    last_restart = data.rindex(b"\xff\xd3")
    for end in (last_restart, last_restart + 2):  # before or after the marker: the later rows are missing
        with pytest.raises(errors.CorruptImage, match="pixel data is missing"):
            decode_image(data[:end], LIMITS)


@pytest.mark.parametrize("name", ["jpeg", "progressive_jpeg"])
def test_a_stray_marker_inside_a_jpeg_scan_is_refused_not_taken_for_its_end(name):
    """A marker byte pair put into the middle of the entropy-coded data (the file keeps its EOI): Pillow refuses it,
    the walk took the marker for a trailing segment the file ends inside, dropped the rest of the scan and
    classified the grey-filled remainder with the warning ``jpeg_missing_eoi``."""
    damaged = stray_marker_mid_scan(name)
    with pytest.raises(OSError, match="broken data stream"):
        Image.open(io.BytesIO(damaged)).load()  # Pillow refuses it: the repair is asked
    with pytest.raises(errors.CorruptImage, match="pixel data is missing"):
        decode_image(damaged, LIMITS)


def test_progressive_jpeg_missing_any_later_scan_is_refused():
    data = original("progressive_jpeg")
    scans = [m.start() for m in re.finditer(b"\xff\xda", data)]
    assert len(scans) >= 6
    for end in scans[1:]:
        with pytest.raises(errors.CorruptImage, match="before the scans that complete every component"):
            decode_image(data[:end], LIMITS)


def test_repairs_leave_pixel_chunks_alone():
    """A bad CRC or a cut in a chunk that carries pixels is not benign: no repair is offered or made."""
    png = original("png")
    assert recovery.repair(png[:-12] + png_chunk(b"IDAT", b"\x00" * 8)[:15], "PNG") is None
    with pytest.raises(errors.CorruptImage, match="VP8 chunk declares"):
        recovery.repair(original("webp")[:-100], "WEBP")
    assert recovery.repair(original("gif")[:-100], "GIF") is None


def test_every_warning_is_documented_and_counted():
    api_doc = (ROOT / "docs" / "api.md").read_text()  # its "Damaged uploads" section
    for warning in recovery.INPUT_WARNINGS:
        assert f"`{warning}`" in api_doc, warning
    metrics.init_api_series()
    counted = {sample.labels["warning"] for family in metrics.INPUT_WARNINGS.collect() for sample in family.samples}
    assert counted == set(recovery.INPUT_WARNINGS)


def test_pipeline_answers_carry_the_warnings_and_count_them():
    """With stand-in models: the answer says what was repaired (every answer has the field) and the metric counts it."""
    pipeline = stand_in_chain(Settings())

    def counted() -> float:
        return REGISTRY.get_sample_value("rampart_input_warnings_total", {"warning": "jpeg_missing_eoi"}) or 0.0

    before = counted()
    repaired = asyncio.run(pipeline.classify(original("jpeg")[:-2], 3, Deadline(10_000)))
    whole = asyncio.run(pipeline.classify(original("png"), 3, Deadline(10_000)))
    assert repaired["input_warnings"] == ["jpeg_missing_eoi"] and whole["input_warnings"] == []
    assert counted() == before + 1
