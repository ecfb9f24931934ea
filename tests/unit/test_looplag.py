"""The event-loop lag monitor: a loop blocked past ``STALL_MS`` is logged as a stall, with the collector's share
and the code its thread was in."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from rampart.overload.looplag import STALL_MS, LoopLagMonitor


def cyclic_garbage(count: int) -> None:
    """Leave ``count`` two-object reference cycles for the collector."""
    for _ in range(count):
        a, b = [], []
        a.append(b)
        b.append(a)


async def block_the_loop(monitor: LoopLagMonitor, collect: bool) -> None:
    gc.collect()  # earlier tests' garbage, before the monitor measures: no collection of it falls in the stall
    monitor.ensure_started()
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    if collect:
        cyclic_garbage(200_000)
        gc.collect()
    while time.perf_counter() - started < (STALL_MS + 100) / 1000:  # the loop runs nothing meanwhile
        pass
    await asyncio.sleep(0.05)


@pytest.fixture
def monitor():
    """A monitor, its collector callback removed after the test."""
    monitor = LoopLagMonitor()
    yield monitor
    if monitor._on_collection in gc.callbacks:
        gc.callbacks.remove(monitor._on_collection)


def test_a_blocked_loop_is_a_logged_stall_and_the_recent_lag(monitor, caplog):
    with caplog.at_level(logging.WARNING, logger="rampart.overload.looplag"):
        asyncio.run(block_the_loop(monitor, collect=False))
    assert monitor.stalls == 1 and monitor.recent_ms >= STALL_MS
    (record,) = caplog.records
    assert "(0 ms of it in garbage collection)" in record.getMessage()
    # the watchdog saw the loop's thread in the code that blocked it
    assert "its thread was at: test_looplag.py:" in record.getMessage() and " block_the_loop" in record.getMessage()


def test_the_collector_s_share_of_a_stall_is_logged_and_its_pauses_are_kept(monitor, caplog):
    with caplog.at_level(logging.WARNING, logger="rampart.overload.looplag"):
        asyncio.run(block_the_loop(monitor, collect=True))
    (record,) = caplog.records
    assert "stalled" in record.getMessage() and "(0 ms of it" not in record.getMessage()
    pauses = monitor.take_pauses()
    assert any(generation == 2 for generation, _ in pauses) and all(pause_s >= 0.001 for _, pause_s in pauses)
    assert monitor.take_pauses() == []


def test_a_monitor_leaves_no_thread_or_collector_callback_once_its_loop_ends():
    """``asyncio.run`` cancels the measuring task as its loop ends: the watchdog thread returns and the collector
    callback is removed; a later loop starts both again."""
    monitor = LoopLagMonitor()

    async def briefly() -> None:
        monitor.ensure_started()
        await asyncio.sleep(0.05)
        assert monitor.watching and monitor._on_collection in gc.callbacks

    for _ in range(2):
        asyncio.run(briefly())
        deadline = time.monotonic() + 5
        while monitor.watching and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not monitor.watching
        assert monitor._on_collection not in gc.callbacks
