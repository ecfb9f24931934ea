"""``rampart.overload`` (admission's meter, the breaker through ``rampart.lane``) and ``rampart.api.arrival``: no
after-effects of overload, without a server: meter and Retry-After after idle (fake clock), the breaker telling
busy from hung, arrival times and the in-flight bound. BentoML's learned batching wait
(``rampart.compat.bentoml_batching``) is tested in ``tests/unit/test_compat.py``."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from rampart.overload.admission import AdmissionGate, ThroughputMeter
from rampart import errors
from rampart.api.arrival import (ARRIVAL_KEY, FUTURE_SKEW_MS, HEAD_END_KEY, InflightBound, arrival_of,
                                parse_request_start)
from rampart.config import Settings
from rampart.overload.breaker import CLOSED, OPEN, CircuitBreaker
from rampart.inputs.buckets import buckets_for_resolution
from rampart.overload.deadline import Deadline, Share
from rampart.lane import ModelEndpoint, ModelLane, RunnerResult
from tests.unit.standins import StandIn, stand_in_pipeline


def busy_meter(now: list[float], ips: float, seconds: float, tau_s: float = 5.0) -> ThroughputMeter:
    """A meter seeded at 100 images/s that then measured ``ips`` for ``seconds`` of busy time."""
    meter = ThroughputMeter(tau_s=tau_s, clock=lambda: now[0])
    meter.seed(10.0)
    meter.busy(True)
    for _ in range(int(seconds * 10)):
        now[0] += 0.1
        meter.completed(round(ips / 10))
    meter.busy(False)
    return meter


def test_idle_time_changes_nothing_and_a_burst_after_it_is_judged_by_the_last_estimate():
    now = [0.0]
    meter = busy_meter(now, 40.0, 30.0)
    earned = meter.ips
    assert earned == pytest.approx(40.0, rel=0.02)
    now[0] += 3600.0  # an hour idle, 720 time constants
    assert meter.ips == pytest.approx(earned)
    meter.busy(True)  # a burst starts; its first batch takes 0.3 s to come back
    now[0] += 0.3
    assert meter.ips == pytest.approx(earned * math.exp(-0.3 / 5.0) / (math.exp(-0.3 / 5.0) + 0), rel=0.1)
    assert meter.ips > 0.9 * earned


def test_the_meter_never_falls_below_a_tenth_of_warm_up_speed():
    now = [0.0]
    meter = busy_meter(now, 40.0, 10.0)
    meter.busy(True)
    now[0] += 600.0  # ten minutes busy with nothing completing: a hung model
    assert meter.ips == pytest.approx(ThroughputMeter.FLOOR_FRACTION * 100.0)
    assert meter.floor_ips == pytest.approx(10.0)


def test_retry_after_after_idle_is_within_the_cap_and_the_drain_time():
    now = [0.0]
    gate = AdmissionGate("m", max_batch_size=16, concurrent_batches=1, queue_delay_ms=200,
                         meter=busy_meter(now, 40.0, 30.0))
    now[0] += 60.0  # idle for 12 time constants, then a burst fills the gate
    gate.meter.busy(True)
    now[0] += 0.5
    gate.dispatched, gate.queued = gate.window, gate.queue_limit
    drain_s = (gate.window + gate.queue_limit) / gate.meter.ips
    assert 1 <= gate.retry_after_s() <= max(1, math.ceil(drain_s)) <= gate.retry_after_cap_s
    # The cap: a full gate drained at the floor (10 images/s): 32 dispatched + 16 queued = 48 images = 5 s.
    assert gate.retry_after_cap_s == 5
    gate.meter.busy(True)
    now[0] += 3600.0  # hung for an hour: the estimate is at its floor, Retry-After at the cap
    assert gate.retry_after_s() == gate.retry_after_cap_s == 5
    unseeded = AdmissionGate("m", max_batch_size=16, concurrent_batches=1, queue_delay_ms=200, meter=ThroughputMeter())
    assert unseeded.retry_after_s() == unseeded.retry_after_cap_s == 1


def lane_with(call, min_calls: int = 4) -> ModelLane:
    endpoint = ModelEndpoint("m", "v1", ["a"], buckets_for_resolution(32), call)
    gate = AdmissionGate("m", max_batch_size=1, concurrent_batches=3, queue_delay_ms=10_000,
                         meter=ThroughputMeter(override_ips=1000))
    return ModelLane("primary", endpoint, gate, CircuitBreaker(window_s=60, min_calls=min_calls, failure_rate=0.5),
                     Share.PRIMARY)


async def attempts(lane: ModelLane, count: int, budget_ms: float) -> list[str | None]:
    bucket = lane.endpoint.buckets["square"]
    pixels = np.zeros(bucket.shape, dtype=np.uint8)

    async def one() -> str | None:
        deadline = Deadline(budget_ms)
        ticket = lane.reserve(False, deadline)
        attempt = await lane.attempt(ticket, (bucket, pixels), deadline)
        return attempt.reason

    return await asyncio.gather(*(one() for _ in range(count)))


def test_a_busy_model_whose_answers_come_late_never_opens_the_breaker():
    async def scenario():
        lock = asyncio.Lock()

        async def runner(deadline):  # one at a time, 100 ms each, like a runner: an item whose
            async with lock:  # deadline has passed is dropped (TTL), the rest computed
                if time.time() > deadline:
                    return RunnerResult(probs=None, inference_ms=0.0, batch_size=0)
                await asyncio.sleep(0.1)
            return RunnerResult(probs=np.ones(1, dtype=np.float32), inference_ms=100.0, batch_size=1)

        async def busy_call(bucket_name, pixels, deadline):  # the runner has the item even if the caller leaves
            return await asyncio.shield(asyncio.ensure_future(runner(deadline)))

        lane = lane_with(busy_call)
        reasons = []
        # Rounds of 4 at once with 140 ms each. From the second round on, nothing comes back in
        # time for anyone (the model is still on the previous round's work), but the model keeps
        # answering late and dropping expired items: busy, not broken. Counting only answers in
        # time as progress, as the breaker once did, opened the breaker here.
        for _ in range(3):
            reasons += await attempts(lane, 4, 140)
        await asyncio.sleep(0.5)
        return lane, reasons

    lane, reasons = asyncio.run(scenario())
    assert reasons.count("primary_timeout") >= 8 and None in reasons, reasons
    assert lane.breaker.state == CLOSED and lane.breaker.times_opened == 0
    assert lane.responses == 12  # every call came back in the end: answers and TTL drops
    # Late answers feed the runner's measured compute too (100 ms a batch of 1, 3 batches at once); TTL drops do not.
    assert lane.gate.service.compute_s == pytest.approx(0.1 / 3)


def test_a_hung_model_still_opens_the_breaker():
    async def scenario():
        async def hung_call(bucket_name, pixels, deadline):
            await asyncio.sleep(3600)

        lane = lane_with(hung_call)
        reasons = await attempts(lane, 4, 50)
        return lane, reasons

    lane, reasons = asyncio.run(scenario())
    assert reasons == ["primary_timeout"] * 4
    assert lane.breaker.state == OPEN


def test_x_request_start_units_and_sanity_bound():
    now = time.time()
    for raw in (f"t={now - 0.4:.3f}", f"t={int((now - 0.4) * 1000)}", f"t={int((now - 0.4) * 1e6)}", f"{now - 0.4}"):
        assert parse_request_start(raw, now) == pytest.approx(now - 0.4, abs=0.002), raw
    for raw in (None, "", "t=", "t=abc", "t=-5", "yesterday"):
        assert parse_request_start(raw, now) is None, raw

    first_byte = time.monotonic() - 0.05
    scope = {ARRIVAL_KEY: first_byte}
    arrival = arrival_of(scope, None, 60_000)
    assert arrival.source == "first-byte" and arrival.before_handler_ms >= 50
    arrival = arrival_of(scope, f"t={time.time() - 0.4:.3f}", 60_000)
    assert arrival.source == "x-request-start" and 399 <= arrival.before_handler_ms < 450
    for age_s in (61.0, -2 * FUTURE_SKEW_MS / 1000):  # older than any deadline, or from the future
        assert arrival_of(scope, f"t={time.time() - age_s:.3f}", 60_000).source == "first-byte"
    assert arrival_of({}, None, 60_000).source == "handler"
    # A deadline counts from the arrival.
    arrival = arrival_of({}, f"t={time.time() - 0.4:.3f}", 60_000)
    deadline = Deadline(1000, arrival.monotonic, arrival.wall, arrival)
    assert 0.55 <= deadline.remaining_s() <= 0.601 and deadline.before_handler_ms() >= 399


def test_a_deadline_used_up_by_a_slowly_sent_head_is_408_and_one_used_up_waiting_in_the_server_is_429():
    """The head's sending time (first byte to end of head) is the client's: when it alone used up the deadline the
    request is timed out like a slow body (408); a deadline used up after a quick head, waiting in the server, is
    the server's load (429, cause deadline, with Retry-After)."""
    settings = Settings()
    pipeline = stand_in_pipeline(settings, StandIn(1), StandIn(2))
    now = time.monotonic()
    slow_head = arrival_of({ARRIVAL_KEY: now - 0.6, HEAD_END_KEY: now - 0.01}, None, 60_000)
    quick_head = arrival_of({ARRIVAL_KEY: now - 0.6, HEAD_END_KEY: now - 0.59}, None, 60_000)
    assert 585 <= slow_head.head_ms <= 595 and quick_head.head_ms <= 15
    assert arrival_of({ARRIVAL_KEY: now - 0.6}, None, 60_000).head_ms == 0.0  # not stamped: unknown, not the client's
    with pytest.raises(errors.RequestTimeout) as timed_out:
        pipeline.check_capacity(Deadline.sliced(300, slow_head, settings), "normal")
    assert timed_out.value.status == 408 and "head took" in str(timed_out.value)
    with pytest.raises(errors.Overloaded) as overloaded:
        pipeline.check_capacity(Deadline.sliced(300, quick_head, settings), "normal")
    assert overloaded.value.cause == "deadline" and overloaded.value.retry_after_s >= 1
    pipeline.check_capacity(Deadline.sliced(5_000, slow_head, settings), "normal")  # time left: admitted
    # The same when the deadline runs out before the place is taken (the OIP route's body may shorten it).
    with pytest.raises(errors.RequestTimeout):
        pipeline.admit(Deadline.sliced(300, slow_head, settings), "normal")
    with pytest.raises(errors.Overloaded) as overloaded:
        pipeline.admit(Deadline.sliced(300, quick_head, settings), "normal")
    assert overloaded.value.cause == "deadline"


