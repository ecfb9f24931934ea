"""Admission gate, throughput meter, circuit breaker, cache, decode pool, faults, OOM split: no server."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import torch

from rampart.overload.admission import AdmissionGate, ServiceTime, Shed, ThroughputMeter
from rampart.overload.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from rampart.cache import CachedAnswer, ResultCache, content_key
from rampart.errors import Overloaded
from rampart.faults import FaultInjector, FaultSpec, InjectedFault
from rampart.inputs.pool import BoundedPool, JobTimeout
from inference.engines import TorchClassifier


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


def test_breaker_opens_on_failure_rate_then_half_open_probes_close_it():
    now = [0.0]
    breaker = CircuitBreaker(window_s=10, min_calls=4, failure_rate=0.5, open_s=5, probes=2, clock=lambda: now[0])
    for ok in (True, False, True, False):
        assert breaker.allow()
        breaker.record(ok)
    assert breaker.state == OPEN and not breaker.allow()
    now[0] = 6.0
    assert breaker.state == HALF_OPEN
    assert breaker.allow() and breaker.allow() and not breaker.allow()  # two probes at a time
    breaker.record(True)
    breaker.record(True)
    assert breaker.state == CLOSED


def test_breaker_reopens_on_a_failed_probe_and_ignores_shed_calls():
    now = [0.0]
    breaker = CircuitBreaker(window_s=10, min_calls=2, failure_rate=0.5, open_s=1, probes=1, clock=lambda: now[0])
    for _ in range(10):
        assert breaker.allow()
        breaker.cancel()  # shed before reaching the model: not a failure
    assert breaker.state == CLOSED
    breaker.record(False)
    breaker.record(False)
    now[0] = 2.0
    assert breaker.allow()
    breaker.record(False)
    assert breaker.state == OPEN and breaker.times_opened == 2


def test_cache_is_lru_bounded_and_can_be_off():
    cache = ResultCache(2)
    keys = [content_key(bytes([i])) for i in range(3)]
    for key in keys:
        cache.put(key, CachedAnswer(np.array([3], np.int32), np.array([0.5], np.float32), "primary", "square"))
    assert len(cache) == 2 and cache.get(keys[0]) is None and cache.get(keys[2]) is not None
    off = ResultCache(0)
    off.put(keys[0], CachedAnswer(np.zeros(0, np.int32), np.zeros(0, np.float32), "fallback", "square"))
    assert off.get(keys[0]) is None


def test_pool_runs_high_priority_first_then_lower_rank_then_in_arrival_order():
    async def scenario():
        pool = BoundedPool(workers=1, queue=10)
        gate = threading.Event()
        order: list[str] = []
        blocker = asyncio.create_task(pool.run(gate.wait))
        await asyncio.sleep(0.05)
        jobs = [asyncio.create_task(pool.run(order.append, name, high=high, rank=rank))
                for name, high, rank in (("n1", False, 1), ("n0", False, 0), ("h1", True, 1), ("n1b", False, 1),
                                         ("h0", True, 0), ("n0b", False, 0))]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, *jobs)
        return order

    assert asyncio.run(scenario()) == ["h0", "h1", "n0", "n0b", "n1", "n1b"]


def test_pool_bounds_queue_start_wait_and_run_time():
    async def scenario():
        pool = BoundedPool(workers=1, queue=1)
        gate = threading.Event()
        with pytest.raises(JobTimeout) as slow:  # started, then ran past its own limit
            await pool.run(time.sleep, 0.3, budget_s=5, run_limit_s=0.05)
        assert slow.value.by_run_limit
        with pytest.raises(JobTimeout) as late:  # started, then the caller's budget ran out
            await pool.run(time.sleep, 0.6, budget_s=0.3, run_limit_s=5)
        assert not late.value.by_run_limit
        blocker = asyncio.create_task(pool.run(time.sleep, 0.3))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):  # never started within its budget: cancelled, 429
            await pool.run(time.sleep, 0, budget_s=0.05)
        await blocker
        gate.clear()
        hold = asyncio.create_task(pool.run(gate.wait))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(pool.run(time.sleep, 0))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):  # one running + one waiting = full
            await pool.run(time.sleep, 0)
        gate.set()
        await asyncio.gather(hold, queued)
        return pool.pending

    assert asyncio.run(scenario()) == 0


def test_fault_file_overrides_settings_and_ends_a_hang(tmp_path):
    path = tmp_path / "faults.json"
    injector = FaultInjector("primary", FaultSpec(), str(path))
    injector.before_batch()  # no file yet: the (empty) settings apply
    path.write_text(json.dumps({"fault_primary_error_rate": 1.0}))
    with pytest.raises(InjectedFault):
        injector.before_batch()
    path.write_text(json.dumps({"fault_primary_hang": True}))
    threading.Timer(0.3, lambda: path.write_text("{}")).start()
    start = time.monotonic()
    injector.before_batch()  # returns once the file stops asking for a hang
    assert time.monotonic() - start >= 0.25
    path.write_text("not json")
    injector.before_batch()  # an unreadable file falls back to the settings


class _OomAbove(torch.nn.Module):
    """A stand-in network that raises CUDA's OOM error for batches larger than ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.linear = torch.nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.linear(x.mean(dim=(2, 3)))


def test_oom_splits_the_batch_once_then_gives_up():
    batch = np.random.default_rng(0).integers(0, 255, (4, 8, 8, 3), dtype=np.uint8)
    reference = TorchClassifier(_OomAbove(limit=100), 127.0, 128.0, device="cpu")
    engine = TorchClassifier(_OomAbove(limit=2), 127.0, 128.0, device="cpu")
    engine.module.load_state_dict(reference.module.state_dict())
    out = engine.predict(batch)
    assert engine.oom_splits == 1
    np.testing.assert_allclose(out, reference.predict(batch), rtol=1e-5, atol=1e-6)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        TorchClassifier(_OomAbove(limit=1), 127.0, 128.0, device="cpu").predict(batch)  # halves of 2 still fail


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
