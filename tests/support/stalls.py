"""How long an event loop stalls while a coroutine runs beside it."""

from __future__ import annotations

import asyncio
import time


def loop_stall_s(scenario):
    """Run ``scenario()`` (a coroutine function) beside a 10 ms ticker; (its result, the ticker's longest gap in s)."""
    async def run():
        gaps, done = [0.0], asyncio.Event()

        async def tick():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps[0], last = max(gaps[0], now - last), now

        ticker = asyncio.create_task(tick())
        try:
            return await scenario(), gaps[0]
        finally:
            done.set()
            await ticker

    return asyncio.run(run())
