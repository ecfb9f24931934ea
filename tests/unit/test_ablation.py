"""``bench.ablation`` and the switches its arms a-c set (``rampart.config``, read by ``rampart.overload.admission`` and
the pipeline; docs/benchmarks.md, "Ablation"): each changes what it claims, no server.

- ``RAMPART_ROUTING=primary-only``: the fallback is never asked; the primary has the whole deadline.
- ``RAMPART_ADMISSION``: ``off`` never sheds (arm a), ``queue-bound`` sheds only on the queue
  bound (arm b), ``full`` (the default) also on predicted lateness, at arrival and at the turn.
- ``RAMPART_HONOUR_DEADLINES=false`` (arms a, b): the server works for ``max_deadline_ms``
  whatever the client asked, so runners get no deadline to TTL-drop by; honoured (arm c on),
  the runner gets the client's deadline and the pipeline stops at it.

HTTP through Starlette's ``TestClient`` with the stand-in models (``make_rig`` of
tests/unit/conftest.py); the gate's own modes on an ``AdmissionGate``.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pydantic
import pytest

from bench.ablation import ARMS, outcome_summary
from bench.loadgen import Sample
from rampart.config import ExperimentSettings, Settings
from rampart.overload.admission import AdmissionGate, Shed, ThroughputMeter
from rampart.overload.deadline import Share
from tests.unit.standins import CAT, fill


def gate(mode: str) -> AdmissionGate:
    """A gate of 2-image batches (window 4) whose model does 10 images/s: queue limit 2, 100 ms per image."""
    return AdmissionGate("m", max_batch_size=2, concurrent_batches=1, queue_delay_ms=200,
                         meter=ThroughputMeter(override_ips=10.0), mode=mode)


@pytest.mark.parametrize("mode, sheds_late, sheds_full", [("full", True, True), ("queue-bound", False, True),
                                                          ("off", False, False)])
def test_each_admission_mode_sheds_only_what_it_claims(mode, sheds_late, sheds_full):
    g = gate(mode)
    g.reserve(False, 60.0)  # one ahead: the next is predicted 200 ms
    late = g.refusal(False, 0.1)
    assert (late is not None and late.reason == "predicted_late") == sheds_late
    for _ in range(g.window + g.queue_limit - 1):
        g.reserve(False, 60.0)
    full = g.refusal(False, 60.0)
    assert (full is not None and full.reason == "queue_full") == sheds_full
    if not sheds_full:  # an unbounded queue takes any number and evicts nobody
        tickets = [g.reserve(True, 60.0) for _ in range(50)]
        assert g.queued == g.window + g.queue_limit + 50 and not any(t.evicted for t in tickets)


@pytest.mark.parametrize("mode, sheds", [("full", True), ("queue-bound", False), ("off", False)])
def test_only_full_admission_sheds_a_request_predicted_late_at_its_turn(mode, sheds):
    async def scenario() -> str:
        g = gate(mode)
        first, second = g.reserve(False, 60.0), g.reserve(False, 60.0)
        async with first.turn():
            try:
                async with second.turn(lambda: 0.05):  # 2 dispatched x 100 ms > 50 ms left
                    return "dispatched"
            except Shed as shed:
                return shed.reason

    assert asyncio.run(scenario()) == ("predicted_late" if sheds else "dispatched")


def test_admission_off_never_sheds_and_has_no_inflight_bound(make_rig):
    rig = make_rig(**ARM_A)
    tickets = fill(rig.pipeline.primary.gate) + fill(rig.pipeline.primary.gate)  # twice what "full" allows
    response = rig.client.post("/classify", content=CAT)
    for ticket in tickets:
        ticket.cancel()
    assert response.status_code == 200 and response.json()["route"] == "primary_only"
    assert rig.pipeline.inflight_limit() == sys.maxsize and rig.pipeline.pool.capacity >= sys.maxsize


def test_a_bounded_queue_sheds_when_full_but_not_on_prediction(make_rig):
    # The primary fixed at 0.01 images/s: one request queued ahead predicts 200 s, past any deadline.
    rig = make_rig(**ARM_B, primary_throughput_ips=0.01)
    ahead = rig.pipeline.primary.gate.reserve(False, 60.0)
    predicted_late = rig.client.post("/classify", content=CAT)
    ahead.cancel()
    tickets = fill(rig.pipeline.primary.gate)
    full = rig.client.post("/classify", content=CAT)
    for ticket in tickets:
        ticket.cancel()
    assert predicted_late.status_code == 200 and predicted_late.json()["model"]["name"] == "rampart-primary"
    assert full.status_code == 429 and full.json()["error"]["code"] == "overloaded"
    assert rig.fallback.calls == 0


def test_full_admission_sheds_on_prediction_and_primary_only_answers_429(make_rig):
    rig = make_rig(experiments=True, routing="primary-only", primary_throughput_ips=0.01)
    ahead = rig.pipeline.primary.gate.reserve(False, 60.0)
    response = rig.client.post("/classify", content=CAT)
    ahead.cancel()
    assert response.status_code == 429 and rig.primary.calls == 0 and rig.fallback.calls == 0


@pytest.mark.parametrize("honour", [True, False])
def test_deadlines_reach_the_runner_and_stop_the_pipeline_only_when_honoured(make_rig, honour):
    rig = make_rig(experiments=True, routing="primary-only", honour_deadlines=honour)
    rig.primary.delay_s = 0.6  # slower than the 300 ms deadline
    sent = time.time()
    body = rig.client.post("/classify", content=CAT, headers={"X-Deadline-Ms": "300"}).json()
    runner_deadline_s = rig.primary.deadlines[0] - sent  # what the runner's TTL drop compares with
    if honour:  # the runner may drop the item after 300 ms; the pipeline answers without labels by then
        assert runner_deadline_s < 0.3 and body["degraded_reason"] == "no_model_available" and body["labels"] == []
    else:  # max_deadline_ms (60 s): nothing is dropped, the slow answer comes late, with labels
        assert runner_deadline_s > 50 and body["degraded"] is False and body["model"]["name"] == "rampart-primary"
    assert rig.fallback.calls == 0


def test_primary_only_never_asks_the_fallback_and_gives_the_primary_the_whole_deadline(make_rig):
    rig = make_rig(experiments=True, routing="primary-only", cache_size=0)  # no cached answer for the failing call
    assert rig.pipeline.primary.share is Share.ALL and make_rig().pipeline.primary.share is Share.PRIMARY
    answered = rig.client.post("/classify", content=CAT).json()
    rig.primary.mode = "error"
    failed = rig.client.post("/classify", content=CAT).json()
    assert answered["route"] == "primary_only" and answered["model"]["name"] == "rampart-primary"
    assert failed["degraded_reason"] == "no_model_available" and failed["route"] is None
    tickets = fill(rig.pipeline.primary.gate)
    shed = rig.client.post("/classify", content=CAT)
    for ticket in tickets:
        ticket.cancel()
    assert shed.status_code == 429 and rig.fallback.calls == 0


def test_the_switches_are_settings_with_checked_values():
    settings = Settings.from_env({"RAMPART_EXPERIMENTS": "true", "RAMPART_ADMISSION": "queue-bound",
                                  "RAMPART_HONOUR_DEADLINES": "false", "RAMPART_ROUTING": "primary-only"})
    assert (settings.admission_mode, settings.honour_deadlines, settings.routing.mode) == ("queue-bound", False,
                                                                                          "primary-only")
    assert settings.experiments == ExperimentSettings(enabled=True, admission="queue-bound", honour_deadlines=False)
    assert Settings().admission_mode == "full" and Settings().honour_deadlines is True
    with pytest.raises(pydantic.ValidationError):
        Settings(experiments=True, admission="none")


@pytest.mark.parametrize("variable, value", [("RAMPART_ADMISSION", "queue-bound"), ("RAMPART_ADMISSION", "off"),
                                             ("RAMPART_HONOUR_DEADLINES", "false"), ("RAMPART_ROUTING", "primary-only")])
def test_an_experiment_switch_without_the_flag_refuses_to_start_naming_it(variable, value):
    with pytest.raises(pydantic.ValidationError, match="RAMPART_EXPERIMENTS=true") as refused:
        Settings.from_env({variable: value})
    assert f"{variable}={value}" in str(refused.value)
    with pytest.raises(pydantic.ValidationError, match="RAMPART_EXPERIMENTS=true"):
        Settings.from_env({variable: value, "RAMPART_EXPERIMENTS": "false"})


def test_production_values_of_the_switches_need_no_flag():
    settings = Settings.from_env({"RAMPART_ADMISSION": "full", "RAMPART_HONOUR_DEADLINES": "true",
                                  "RAMPART_ROUTING": "cascade"})
    assert (settings.admission_mode, settings.honour_deadlines, settings.routing.mode) == ("full", True, "cascade")


def test_every_arm_that_sets_a_switch_sets_the_flag():
    for arm in ARMS.values():
        if {"RAMPART_ADMISSION", "RAMPART_HONOUR_DEADLINES"} & set(arm.env) or arm.env.get("RAMPART_ROUTING") == "primary-only":
            assert arm.env["RAMPART_EXPERIMENTS"] == "true", arm.key
        Settings.from_env(arm.env)  # every arm starts


def test_outcome_summary_counts_availability_timeouts_and_sheds():
    def sample(latency_ms: float, status: int, model: str | None = "rampart-primary", reason: str | None = None):
        return Sample(0.0, latency_ms, status, model, reason, False, 1000.0)

    samples = [sample(100, 200), sample(900, 200, "rampart-fallback", "primary_overloaded"),  # available
               sample(1200, 200),  # late: a timeout
               sample(500, 200, None, "no_model_available"),  # in time, no labels
               sample(5, 429, None), sample(5000, 0, None),  # shed; no answer
               sample(20, 503, None), sample(30, 200)]
    summary = outcome_summary(samples, 1.0)
    assert summary["availability"] == 3 / 8 and summary["timeouts"] == 2 / 8
    assert summary["in_time"] == 5 / 8 and summary["static"] == 1 / 8 and summary["shed_429"] == 1
    assert summary["errors_5xx"] == 1 and summary["degraded_with_labels"] == 1 / 8
    assert summary["answered_by"] == {"rampart-fallback": 1, "rampart-primary": 3}


def _settings_of(key: str) -> dict:
    """The arm's environment as ``Settings`` keyword arguments."""
    return {name.removeprefix("RAMPART_").lower(): value for name, value in ARMS[key].env.items()}


ARM_A, ARM_B = _settings_of("a"), _settings_of("b")
