"""Deadlines: one end-to-end budget per request, passed explicitly everywhere.

A ``Deadline`` is fixed when the request arrives (``X-Deadline-Ms``) and covers
decode, queueing and inference. The runners live in other processes, so what
crosses to them is an absolute wall-clock time (``time.time()`` seconds), which
is comparable across processes on one host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Deadline"]


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline. ``budget_ms`` is the whole budget; times are seconds."""

    budget_ms: float
    start_monotonic: float = field(default_factory=time.monotonic)
    start_wall: float = field(default_factory=time.time)

    def elapsed_ms(self) -> float:
        """Milliseconds since the request arrived."""
        return (time.monotonic() - self.start_monotonic) * 1000.0

    def remaining_s(self, reserve_ms: float = 0.0) -> float:
        """Seconds left before the deadline minus ``reserve_ms``; may be negative."""
        return (self.budget_ms - reserve_ms - self.elapsed_ms()) / 1000.0

    def wall_clock_at(self, reserve_ms: float = 0.0) -> float:
        """The ``time.time()`` instant of the deadline minus ``reserve_ms``, for other processes."""
        return self.start_wall + (self.budget_ms - reserve_ms) / 1000.0
