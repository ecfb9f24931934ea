"""A bounded, priority-ordered thread pool for CPU work that must not block the event loop.

Decoding and resizing run on ``workers`` threads. At most ``queue`` more jobs may
wait; an upload beyond that gets ``Overloaded`` (429 with Retry-After) at once,
so memory held by waiting uploads stays bounded. Waiting jobs start high
priority first, then in arrival order.

Time is bounded twice: a job that has not *started* within the caller's budget is
cancelled (no work is spent on a request whose deadline has passed) and answered
``Overloaded``; a job that has started but runs past ``run_limit_s`` or the budget
raises ``JobTimeout``. A thread cannot be killed, so a timed-out job keeps its
slot until it really ends: the pool's bound on memory holds.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

from .errors import Overloaded

__all__ = ["BoundedPool", "JobTimeout"]

T = TypeVar("T")


class JobTimeout(Exception):
    """A started job outlived its limit. ``by_run_limit``: the job's own limit (not the caller's budget) ran out."""

    def __init__(self, ran_s: float, by_run_limit: bool) -> None:
        super().__init__(f"job still running after {ran_s * 1000:.0f} ms")
        self.ran_s = ran_s
        self.by_run_limit = by_run_limit


class BoundedPool:
    """``workers`` threads (at niceness ``nice``) plus a wait queue of ``queue`` jobs; ``retry_after_s`` goes into 429s."""

    def __init__(self, workers: int, queue: int, retry_after_s: float = 1.0, name: str = "rampart-decode",
                 nice: int = 0) -> None:
        self.capacity = workers + queue
        self.retry_after_s = retry_after_s
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Future, Callable, tuple]] = []
        self._seq = itertools.count()
        self._pending = 0
        self.nice = nice
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pending(self) -> int:
        """Jobs running or waiting now."""
        return self._pending

    async def run(
        self, fn: Callable[..., T], *args: object, high: bool = False,
        budget_s: float | None = None, run_limit_s: float | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the pool (``high`` priority first) and return its result.

        Raises ``Overloaded`` when the pool is full, or when the job has not started
        within ``budget_s`` seconds (it is then cancelled). Raises ``JobTimeout`` when
        it started but is still running after ``run_limit_s`` seconds of its own or
        when ``budget_s`` runs out. The slot is held until the job itself ends.
        """
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        started_at: list[float] = []
        future: Future = Future()

        def job() -> T:
            started_at.append(time.monotonic())
            loop.call_soon_threadsafe(started.set)
            return fn(*args)

        with self._cond:
            if self._pending >= self.capacity:
                raise Overloaded(f"decoding capacity is exhausted ({self.capacity} uploads in progress)", self.retry_after_s)
            self._pending += 1
            heapq.heappush(self._heap, (0 if high else 1, next(self._seq), future, job, ()))
            self._cond.notify()
        submitted = time.monotonic()
        result = asyncio.wrap_future(future)
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception was never retrieved"
        if budget_s is None and run_limit_s is None:
            return await result
        budget_s = float("inf") if budget_s is None else max(budget_s, 0.0)
        start_wait = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait([start_wait, result], timeout=budget_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            start_wait.cancel()
        if not started.is_set() and future.cancel():
            raise Overloaded(
                f"no decoder became free within the request's deadline ({budget_s * 1000:.0f} ms)", self.retry_after_s
            )
        left_s = budget_s - (time.monotonic() - submitted)
        run_limit_s = float("inf") if run_limit_s is None else run_limit_s
        done, _ = await asyncio.wait([result], timeout=max(min(run_limit_s, left_s), 0.0))
        if done:
            return result.result()
        ran_s = time.monotonic() - (started_at[0] if started_at else submitted)
        raise JobTimeout(ran_s, by_run_limit=run_limit_s <= left_s)

    def _work(self) -> None:
        if self.nice > 0:
            try:  # Linux: niceness is per thread
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:
                pass
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                _, _, future, fn, args = heapq.heappop(self._heap)
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:
                        future.set_exception(exc)
            finally:
                with self._cond:
                    self._pending -= 1
