"""``rampart.api.lifecycle`` in-process: admission only between ready and drain, exit signals left alone outside
uvicorn."""

from __future__ import annotations

import asyncio
import signal

import pytest


def test_lifecycle_admits_only_between_ready_and_drain_and_counts_in_flight():
    from rampart.errors import NotReady, ShuttingDown
    from rampart.api.lifecycle import Lifecycle

    async def main():
        lifecycle = Lifecycle()
        with pytest.raises(NotReady):
            lifecycle.admit()
        lifecycle.mark_ready()
        first, second = lifecycle.admit(), lifecycle.admit()
        assert (lifecycle.state, lifecycle.in_flight) == ("ready", 2)
        lifecycle.begin_drain()
        with pytest.raises(ShuttingDown):
            lifecycle.admit()
        with first:
            pass
        assert not await lifecycle.drained(0.05)  # one still in flight: the bound ends the wait
        waiter = asyncio.ensure_future(lifecycle.drained(5))
        await asyncio.sleep(0.01)
        with second:
            assert not waiter.done()
        assert await waiter and (lifecycle.state, lifecycle.in_flight) == ("draining", 0)

    asyncio.run(main())


def test_exit_signals_are_left_alone_outside_a_uvicorn_worker():
    from rampart.api.lifecycle import intercept_exit_signals

    async def drain(signum):
        raise AssertionError("never called")

    async def in_a_loop():
        return intercept_exit_signals(drain)

    before = signal.getsignal(signal.SIGTERM)
    assert intercept_exit_signals(drain) is False  # no running loop
    assert asyncio.run(in_a_loop()) is False  # a loop, but SIGTERM is not handled by uvicorn
    assert signal.getsignal(signal.SIGTERM) is before
