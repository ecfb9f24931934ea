"""A bounded thread pool for CPU work that must not block the event loop.

Decoding and resizing run on ``workers`` threads. At most ``queue`` more jobs may
wait; an upload beyond that gets ``Overloaded`` (429 with Retry-After) at once,
so memory held by waiting uploads stays bounded.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from .errors import Overloaded

__all__ = ["BoundedPool"]

T = TypeVar("T")


class BoundedPool:
    """``workers`` threads plus a wait queue of ``queue`` jobs; ``retry_after_s`` goes into 429s."""

    def __init__(self, workers: int, queue: int, retry_after_s: float = 1.0, name: str = "rampart-decode") -> None:
        self.capacity = workers + queue
        self.retry_after_s = retry_after_s
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._pending = 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the pool; raises ``Overloaded`` when it is full.

        The slot is held until the job itself ends, even when the caller stops waiting.
        """
        with self._lock:
            if self._pending >= self.capacity:
                raise Overloaded(f"decoding capacity is exhausted ({self.capacity} uploads in progress)", self.retry_after_s)
            self._pending += 1
        return await self._submit(fn, *args)

    async def run_admitted(self, fn: Callable[..., T], *args: object) -> T:
        """Run follow-up work of an already admitted request, without the capacity check."""
        with self._lock:
            self._pending += 1
        return await self._submit(fn, *args)

    async def _submit(self, fn: Callable[..., T], *args: object) -> T:
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: self._release())
        return await asyncio.wrap_future(future)

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        """Stop accepting work; running jobs finish in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)
