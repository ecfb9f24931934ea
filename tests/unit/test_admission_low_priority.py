"""``rampart.overload.admission`` and ``rampart.pipeline`` for the low priority class (``X-Priority: low``, and OIP's
priority 3): the admission gate and the pipeline, no server."""

from __future__ import annotations

import asyncio

import pytest

from rampart import errors
from rampart.config import Settings
from rampart.overload.admission import AdmissionGate, Shed, ThroughputMeter
from rampart.overload.deadline import Deadline
from rampart.pipeline import Pipeline
from tests.support import encode, photo
from tests.unit.standins import StandIn, stand_in_pipeline


def gate(queue_delay_ms: float = 1, low_arrival: str = "queue") -> AdmissionGate:
    """Window 4 (two batches of 2), batch share 2, queue limit one batch (2) at 10 images/s."""
    return AdmissionGate("m", max_batch_size=2, concurrent_batches=1, queue_delay_ms=queue_delay_ms,
                         meter=ThroughputMeter(override_ips=10), low_arrival=low_arrival)


async def _hold(gate: AdmissionGate, priority: str, release: asyncio.Event, order: list, budget_s: float = 60) -> str:
    try:
        ticket = gate.reserve(priority, budget_s)
        async with ticket.turn():
            order.append(priority)
            await release.wait()
        return "served"
    except Shed as shed:
        return shed.reason


def test_low_is_dispatched_after_normal_and_high_queued_after_it():
    async def scenario():
        g, release, order = gate(queue_delay_ms=1000), asyncio.Event(), []  # queue limit 10
        normal = [asyncio.create_task(_hold(g, "normal", release, order)) for _ in range(4)]  # fill the window
        await asyncio.sleep(0.01)
        low = asyncio.create_task(_hold(g, "low", release, order))  # admitted: nothing of a higher class queued
        await asyncio.sleep(0.01)
        later = [asyncio.create_task(_hold(g, p, release, order)) for p in ("normal", "high")]
        await asyncio.sleep(0.01)
        release.set()
        return await asyncio.gather(*normal, low, *later), order

    results, order = asyncio.run(scenario())
    assert results == ["served"] * 7
    assert order[4:] == ["high", "normal", "low"]  # the low request queued first still went last


def test_with_low_arrival_idle_only_low_is_refused_while_a_higher_class_waits_and_never_counts_in_their_prediction():
    g = gate(queue_delay_ms=1000, low_arrival="idle-only")
    g.dispatched = 4
    normal = g.reserve("normal", 60)
    with pytest.raises(Shed) as shed:
        g.reserve("low", 60)
    assert shed.value.reason == "higher_priority_waiting"
    normal.cancel()
    lows = [g.reserve("low", 60) for _ in range(3)]  # the queue is free of higher classes: low may wait
    assert g.queued_by_priority() == {"high": 0, "normal": 0, "low": 3}
    # A normal arrival counts 4 dispatched + itself, not the three low ones queued: 5 -> 6 (whole batches) x 100 ms.
    assert g.predicted_s("normal") == pytest.approx(0.6)
    assert g.predicted_s("low") == pytest.approx(0.8)  # 4 + 3 + 1 = 8 images
    for ticket in lows:
        ticket.cancel()


def test_a_low_request_waits_behind_a_queued_normal_one_instead_of_being_refused():
    async def scenario():
        g = gate(queue_delay_ms=1000)  # queue limit 10; low_arrival "queue", the default
        release, order = asyncio.Event(), []
        held = [asyncio.create_task(_hold(g, "normal", release, order)) for _ in range(4)]  # fill the window
        await asyncio.sleep(0.01)
        normal = asyncio.create_task(_hold(g, "normal", release, order))  # queued
        await asyncio.sleep(0.01)
        assert g.refusal("low", 60) is None  # "idle-only" would refuse it: higher_priority_waiting
        low = asyncio.create_task(_hold(g, "low", release, order))
        await asyncio.sleep(0.01)
        queued = g.queued_by_priority()
        later = asyncio.create_task(_hold(g, "normal", release, order))  # arrives after the low one
        await asyncio.sleep(0.01)
        release.set()
        return await asyncio.gather(*held, normal, low, later), order, queued

    results, order, queued = asyncio.run(scenario())
    assert queued == {"high": 0, "normal": 1, "low": 1}
    assert results == ["served"] * 7
    assert order[4:] == ["normal", "normal", "low"]  # queued behind both normal requests, the later one too


