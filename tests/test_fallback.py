"""The degradation chain on real servers with faults injected through RAMPART_FAULT_*."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import PHOTOS, SLACK_MS, encode, photo

DEADLINE_MS = 800


@pytest.fixture(scope="module")
def slow_server(start_server):
    """The primary takes 3 s per batch: far beyond any deadline used here."""
    return start_server(RAMPART_FAULT_PRIMARY_DELAY_MS=3000)


@pytest.fixture(scope="module")
def broken_server(start_server):
    """Both models raise on every batch."""
    return start_server(RAMPART_FAULT_PRIMARY_ERROR_RATE=1.0, RAMPART_FAULT_FALLBACK_ERROR_RATE=1.0)


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_slow_primary_falls_back_within_deadline(slow_server, name):
    body = encode(photo(name))
    started = time.monotonic()
    response = httpx.post(f"{slow_server.url}/classify", content=body, headers={"X-Deadline-Ms": str(DEADLINE_MS)}, timeout=10)
    elapsed_ms = (time.monotonic() - started) * 1000
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["degraded"] is True and result["degraded_reason"] == "primary_timeout"
    assert result["model"]["name"] == "rampart-fallback"
    assert {label["index"] for label in result["labels"][:3]} & PHOTOS[name]
    assert result["timings_ms"]["total"] <= DEADLINE_MS
    assert elapsed_ms <= DEADLINE_MS + SLACK_MS


def test_errors_everywhere_give_the_static_answer_not_a_5xx(broken_server):
    response = httpx.post(f"{broken_server.url}/classify", content=encode(photo("chelsea")), timeout=10)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["labels"] == [] and result["degraded"] is True
    assert result["degraded_reason"] == "no_model_available" and result["needs_review"] is True


def test_primary_error_falls_back_with_reason(start_server):
    server = start_server(RAMPART_FAULT_PRIMARY_ERROR_RATE=1.0)
    response = httpx.post(f"{server.url}/classify", content=encode(photo("coffee")), timeout=10)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["degraded_reason"] == "primary_error" and result["model"]["name"] == "rampart-fallback"
    assert {label["index"] for label in result["labels"][:3]} & PHOTOS["coffee"]
