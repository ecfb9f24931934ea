"""``rampart.overload.deadline``: a request's budget, its slices and ``run_within``; no server, no waiting on a clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from rampart.api.arrival import Arrival
from rampart.config import Settings
from rampart.overload.deadline import Deadline, Share, run_within


def deadline_ago(elapsed_ms: float, budget_ms: float, **slices) -> Deadline:
    """A deadline of ``budget_ms`` for a request that arrived ``elapsed_ms`` ago."""
    return Deadline(budget_ms, time.monotonic() - elapsed_ms / 1000, time.time() - elapsed_ms / 1000, **slices)


def test_slices_primary_is_all_but_the_reserve_all_is_all_but_the_margin():
    deadline = Deadline(1000, margin_ms=20, fallback_reserve_ms=250)
    assert deadline.share_ms() == deadline.share_ms(Share.ALL) == 980
    assert deadline.share_ms(Share.PRIMARY) == 730
    bare = Deadline(1000)
    assert bare.share_ms(Share.ALL) == bare.share_ms(Share.PRIMARY) == 1000


def test_a_margin_over_the_budget_leaves_nothing_and_the_primary_less_than_nothing():
    deadline = deadline_ago(0, 30, margin_ms=50, fallback_reserve_ms=250)
    assert deadline.share_ms(Share.ALL) == 0
    assert deadline.share_ms(Share.PRIMARY) == -250
    assert deadline.remaining_s() <= 0 and deadline.primary_remaining_s() < deadline.remaining_s()


def test_remaining_counts_from_the_arrival_per_share():
    deadline = deadline_ago(400, 1000, margin_ms=20, fallback_reserve_ms=250)
    elapsed_s = deadline.elapsed_ms() / 1000
    assert 0.4 <= elapsed_s < 0.5
    # Both shares end where their slice ends, counted from the same arrival.
    assert deadline.remaining_s() == pytest.approx(0.98 - elapsed_s, abs=0.005)
    assert deadline.primary_remaining_s() == pytest.approx(0.73 - elapsed_s, abs=0.005)
    assert deadline.remaining_s(Share.PRIMARY) == pytest.approx(deadline.primary_remaining_s(), abs=0.005)
    late = deadline_ago(1200, 1000)
    assert late.remaining_s() < 0  # past the deadline: negative, never clamped


def test_epoch_is_the_wall_clock_end_of_each_share():
    start_wall = time.time() - 0.3
    deadline = Deadline(1000, time.monotonic() - 0.3, start_wall, margin_ms=20, fallback_reserve_ms=250)
    assert deadline.epoch_s() == pytest.approx(start_wall + 0.98)
    assert deadline.epoch_s(Share.PRIMARY) == pytest.approx(start_wall + 0.73)
    # Another process comparing time.time() against it sees the same time left.
    assert deadline.epoch_s(Share.PRIMARY) - time.time() == pytest.approx(deadline.primary_remaining_s(), abs=0.005)


def test_sliced_takes_the_budget_from_the_caller_and_the_slices_from_the_settings():
    arrival = Arrival(monotonic=time.monotonic() - 0.1, wall=time.time() - 0.1, before_handler_ms=100.0,
                      source="first-byte")
    settings = Settings(answer_margin_ms=30, fallback_reserve_ms=200)
    deadline = Deadline.sliced(800, arrival, settings, loop_lag_ms=15)
    assert (deadline.budget_ms, deadline.margin_ms, deadline.fallback_reserve_ms) == (800, 45, 200)
    assert (deadline.start_monotonic, deadline.start_wall, deadline.arrival) == (arrival.monotonic, arrival.wall, arrival)
    assert deadline.share_ms(Share.PRIMARY) == 800 - 45 - 200


def test_before_handler_is_the_arrivals_wait_or_zero_when_unknown():
    assert Deadline(1000).before_handler_ms() == 0.0
    arrival = Arrival(time.monotonic(), time.time(), before_handler_ms=37.5, source="x-request-start")
    assert Deadline(1000, arrival.monotonic, arrival.wall, arrival).before_handler_ms() == 37.5


def test_run_within_returns_the_result_and_passes_errors_through():
    async def value():
        await asyncio.sleep(0)
        return 42

    async def broken():
        raise ValueError("model failed")

    assert asyncio.run(run_within(value(), 5.0)) == 42
    with pytest.raises(ValueError, match="model failed"):
        asyncio.run(run_within(broken(), 5.0))


def test_run_within_times_out_without_waiting_for_the_cancelled_work_to_unwind():
    async def scenario():
        unwinding, finished = asyncio.Event(), asyncio.Event()
        may_finish = asyncio.Event()

        async def slow_to_tear_down():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                unwinding.set()
                await may_finish.wait()  # like an HTTP call closing its connection under load
                finished.set()
                raise

        with pytest.raises(asyncio.TimeoutError):
            await run_within(slow_to_tear_down(), 0.01)
        await asyncio.sleep(0)
        still_unwinding = unwinding.is_set() and not finished.is_set()
        may_finish.set()
        await asyncio.sleep(0.01)
        return still_unwinding, finished.is_set()

    still_unwinding, finished = asyncio.run(scenario())
    assert still_unwinding, "run_within waited for the cancelled work"
    assert finished


def test_run_within_cancels_its_work_when_its_caller_is_cancelled():
    async def scenario():
        cancelled = asyncio.Event()

        async def work():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        caller = asyncio.ensure_future(run_within(work(), 3600))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0)
        return cancelled.is_set()

    assert asyncio.run(scenario())