def test_a_queued_low_request_is_still_the_first_a_full_gate_evicts():
    g = gate()  # window 4 + queue limit 2; low_arrival "queue", the default
    g.dispatched = 4
    normal = g.reserve("normal", 60)
    low = g.reserve("low", 60)  # a place behind the queued normal request: the gate is now full
    with pytest.raises(Shed) as shed:
        g.reserve("low", 60)
    assert shed.value.reason == "queue_full"  # a low arrival never evicts
    g.reserve("normal", 60)  # a normal arrival takes the low one's place
    assert low.evicted and not normal.evicted
    with pytest.raises(ValueError):
        AdmissionGate("m", 2, 1, 1, ThroughputMeter(override_ips=10), low_arrival="always")


def test_a_full_gate_evicts_the_newest_low_first_then_normal_for_high():
    g = gate(low_arrival="idle-only")  # window 4 + queue limit 2
    g.dispatched = 4
    old_low, new_low = g.reserve("low", 60), g.reserve("low", 60)
    normal = g.reserve("normal", 60)  # the gate was full: the newest low gave its place
    assert new_low.evicted and not old_low.evicted and g.queued == 2
    with pytest.raises(Shed) as shed:
        g.reserve("low", 60)
    assert shed.value.reason == "higher_priority_waiting"  # low never displaces anything
    g.reserve("high", 60)  # full again: the remaining low goes before any normal
    assert old_low.evicted and not normal.evicted
    g.reserve("high", 60)  # no low left: the newest normal is evicted, as before the low class
    assert normal.evicted
    with pytest.raises(Shed) as shed:
        g.reserve("normal", 60)  # nothing below normal queued: a full gate refuses it
    assert shed.value.reason == "queue_full"


def test_low_is_dispatched_a_quarter_batch_at_a_time_so_normal_is_dispatched_at_once():
    async def scenario():
        g = AdmissionGate("m", max_batch_size=16, concurrent_batches=1, queue_delay_ms=1000,
                          meter=ThroughputMeter(override_ips=10))  # window 32, low window 1
        release, order = asyncio.Event(), []
        lows = [asyncio.create_task(_hold(g, "low", release, order)) for _ in range(4)]
        await asyncio.sleep(0.01)
        dispatched_low = g.dispatched
        normal = asyncio.create_task(_hold(g, "normal", release, order))
        await asyncio.sleep(0.01)
        dispatched_with_normal = order.count("normal")
        release.set()
        await asyncio.gather(*lows, normal)
        return dispatched_low, dispatched_with_normal, g

    dispatched_low, dispatched_with_normal, g = asyncio.run(scenario())
    assert g.low_window == 1 and dispatched_low == 1  # three low ones wait although 31 places are free
    assert dispatched_with_normal == 1  # the normal request did not wait behind the three queued low ones
    assert gate().low_window == 1  # at least one image, however small the batch
    assert g.dispatched == 0 and g.queued == 0


def make_pipeline(primary: StandIn, fallback: StandIn, **settings) -> Pipeline:
    return stand_in_pipeline(Settings(**settings), primary, fallback)


@pytest.mark.parametrize("routing", ["primary-first", "cascade"])
def test_a_low_request_is_answered_by_the_primary_only(routing):
    primary, fallback = StandIn(1), StandIn(2)
    body = asyncio.run(make_pipeline(primary, fallback, routing=routing).classify(
        encode(photo("rocket"), "JPEG"), 5, Deadline(10_000), "low"))
    assert body["route"] == "low_priority" and body["model"]["name"] == "primary" and not body["degraded"]
    assert primary.calls == 1 and fallback.calls == 0


def test_a_low_request_the_primary_cannot_answer_is_429_never_the_fallback_then_a_cached_answer_is_returned():
    primary, fallback = StandIn(1), StandIn(2)
    pipeline = make_pipeline(primary, fallback)
    data = encode(photo("rocket"), "JPEG")
    primary.mode = "error"
    with pytest.raises(errors.Overloaded) as error:
        asyncio.run(pipeline.classify(data, 5, Deadline(10_000), "low"))
    assert error.value.status == 429 and error.value.retry_after_s >= 1 and fallback.calls == 0
    primary.mode = "ok"
    asyncio.run(pipeline.classify(data, 5, Deadline(10_000), "normal"))  # an answer for these bytes is cached
    primary.mode = "error"
    cached = asyncio.run(pipeline.classify(data, 5, Deadline(10_000), "low"))
    assert cached["degraded_reason"] == "cached_result" and fallback.calls == 0
    assert pipeline.state()["priority"]["low"] == {"primary": 0, "fallback": 0, "cache": 1, "none": 0, "shed": 1}
    assert pipeline.state()["priority"]["normal"]["primary"] == 1