def test_inflight_bound_refuses_beyond_its_limit_before_the_app_runs():
    async def scenario():
        entered, release = [], asyncio.Event()

        async def app(scope, receive, send):
            entered.append(scope["path"])
            await release.wait()

        async def refuse(scope, receive, send):
            entered.append("refused")

        bound = InflightBound(lambda: 2, refuse, ["/classify"])
        wrapped = bound.wrap(app)
        assert bound.wrap(app) is wrapped
        calls = [asyncio.create_task(wrapped({"type": "http", "path": path}, None, None))
                 for path in ("/classify", "/classify", "/classify", "/livez")]
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(*calls)
        return bound, entered

    bound, entered = asyncio.run(scenario())
    assert sorted(entered) == ["/classify", "/classify", "/livez", "refused"]
    assert bound.refused == 1 and bound.inflight == 0


def test_inflight_bound_leaves_room_for_high_priority_requests():
    """A high-priority request over the bound still reaches admission (up to twice the bound): it evicts a normal one there."""

    async def scenario():
        release, entered = asyncio.Event(), []

        async def app(scope, receive, send):
            entered.append(scope["headers"][0][1] if scope["headers"] else b"normal")
            await release.wait()

        async def refuse(scope, receive, send):
            entered.append(b"refused")

        bound = InflightBound(lambda: 1, refuse, ["/classify"])
        wrapped = bound.wrap(app)
        scopes = [{"type": "http", "path": "/classify", "headers": headers}
                  for headers in ([], [], [(b"x-priority", b"HIGH")], [(b"x-priority", b"high")])]
        calls = [asyncio.create_task(wrapped(scope, None, None)) for scope in scopes]
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(*calls)
        return entered

    assert sorted(asyncio.run(scenario())) == [b"HIGH", b"normal", b"refused", b"refused"]
