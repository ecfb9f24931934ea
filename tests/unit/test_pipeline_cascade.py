"""``rampart.pipeline``'s cascade routing (``RAMPART_ROUTING=cascade``) of ``Pipeline`` with stand-in models, no
server.

The stand-in fallback answers with a chosen top-1 probability, so each side of the
threshold is reached on purpose; faults of the primary (error, hang, full gate, open
breaker) and of the fallback are injected as in tests/unit/test_app.py (``tests.unit.standins``).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from rampart.api.app import create_app, route_error_answered
from rampart.api.lifecycle import Lifecycle
from rampart.api.routing import JSONRouteErrors
from rampart.config import Settings
from rampart.overload.deadline import Deadline
from tests.unit.standins import CAT, StandIn, fill, served_pipeline

PRIMARY_CLASS, FALLBACK_CLASS = 281, 285


class Cascade:
    """A cascade pipeline on a thread decode pool with a stand-in primary and fallback."""

    def __init__(self, fallback_score: float = 0.9, runner_up: float = 0.0, **settings) -> None:
        self.settings = Settings(decode_mode="threads", decode_workers=2, **{"routing": "cascade", **settings})
        self.primary = StandIn(PRIMARY_CLASS)
        self.fallback = StandIn(FALLBACK_CLASS, fallback_score, runner_up)
        self.pipeline = served_pipeline(self.settings, self.primary, self.fallback)

    def classify(self, deadline_ms: float = 5_000) -> dict:
        return asyncio.run(self.pipeline.classify(CAT, 3, Deadline(deadline_ms, fallback_reserve_ms=250)))


def routes_total(route: str) -> float:
    return REGISTRY.get_sample_value("rampart_cascade_routes_total", {"route": route}) or 0.0


def test_a_confident_fallback_answers_alone_and_says_so():
    rig = Cascade(fallback_score=0.9)
    body = rig.classify()
    assert body["model"]["name"] == "rampart-fallback" and body["labels"][0]["index"] == FALLBACK_CLASS
    assert body["route"] == "cascade_confident" and body["degraded"] is False and body["degraded_reason"] is None
    assert rig.primary.calls == 0 and rig.fallback.calls == 1


def test_an_unsure_fallback_escalates_to_the_primary():
    rig = Cascade(fallback_score=0.3)
    body = rig.classify()
    assert body["model"]["name"] == "rampart-primary" and body["labels"][0]["index"] == PRIMARY_CLASS
    assert body["route"] == "cascade_escalated" and body["degraded"] is False
    assert rig.primary.calls == 1 and rig.fallback.calls == 1


def test_the_threshold_is_inclusive_and_the_confidence_kind_counts():
    # msp 0.5, margin 0.5 - 0.25 = 0.25 (both exact in float32): confident by msp at 0.5, unsure by margin.
    assert Cascade(0.5, 0.25, cascade_threshold=0.5).classify()["route"] == "cascade_confident"
    assert Cascade(0.5, 0.25, cascade_confidence="margin").classify()["route"] == "cascade_escalated"


@pytest.mark.parametrize("fault, reason", [("error", "primary_error"), ("hang", "primary_timeout"),
                                           ("full_gate", "primary_overloaded"),
                                           ("open_breaker", "primary_circuit_open")])
def test_when_the_primary_cannot_answer_the_unsure_fallback_answer_is_degraded(fault, reason):
    rig = Cascade(fallback_score=0.3, breaker_min_calls=2)
    if fault == "full_gate":
        fill(rig.pipeline.primary.gate)
    elif fault == "open_breaker":
        rig.primary.mode = "error"
        assert [rig.classify()["degraded_reason"] for _ in range(2)] == ["primary_error"] * 2
    else:
        rig.primary.mode = fault
    calls_before = rig.primary.calls
    body = rig.classify(deadline_ms=600)
    assert body["model"]["name"] == "rampart-fallback" and body["labels"][0]["index"] == FALLBACK_CLASS
    assert body["degraded"] is True and body["degraded_reason"] == reason and body["route"] == "cascade_not_escalated"
    assert body["timings_ms"]["total"] < 600
    assert rig.primary.calls == calls_before + (fault in ("error", "hang"))


@pytest.mark.parametrize("fault", ["error", "full_gate"])
def test_when_the_fallback_cannot_answer_the_primary_is_the_first_choice(fault):
    rig = Cascade()
    if fault == "full_gate":
        fill(rig.pipeline.fallback.gate)
    else:
        rig.fallback.mode = fault
    body = rig.classify()
    assert body["model"]["name"] == "rampart-primary" and body["route"] == "cascade_fallback_unavailable"
    assert body["degraded"] is False and rig.primary.calls == 1


def test_neither_model_answering_is_the_static_answer_without_route():
    rig = Cascade()
    rig.primary.mode = rig.fallback.mode = "error"
    body = rig.classify()
    assert body["degraded_reason"] == "no_model_available" and body["route"] is None and body["model"] is None


def test_stats_and_metrics_count_routes_escalations_and_confidences():
    before = {route: routes_total(route) for route in ("cascade_confident", "cascade_escalated",
                                                       "cascade_not_escalated")}
    rig = Cascade(fallback_score=0.9)
    rig.classify()  # confident
    rig.fallback.score = 0.3
    rig.classify()  # escalated
    rig.primary.mode = "error"
    rig.classify()  # not escalated
    state = rig.pipeline.state()["cascade"]
    assert state["routing"] == "cascade" and state["confidence"] == "msp" and state["threshold"] == 0.42
    assert state["routes"] == {"cascade_confident": 1, "cascade_escalated": 1, "cascade_not_escalated": 1,
                               "cascade_fallback_unavailable": 0}
    assert state["escalation_rate"] == round(2 / 3, 4) and state["escalated_rate"] == 0.5
    expected = {f"p{q}": np.quantile([0.9, 0.3, 0.3], q / 100) for q in (10, 50, 90)}  # the fallback's msp
    assert state["confidence_quantiles"] == pytest.approx(expected, abs=1e-4)
    assert {route: routes_total(route) - count for route, count in before.items()} == dict.fromkeys(before, 1.0)


def test_primary_first_is_unchanged_and_says_its_route_over_http():
    settings = Settings(decode_mode="threads", decode_workers=2)
    primary = StandIn(PRIMARY_CLASS)
    fallback = StandIn(FALLBACK_CLASS)
    pipeline = served_pipeline(settings, primary, fallback)
    lifecycle = Lifecycle()
    lifecycle.mark_ready()
    app = create_app(settings, pipeline=pipeline, lifecycle=lifecycle)
    with TestClient(JSONRouteErrors(app, answered=route_error_answered)) as client:
        body = client.post("/classify", content=CAT).json()
        assert body["model"]["name"] == "rampart-primary" and body["route"] == "primary_first"
        assert body["degraded"] is False and primary.calls == 1 and fallback.calls == 0
        primary.mode = "error"
        degraded = client.post("/classify", content=CAT).json()
        assert degraded["route"] == "primary_first" and degraded["degraded_reason"] == "primary_error"
        assert client.get("/stats").json()["cascade"] == {"routing": "primary-first"}
