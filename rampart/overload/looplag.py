"""Event-loop lag: how late the API layer's event loop runs what is due.

On a saturated host (CPU contention, garbage collection) the loop can run timers
tens to hundreds of milliseconds late, and then an answer due at the deadline
leaves late. ``LoopLagMonitor`` sleeps ``interval_s`` in a loop and records how
much longer each sleep took; ``recent_ms`` (the largest lag of the last
``window_s`` seconds) is kept back from every new request's deadline, so the
pipeline stops early enough to answer on time while the loop is slow.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

__all__ = ["LoopLagMonitor"]


class LoopLagMonitor:
    """Measures the running loop's lag every ``interval_s`` s; ``recent_ms`` is the max over ``window_s`` s."""

    def __init__(self, interval_s: float = 0.02, window_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()
        self._task: asyncio.Task | None = None

    def ensure_started(self) -> None:
        """Start measuring on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def recent_ms(self) -> float:
        """Largest lag (ms) seen in the last ``window_s`` seconds; 0 before any sample."""
        cutoff = time.monotonic() - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        return max((lag for _, lag in self._samples), default=0.0)

    def record(self, lag_ms: float) -> None:
        """Add one lag sample (ms), timestamped now."""
        self._samples.append((time.monotonic(), max(lag_ms, 0.0)))

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.record((time.perf_counter() - start - self.interval_s) * 1000.0)
