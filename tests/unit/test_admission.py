"""``rampart.overload.admission``: the throughput meter, the queue limit, the admission gate's order, sheds and
give-backs, and the service-time prediction; no server."""

from __future__ import annotations

import asyncio

import pytest

from rampart.overload.admission import AdmissionGate, ServiceTime, Shed, ThroughputMeter


def test_meter_divides_completions_by_busy_time_and_honours_override():
    now = [0.0]
    meter = ThroughputMeter(tau_s=5.0, clock=lambda: now[0])
    assert meter.ips is None
    meter.seed(10.0)  # warm-up: 10 ms per image
    assert meter.ips == pytest.approx(100.0)
    now[0] += 100.0  # idle time does not count
    assert meter.ips == pytest.approx(100.0)
    meter.busy(True)
    for _ in range(300):  # 30 s busy at 20 images/s
        now[0] += 0.1
        meter.completed(2)
    assert meter.ips == pytest.approx(20.0, rel=0.02)
    for _ in range(20):  # 2 s busy with nothing completing (timeouts): the estimate falls
        now[0] += 0.1
        meter.completed(0)
    assert meter.ips < 15.0
    assert ThroughputMeter(override_ips=200).ips == pytest.approx(200)


def test_queue_limit_is_throughput_times_delay_the_seed_rule():
    gate = AdmissionGate("m", max_batch_size=8, concurrent_batches=1, queue_delay_ms=200,
                         meter=ThroughputMeter(override_ips=200))
    assert gate.queue_limit == 40  # 200 img/s x 0.2 s
    assert gate.window == 16


async def _hold(gate: AdmissionGate, high: bool, budget_s: float, release: asyncio.Event, order: list) -> str:
    try:
        ticket = gate.reserve(high, budget_s)
        async with ticket.turn():
            order.append("high" if high else "normal")
            await release.wait()
        return "served"
    except Shed as shed:
        return shed.reason


def test_gate_orders_high_first_sheds_when_full_and_evicts_normal_for_high():
    async def scenario():
        gate = AdmissionGate("m", max_batch_size=2, concurrent_batches=1, queue_delay_ms=1,
                             meter=ThroughputMeter())  # window 4, queue limit 2 (one batch)
        release, order = asyncio.Event(), []
        tasks = [asyncio.create_task(_hold(gate, False, 10, release, order)) for _ in range(7)]
        await asyncio.sleep(0.01)
        assert gate.dispatched == 4 and gate.queued == 2
        high = asyncio.create_task(_hold(gate, True, 10, release, order))
        await asyncio.sleep(0.01)
        release.set()
        results = await asyncio.gather(*tasks, high)
        return results, order

    results, order = asyncio.run(scenario())
    assert results[:5] == ["served"] * 5
    assert results[5] == "evicted"  # the newest queued normal request made room for the high one
    assert results[6] == "queue_full"  # 4 dispatched + 2 queued: full
    assert results[7] == "served"
    assert order[4] == "high"  # dispatched ahead of the normal request queued before it


def test_gate_sheds_when_predicted_completion_exceeds_the_budget():
    gate = AdmissionGate("m", max_batch_size=4, concurrent_batches=1, queue_delay_ms=1000,
                         meter=ThroughputMeter(override_ips=10))  # 100 ms per image
    gate.dispatched = 8
    with pytest.raises(Shed) as shed:
        gate.reserve(False, budget_s=0.5)
    assert shed.value.reason == "predicted_late" and gate.queued == 0
    assert gate.predicted_s("normal") == pytest.approx(1.2)  # 8 ahead + itself = 9, in whole batches of 4: 12 x 100 ms
    assert gate.completion_s(3) == pytest.approx(0.3)  # less than a batch in line: no rounding
    high = gate.reserve(True, budget_s=2.0)
    assert gate.queued == 1 and gate.predicted_s("high") == pytest.approx(1.2)
    high.cancel()
    assert gate.queued == 0


