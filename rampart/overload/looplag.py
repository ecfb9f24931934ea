"""Event-loop lag: how late the API layer's event loop runs what is due.

On a saturated host (CPU contention, garbage collection) the loop can run timers
tens to hundreds of milliseconds late, and then an answer due at the deadline
leaves late. ``LoopLagMonitor`` sleeps ``interval_s`` in a loop and records how
much longer each sleep took; ``recent_ms`` (the largest lag of the last
``window_s`` seconds) is kept back from every new request's deadline, so the
pipeline stops early enough to answer on time while the loop is slow.

A lag of ``STALL_MS`` or more is logged as a stall, with the time the cycle
collector ran within it (it stops every thread of the process): a stall that
was not the collector was the host (CPU contention, a paused VM) or blocking
code on the loop. A watchdog thread notes where the loop's thread was once
the loop has been late by half of ``STALL_MS`` (``sys._current_frames``), and the
warning names that code: a frame of the selector's wait means the loop had
nothing to run, so the process itself was not scheduled. The collector's pauses
of 1 ms or more are kept for ``take_pauses`` (the service puts them in
``rampart_gc_pause_seconds``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import traceback
from collections import deque

__all__ = ["STALL_MS", "LoopLagMonitor"]

logger = logging.getLogger(__name__)

#: A lag this long or longer (ms) is logged as a stall: most of the 300 ms a client is allowed past its
#: deadline (docs/overload.md), so an answer due during it may arrive late.
STALL_MS = 200.0
#: Collector pauses shorter than this (s) are not kept for ``take_pauses``: most young-generation
#: collections, hundreds a second under load, each well under it.
MIN_PAUSE_S = 0.001
#: Innermost frames of the loop's thread shown with a stall.
STALL_FRAMES = 4


class LoopLagMonitor:
    """Measures the running loop's lag every ``interval_s`` s; ``recent_ms`` is the max over ``window_s`` s."""

    def __init__(self, interval_s: float = 0.02, window_s: float = 2.0, stall_ms: float = STALL_MS) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.stall_ms = stall_ms
        self.stalls = 0
        self._samples: deque[tuple[float, float]] = deque()
        self._task: asyncio.Task | None = None
        self._collecting_since = 0.0
        self._collector_s = 0.0  # the cycle collector's time so far (s)
        self._pauses: deque[tuple[int, float]] = deque(maxlen=10_000)
        self._due = float("inf")  # perf_counter time the monitor's sleep should end
        self._where: str | None = None  # where the loop's thread was, once the current sleep was half a stall late
        self._watchdog: threading.Thread | None = None

    def ensure_started(self) -> None:
        """Start measuring on the running loop, timing the cycle collector and watching for stalls (idempotent).

        All three last as long as the measuring task: when it ends (cancelled, or its loop closed) the
        collector callback is removed and the watchdog thread returns, so a monitor leaves nothing behind."""
        if self._task is None or self._task.done():
            if self._on_collection not in gc.callbacks:
                gc.callbacks.append(self._on_collection)
            loop = asyncio.get_running_loop()
            self._task = task = loop.create_task(self._run())
            # one watchdog per task: an earlier task's returns by itself within ``interval_s``
            self._watchdog = threading.Thread(target=self._watch, args=(threading.get_ident(), loop, task),
                                              name="rampart-loop-watchdog", daemon=True)
            self._watchdog.start()

    @property
    def watching(self) -> bool:
        """Whether the watchdog thread is running."""
        return self._watchdog is not None and self._watchdog.is_alive()

    def _watch(self, loop_thread: int, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        """Every ``interval_s``: once the monitor's sleep is half of ``stall_ms`` overdue, note the loop thread's frames
        (half: a watchdog that waits for the whole of it sees little of a stall just over it). Returns once the
        measuring ``task`` is no longer the monitor's, is done, or its ``loop`` is closed."""
        while self._task is task and not task.done() and not loop.is_closed():
            time.sleep(self.interval_s)
            if self._where is None and time.perf_counter() - self._due >= self.stall_ms / 2000.0:
                frame = sys._current_frames().get(loop_thread)
                if frame is not None:
                    # Only the innermost frames, and no source lines: ``extract_stack`` walked the whole stack and
                    # read each file's lines (cold, tens of ms under a deep stack), so the stall could end first.
                    stack = traceback.StackSummary.extract(traceback.walk_stack(frame), limit=STALL_FRAMES,
                                                           lookup_lines=False)
                    self._where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in stack)

    def take_pauses(self) -> list[tuple[int, float]]:
        """The collector's pauses of at least ``MIN_PAUSE_S`` since the last call: (generation, seconds) each."""
        pauses = []
        while self._pauses:
            pauses.append(self._pauses.popleft())
        return pauses

    def _on_collection(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._collecting_since = now
            return
        pause_s = now - self._collecting_since
        self._collector_s += pause_s
        if pause_s >= MIN_PAUSE_S:
            self._pauses.append((info["generation"], pause_s))

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
        try:
            await self._measure()
        finally:
            if self._on_collection in gc.callbacks:
                gc.callbacks.remove(self._on_collection)

    async def _measure(self) -> None:
        while True:
            start, collector_s = time.perf_counter(), self._collector_s
            self._due, self._where = start + self.interval_s, None
            await asyncio.sleep(self.interval_s)
            lag_ms = (time.perf_counter() - start - self.interval_s) * 1000.0
            self.record(lag_ms)
            if lag_ms >= self.stall_ms:
                self.stalls += 1
                logger.warning("the event loop stalled for %.0f ms (%.0f ms of it in garbage collection); "
                               "its thread was at: %s", lag_ms, (self._collector_s - collector_s) * 1000.0,
                               self._where or "not seen")
