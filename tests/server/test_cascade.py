"""Cascade routing on a real server (``RAMPART_ROUTING=cascade``, the calibrated default threshold).

The photos are chosen from the calibration's own records (docs/bench/cascade_eval.json,
variant ``full``): the fallback is sure of coffee (msp 0.74, it agrees with the primary)
and unsure of the China palace (msp 0.19, it disagrees). The slow primary is injected
through the fault file, after the healthy checks, so one server serves the module.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import pytest

from rampart.config import Settings
from tests.support import PHOTOS, ROOT, SLACK_MS, encode, photo
from tests.support.faults import write_faults
from tests.support.metrics import dashboard_metrics, missing_metrics

DEADLINE_MS = 800
CALIBRATION = json.loads((ROOT / "docs" / "bench" / "cascade_eval.json").read_text())
SURE, UNSURE = "coffee", "china"


@pytest.fixture(scope="module")
def cascade(start_server, tmp_path_factory):
    """A cascade-mode server whose faults are switched through RAMPART_FAULT_FILE: (client, fault file)."""
    faults = tmp_path_factory.mktemp("cascade") / "faults.json"
    write_faults(faults)
    server = start_server(RAMPART_ROUTING="cascade", RAMPART_FAULT_FILE=str(faults))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client, faults
    write_faults(faults)


def classify(client: httpx.Client, name: str) -> tuple[dict, float]:
    """The answer for photo ``name`` within ``DEADLINE_MS``, and the client-side time it took (ms)."""
    started = time.monotonic()
    response = client.post("/classify", content=encode(photo(name)), headers={"X-Deadline-Ms": str(DEADLINE_MS)})
    assert response.status_code == 200, response.text
    return response.json(), (time.monotonic() - started) * 1000


def test_the_photos_sit_on_either_side_of_the_calibrated_threshold():
    recommended = CALIBRATION["recommendation"]
    settings = Settings()
    assert (settings.routing.confidence, settings.routing.threshold) == (recommended["kind"], recommended["threshold"])
    msp = {record["name"]: record["msp"] for record in CALIBRATION["records"]}
    # Far from the threshold, so encoding the photo as the test does (JPEG, quality 75) cannot move it across.
    assert msp[f"{SURE}/full"] - 0.2 >= settings.routing.threshold >= msp[f"{UNSURE}/full"] + 0.2


def test_a_sure_photo_comes_from_the_fallback_and_an_unsure_one_from_the_primary(cascade):
    client, _ = cascade
    sure, _ = classify(client, SURE)
    assert sure["route"] == "cascade_confident" and sure["model"]["name"] == "rampart-fallback", sure
    assert sure["degraded"] is False and sure["labels"][0]["index"] in PHOTOS[SURE]
    unsure, _ = classify(client, UNSURE)
    assert unsure["route"] == "cascade_escalated" and unsure["model"]["name"] == "rampart-primary", unsure
    assert unsure["degraded"] is False and unsure["labels"][0]["index"] in PHOTOS[UNSURE]

    stats = client.get("/stats").json()["cascade"]
    assert stats["routing"] == "cascade" and stats["threshold"] == 0.42
    assert stats["routes"]["cascade_confident"] >= 1 and stats["routes"]["cascade_escalated"] >= 1
    assert 0 < stats["escalation_rate"] < 1
    exposition = client.get("/metrics").text
    assert 'rampart_cascade_routes_total{route="cascade_escalated"} 1.0' in exposition
    assert "rampart_cascade_confidence_count 2.0" in exposition


def test_with_a_slow_primary_the_unsure_photo_gets_the_fallback_answer_in_time(cascade):
    client, faults = cascade
    write_faults(faults, fault_primary_delay_ms=3000)
    try:
        unsure, elapsed_ms = classify(client, UNSURE)
        sure, _ = classify(client, SURE)
    finally:
        write_faults(faults)
    assert unsure["route"] == "cascade_not_escalated" and unsure["model"]["name"] == "rampart-fallback", unsure
    assert unsure["degraded"] is True and unsure["degraded_reason"] == "primary_timeout"
    assert elapsed_ms <= DEADLINE_MS + SLACK_MS and unsure["timings_ms"]["total"] <= DEADLINE_MS
    assert sure["route"] == "cascade_confident" and sure["degraded"] is False  # the slow primary is not asked


def test_every_cascade_metric_the_dashboard_queries_exists(cascade):
    client, _ = cascade
    queried = dashboard_metrics("rampart_cascade_")
    assert {"rampart_cascade_routes_total", "rampart_cascade_confidence_bucket"} <= queried
    missing = missing_metrics(SimpleNamespace(url=str(client.base_url).rstrip("/")), queried)
    assert not missing, f"the dashboard queries cascade metrics that /metrics lacks: {missing}"