def test_gate_gives_back_cancelled_and_abandoned_tickets():
    async def scenario():
        gate = AdmissionGate("m", max_batch_size=1, concurrent_batches=1, queue_delay_ms=1, meter=ThroughputMeter())
        release, order = asyncio.Event(), []
        holders = [asyncio.create_task(_hold(gate, False, 10, release, order)) for _ in range(2)]
        waiter = asyncio.create_task(_hold(gate, False, 10, release, order))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.sleep(0.01)
        gate.reserve(False, 10).cancel()  # a bad upload gives its place back
        release.set()
        await asyncio.gather(*holders)
        return gate

    gate = asyncio.run(scenario())
    assert gate.dispatched == 0 and gate.queued == 0 and gate.queued_high == 0


def test_service_time_separates_the_runners_compute_from_the_fixed_travel_time():
    service = ServiceTime()
    assert not service.ready and service.completion_s(5) == 0.0
    for in_line in (1, 3, 6, 2, 8) * 20:  # a runner at 50 ms an image, 120 ms of travel whatever the line
        service.observe(latency_s=0.12 + in_line * 0.05, images_in_line=in_line, inference_ms=100.0, batch_size=2)
    assert service.compute_s == pytest.approx(0.05)
    assert service.overhead_s == pytest.approx(0.12, abs=0.005)
    assert service.completion_s(4) == pytest.approx(0.32, abs=0.005)
    # Each of two API workers owns half of the runner, so its own images in line take twice the time.
    half = ServiceTime(share=0.5)
    half.observe(latency_s=0.3, images_in_line=2, inference_ms=50.0, batch_size=1)
    assert half.compute_s == pytest.approx(0.1) and half.overhead_s == pytest.approx(0.1)
    # Two batches computing at once on one device: an image costs half its batch's time.
    assert ServiceTime(concurrent_batches=2).completion_s(1) == 0.0
    both = ServiceTime(concurrent_batches=2)
    both.observe(latency_s=0.05, images_in_line=1, inference_ms=40.0, batch_size=1)
    assert both.compute_s == pytest.approx(0.02)
    with pytest.raises(ValueError):
        ServiceTime(share=0)


def test_gate_predicts_from_the_runners_compute_not_the_meter_once_answers_came():
    """The busy-time meter counts travel time as if it were the model's: under overload it fell from 19 to 7 img/s
    while the model idled, and the gate then refused what the model could have answered (ServiceTime's doc)."""
    now = [0.0]
    meter = ThroughputMeter(tau_s=5.0, clock=lambda: now[0])
    meter.seed(50.0)
    gate = AdmissionGate("m", max_batch_size=16, concurrent_batches=1, queue_delay_ms=200, meter=meter,
                         prediction="service")
    meter.busy(True)
    for _ in range(100):  # 4 images dispatched, each answered 400 ms later: 10 img/s on the meter
        now[0] += 0.1
        meter.completed(1)
        gate.observe(latency_s=0.4, images_in_line=4, inference_ms=50.0, batch_size=1)
    assert meter.ms_per_image == pytest.approx(100.0, rel=0.05)
    assert gate.compute_s_per_image == pytest.approx(0.05)
    gate.dispatched = 7  # 7 ahead + itself: 0.2 s of travel + 8 x 50 ms, within a 0.7 s budget
    assert gate.predicted_s("normal") == pytest.approx(0.6, abs=0.01)
    gate.reserve("normal", budget_s=0.7).cancel()
    # The default prediction is the meter's, fed or not; a throughput fixed by configuration is what the operator
    # asked for: the meter predicts then too.
    default = AdmissionGate("d", max_batch_size=16, concurrent_batches=1, queue_delay_ms=200,
                            meter=ThroughputMeter(override_ips=0))
    default.meter.seed(100.0)
    default.observe(latency_s=0.4, images_in_line=4, inference_ms=50.0, batch_size=1)
    assert default.service.ready and default.completion_s(3) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        AdmissionGate("x", max_batch_size=16, concurrent_batches=1, queue_delay_ms=200, meter=meter, prediction="guess")
    fixed = AdmissionGate("f", max_batch_size=16, concurrent_batches=1, queue_delay_ms=200,
                          meter=ThroughputMeter(override_ips=10), prediction="service")
    fixed.observe(latency_s=0.4, images_in_line=4, inference_ms=50.0, batch_size=1)
    assert fixed.completion_s(3) == pytest.approx(0.3) and fixed.compute_s_per_image == pytest.approx(0.1)
