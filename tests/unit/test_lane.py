"""``rampart.lane`` and ``rampart.overload.admission``: "Is there room?" agrees with "take a place", per layer: the
admission gate (``has_room`` / ``reserve``) and the model lane (deadline share, circuit breaker, gate), in-process."""

from __future__ import annotations

import time

from hypothesis import given, settings, strategies as st

from rampart.overload.admission import AdmissionGate, Shed, ThroughputMeter, Ticket
from rampart.overload.breaker import HALF_OPEN, OPEN, CircuitBreaker
from rampart.inputs.buckets import buckets_for_resolution
from rampart.overload.deadline import Deadline, Share
from rampart.lane import Attempt, ModelEndpoint, ModelLane


def small_gate() -> AdmissionGate:
    """Window 4 (batch 2, one computing and one forming), 10 ms per image, queue limit 4: full at 8."""
    return AdmissionGate("m", max_batch_size=2, concurrent_batches=1, queue_delay_ms=40,
                         meter=ThroughputMeter(override_ips=100))


OPS = st.lists(st.tuples(st.sampled_from(["reserve", "cancel", "dispatch"]), st.booleans(),
                         st.floats(min_value=-0.01, max_value=0.2), st.integers(0, 4)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_gate_has_room_exactly_when_reserve_gives_a_ticket(ops):
    gate, tickets = small_gate(), []
    for op, high, budget_s, n in ops:
        if op == "dispatch":  # as if n images were with the runner
            gate.dispatched = min(n, gate.window)
        elif op == "cancel" and tickets:
            tickets.pop(n % len(tickets)).cancel()
        elif op == "reserve":
            room, refusal = gate.has_room(high, budget_s), gate.refusal(high, budget_s)
            try:
                tickets.append(gate.reserve(high, budget_s))
                assert room and refusal is None
            except Shed as shed:
                assert not room and shed.reason == refusal.reason
    assert gate.queued == sum(ticket.queued for ticket in tickets)


def test_a_full_gate_has_room_for_high_priority_only_while_a_normal_one_is_queued():
    gate = small_gate()
    gate.dispatched = gate.window
    normal = [gate.reserve(False, 10.0) for _ in range(gate.queue_limit)]
    assert not gate.has_room(False, 10.0) and gate.refusal(False, 10.0).reason == "queue_full"
    for evicted in range(1, len(normal) + 1):  # each high arrival evicts the newest normal one
        assert gate.has_room(True, 10.0)
        gate.reserve(True, 10.0)
        assert [ticket.evicted for ticket in normal] == [False] * (len(normal) - evicted) + [True] * evicted
    assert not gate.has_room(True, 10.0) and gate.refusal(True, 10.0).reason == "queue_full"


def lane(breaker: CircuitBreaker | None, share: Share = Share.PRIMARY) -> ModelLane:
    async def never_called(bucket_name, pixels, deadline_epoch_s):
        raise AssertionError("reserve and has_room never call the model")

    endpoint = ModelEndpoint("m", "v1", ["a"], buckets_for_resolution(32), never_called)
    return ModelLane("primary", endpoint, small_gate(), breaker, share)


def half_open_breaker(probes: int = 1) -> CircuitBreaker:
    now = [0.0]
    breaker = CircuitBreaker(window_s=60, min_calls=1, failure_rate=0.5, open_s=1.0, probes=probes,
                             clock=lambda: now[0])
    breaker.allow()
    breaker.record(False)
    assert breaker.state == OPEN
    now[0] += 1.0
    assert breaker.state == HALF_OPEN
    return breaker


def agrees(model: ModelLane, high: bool, deadline: Deadline) -> Ticket | Attempt:
    room = model.has_room(high, deadline)
    outcome = model.reserve(high, deadline)
    assert room == isinstance(outcome, Ticket), (room, outcome)
    return outcome


def test_lane_refuses_alike_when_its_share_of_the_deadline_is_used_up():
    reserve_only = Deadline(1000, time.monotonic() - 0.9, time.time() - 0.9, fallback_reserve_ms=250)
    assert agrees(lane(None, Share.PRIMARY), False, reserve_only).reason == "primary_timeout"
    assert isinstance(agrees(lane(None, Share.ALL), False, reserve_only), Ticket)  # the fallback's share is left


def test_lane_refuses_alike_while_the_breaker_is_open_or_all_probes_are_out():
    breaker = half_open_breaker(probes=1)
    model = lane(breaker)
    probe = agrees(model, False, Deadline(1000))
    assert isinstance(probe, Ticket)  # the one probe, taken by reserve
    refused = agrees(model, False, Deadline(1000))
    assert refused.reason == "primary_circuit_open" and refused.shed
    breaker.record(False)  # the probe failed: open again
    assert agrees(model, False, Deadline(1000)).reason == "primary_circuit_open"


def test_lane_refuses_alike_when_the_gate_is_full_and_takes_no_probe_then():
    breaker = half_open_breaker(probes=1)
    model = lane(breaker)
    model.gate.dispatched = model.gate.window
    model.gate.queued = model.gate.queue_limit  # full, nothing to evict
    refused = agrees(model, False, Deadline(1000))
    assert refused.reason == "primary_overloaded" and refused.shed
    assert breaker.would_allow()  # the refusal did not use up the probe


def test_lane_release_gives_back_the_place_and_the_probe():
    breaker = half_open_breaker(probes=1)
    model = lane(breaker)
    ticket = agrees(model, False, Deadline(1000))
    assert not model.has_room(False, Deadline(1000))
    model.release(ticket)
    assert model.has_room(False, Deadline(1000)) and model.gate.queued == 0


class ClockMovingDeadline(Deadline):
    """A deadline whose remaining time falls by ``step_s`` at every reading, as a real clock does between calls."""

    def __init__(self, first_s: float, step_s: float) -> None:
        super().__init__(60_000)
        self.readings = [first_s - i * step_s for i in range(100)]

    def remaining_s(self, share: Share = Share.ALL) -> float:
        return self.readings.pop(0)


def test_a_request_predicted_to_finish_just_in_time_gets_a_ticket_or_a_refusal_never_a_raised_shed():
    """The kind of the 500 seen at 5x overload: the check read the clock, then the gate read it again and shed."""
    model = lane(None)
    model.gate.dispatched = 1  # not idle: the prediction counts (2 images at 10 ms = 20 ms)
    predicted = model.gate.predicted_s(False)
    outcome = model.reserve(False, ClockMovingDeadline(predicted + 0.0005, 0.001))
    assert isinstance(outcome, Ticket)
    outcome = model.reserve(False, ClockMovingDeadline(predicted - 0.0005, 0.001))
    assert isinstance(outcome, Attempt) and outcome.shed


class FallingMeter(ThroughputMeter):
    """A meter whose estimate falls a little at every reading, as a busy model's does while nothing completes."""

    def __init__(self, ips: float) -> None:
        super().__init__()
        self._now_ips = ips

    @property
    def ips(self) -> float:
        self._now_ips *= 0.99
        return self._now_ips


def test_a_meter_falling_between_check_and_place_never_raises_out_of_reserve():
    """The second 500 of the same kind: the gate's prediction moved between "is there room" and "take it"."""
    model = lane(None)
    model.gate.meter = FallingMeter(100.0)
    model.gate.dispatched = 1
    budget_s = model.gate.predicted_s(False) * 1.015  # fits at the next reading (x 1/0.99), not at the one after
    outcome = model.reserve(False, ClockMovingDeadline(budget_s, 0.0))
    assert isinstance(outcome, (Ticket, Attempt))


def test_a_busy_runners_first_answer_after_a_quiet_spell_is_not_a_stall():
    """Silence was counted from the last response alone: after start or a quiet spell it was minutes long, so every
    timeout before the runner's first answer to a new burst was a "stall" (a fresh server's breaker opened under a
    burst of pure overload). It is now counted from when this worker gave the runner work with no call out; a hung
    runner keeps the calls of requests that timed out, so the next request's silence runs on and is a stall."""
    import asyncio

    import numpy as np

    async def scenario(requests: int) -> list[dict]:
        async def hung(bucket_name, pixels, deadline_epoch_s):
            await asyncio.sleep(30)

        gate = AdmissionGate("m", max_batch_size=8, concurrent_batches=1, queue_delay_ms=1000,
                             meter=ThroughputMeter(override_ips=20))  # stall after 2 x 8 x 50 ms = 0.8 s
        model = ModelLane("primary", ModelEndpoint("m", "v1", ["a"], buckets_for_resolution(32), hung), gate,
                          CircuitBreaker(window_s=60, min_calls=5, failure_rate=0.5, open_s=10.0), Share.PRIMARY)
        model.last_response -= 600  # the runner last answered ten minutes ago
        outcomes = []
        for _ in range(requests):  # one after the other, 600 ms deadlines: each waits about 0.35 s
            deadline = Deadline(600)
            ticket = model.reserve(False, deadline)
            attempt = await model.attempt(ticket, (model.endpoint.buckets["square"], np.zeros((32, 32, 3), np.uint8)),
                                          deadline)
            outcomes.append({"reason": attempt.reason, **model.failures})
        return outcomes

    outcomes = asyncio.run(scenario(4))
    assert all(outcome["reason"] == "primary_timeout" for outcome in outcomes), outcomes
    stalls = [outcome["stalled"] for outcome in outcomes]
    assert stalls[0] == 0, outcomes  # 0.35 s into the work: busy, not hung (it was a stall: 600 s of "silence")
    assert stalls[-1] >= 1, outcomes  # over 0.8 s of silence since the work began: hung
