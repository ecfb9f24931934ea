"""Deadlines: one end-to-end budget per request, passed explicitly everywhere.

A ``Deadline`` is fixed when the request arrives (``X-Deadline-Ms``) and covers
everything from its arrival (first byte, or a load balancer's ``X-Request-Start``:
see ``rampart.arrival``) to the answer: waiting before the handler, body upload,
decode, queueing and inference. The runners live in other processes, so what
crosses to them is an absolute wall-clock time (``time.time()`` seconds), which
is comparable across processes on one host.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, TypeVar

if TYPE_CHECKING:
    from .arrival import Arrival

T = TypeVar("T")

__all__ = ["Deadline", "run_within"]


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline. ``budget_ms`` is the whole budget, counted from ``start_monotonic``
    (``time.monotonic()`` s) = ``start_wall`` (``time.time()`` s), the request's arrival; ``arrival``
    says how that was found (None: when the ``Deadline`` was made)."""

    budget_ms: float
    start_monotonic: float = field(default_factory=time.monotonic)
    start_wall: float = field(default_factory=time.time)
    arrival: "Arrival | None" = None

    def before_handler_ms(self) -> float:
        """Milliseconds between the request's arrival and its handler's start (0 when unknown)."""
        return 0.0 if self.arrival is None else self.arrival.before_handler_ms

    def elapsed_ms(self) -> float:
        """Milliseconds since the request arrived."""
        return (time.monotonic() - self.start_monotonic) * 1000.0

    def remaining_s(self, reserve_ms: float = 0.0) -> float:
        """Seconds left before the deadline minus ``reserve_ms``; may be negative."""
        return (self.budget_ms - reserve_ms - self.elapsed_ms()) / 1000.0

    def wall_clock_at(self, reserve_ms: float = 0.0) -> float:
        """The ``time.time()`` instant of the deadline minus ``reserve_ms``, for other processes."""
        return self.start_wall + (self.budget_ms - reserve_ms) / 1000.0


async def run_within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """The result of ``awaitable`` if it finishes within ``timeout_s`` seconds, else ``asyncio.TimeoutError``.

    Unlike ``asyncio.wait_for`` (Python 3.11), it does not wait for the cancelled
    work to finish unwinding: an HTTP call to a runner may take hundreds of
    milliseconds to tear down under load, and the answer must not wait for that.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait([task], timeout=max(timeout_s, 0.0))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task.result()
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody waits for it any more
    raise asyncio.TimeoutError(f"not finished within {timeout_s * 1000:.0f} ms")