def test_a_low_request_never_gets_an_answer_the_fallback_made_not_even_from_the_cache():
    primary, fallback = StandIn(1), StandIn(2)
    pipeline = make_pipeline(primary, fallback)
    data = encode(photo("chelsea"), "JPEG")
    primary.mode = "error"
    degraded = asyncio.run(pipeline.classify(data, 5, Deadline(10_000), "normal"))  # the fallback's answer is cached
    assert degraded["model"]["name"] == "fallback" and fallback.calls == 1
    with pytest.raises(errors.Overloaded):
        asyncio.run(pipeline.classify(data, 5, Deadline(10_000), "low"))
    assert fallback.calls == 1 and pipeline.state()["priority"]["low"]["cache"] == 0


def test_a_low_request_has_no_room_when_only_the_fallback_has():
    pipeline = make_pipeline(StandIn(1), StandIn(2))
    pipeline.primary.gate.dispatched = pipeline.primary.gate.window + pipeline.primary.gate.queue_limit  # full
    pipeline.check_capacity(Deadline(10_000), "normal")  # the fallback would take a normal request
    with pytest.raises(errors.Overloaded) as error:
        pipeline.check_capacity(Deadline(10_000), "low")
    assert "low-priority" in str(error.value)
    assert error.value.retry_after_s == pipeline.primary.gate.retry_after_s()  # the primary's own drain time


def test_open_inference_protocol_priority_3_is_low_and_4_is_refused():
    from rampart.api import oip

    assert [oip._priority(level) for level in (0, 1, 2, 3)] == ["normal", "high", "normal", "low"]
    with pytest.raises(errors.InvalidParameter):
        oip._priority(4)
    assert oip.model_config(Settings(), "v1")["dynamic_batching"]["priority_levels"] == 3


def test_a_low_request_spends_its_whole_deadline_on_the_primary_keeping_no_fallback_reserve():
    """A low request never takes the fallback, so the fallback's reserve is not kept from it: with a 200 ms
    deadline (under the 250 ms reserve) on an idle server it is answered by the primary, not refused as if the
    primary had no room; a normal request with the same deadline still keeps the reserve (the fallback answers)."""
    settings = Settings()
    reserve_ms = settings.deadlines.fallback_reserve_ms
    primary, fallback = StandIn(1), StandIn(2)
    pipeline = make_pipeline(primary, fallback)
    data = encode(photo("rocket"), "JPEG")

    def deadline(ms: float) -> Deadline:
        return Deadline(ms, margin_ms=settings.deadlines.answer_margin_ms, fallback_reserve_ms=reserve_ms)

    assert 200 < reserve_ms
    low = asyncio.run(pipeline.classify(data, 5, deadline(200), "low"))
    assert low["model"]["name"] == "primary" and low["route"] == "low_priority" and fallback.calls == 0
    assert pipeline.primary.share_of("low").value == "all" and pipeline.primary.share_of("normal").value == "primary"
    normal = asyncio.run(pipeline.classify(data, 5, deadline(200), "normal"))
    assert normal["model"]["name"] == "fallback" and primary.calls == 1


def test_a_low_request_whose_deadline_runs_out_at_the_primary_is_told_so_not_that_the_server_is_full():
    """An idle primary slower than a low request's deadline: 429 with ``cause`` ``deadline`` and a message that says
    a longer deadline may be answered (a retry with the same deadline never can), not "no idle capacity"."""
    primary, fallback = StandIn(1), StandIn(2)
    primary.delay_s = 0.3
    pipeline = make_pipeline(primary, fallback)
    with pytest.raises(errors.Overloaded) as error:
        asyncio.run(pipeline.classify(encode(photo("rocket"), "JPEG"), 5, Deadline(100), "low"))
    assert error.value.cause == "deadline" and "longer X-Deadline-Ms" in str(error.value), error.value
    assert fallback.calls == 0
    primary.mode = "error"
    with pytest.raises(errors.Overloaded) as error:
        asyncio.run(pipeline.classify(encode(photo("coffee"), "JPEG"), 5, Deadline(10_000), "low"))
    assert error.value.cause == "capacity"  # a failing primary is not the deadline's fault
