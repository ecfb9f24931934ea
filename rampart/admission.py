"""Deadline-aware admission control for one model: bounded, priority-ordered, measured.

Each model sits behind an ``AdmissionGate``. At most ``window`` images are
*dispatched* (sent to the runner's adaptive-batching queue or being computed) at
once: ``(concurrent_batches + 1) × max_batch_size``, one batch computing and one
forming. Requests beyond that wait in the gate's own queue, high priority first,
then in arrival order, so the runner's queue stays short and priority means
something (BentoML's dispatcher itself is first in, first out).

The wait queue is bounded by measured throughput × the acceptable queueing delay
(``queue_delay_ms``), as in the seed's sizing rule: 200 img/s × 0.2 s = 40. The
throughput comes from ``ThroughputMeter``: seeded by the runner's warm-up, then
updated online from every completed batch, or fixed by configuration.

On arrival (``AdmissionGate.admit``, a few microseconds, no I/O) a request is shed
with ``Shed`` when

- the queue is full (``queue_full``); a high-priority arrival instead evicts the
  newest waiting normal request, which is shed with ``evicted``;
- the predicted completion time exceeds what is left of its deadline
  (``predicted_late``): the images ahead of it and itself times the measured
  time per image.

The caller then tries the next model in the chain (see ``rampart.pipeline``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

__all__ = ["Shed", "ThroughputMeter", "AdmissionGate"]


class Shed(Exception):
    """A request was not admitted (or was evicted); ``reason`` is ``queue_full``, ``predicted_late`` or ``evicted``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ThroughputMeter:
    """Images per second of one model, from the busy time of completed batches.

    Each completed image contributes ``inference_ms / batch_size`` (its share of
    its batch's compute time) to an exponentially weighted mean with weight
    ``alpha`` per image, so a batch of 16 moves the estimate about 16 times as far
    as a batch of 1. ``override_ips`` > 0 fixes the value (setting
    ``<model>_throughput_ips``). Before any measurement, ``ips`` is ``None``.
    """

    def __init__(self, override_ips: float = 0.0, alpha: float = 0.05) -> None:
        self.override_ips = override_ips
        self.alpha = alpha
        self._ms_per_image: float | None = None

    def seed(self, ms_per_image: float) -> None:
        """Start from a warm-up measurement (ms per image at full batch) if nothing was measured yet."""
        if self._ms_per_image is None and ms_per_image > 0:
            self._ms_per_image = ms_per_image

    def record(self, batch_size: int, inference_ms: float) -> None:
        """Account for one image answered from a batch of ``batch_size`` that took ``inference_ms``."""
        if batch_size <= 0 or inference_ms <= 0:
            return
        sample = inference_ms / batch_size
        if self._ms_per_image is None:
            self._ms_per_image = sample
        else:
            self._ms_per_image += self.alpha * (sample - self._ms_per_image)

    @property
    def ms_per_image(self) -> float | None:
        """Milliseconds of compute per image, or ``None`` before any measurement."""
        if self.override_ips > 0:
            return 1000.0 / self.override_ips
        return self._ms_per_image

    @property
    def ips(self) -> float | None:
        """Images per second, or ``None`` before any measurement."""
        ms = self.ms_per_image
        return None if ms is None else 1000.0 / ms


@dataclass(order=True)
class _Waiter:
    rank: int  # 0 for high priority, 1 for normal: lower is served first
    seq: int
    turn: asyncio.Future = field(compare=False)


class AdmissionGate:
    """Bounded, priority-ordered, deadline-aware admission to one model.

    ``max_batch_size`` and ``concurrent_batches`` describe the runner;
    ``queue_delay_ms`` is the acceptable queueing delay that sizes the wait queue
    (never below one batch). Use ``async with gate.admit(high, budget_s):`` around
    the runner call, and ``gate.meter.record(...)`` with each answer.
    """

    def __init__(self, name: str, max_batch_size: int, concurrent_batches: int, queue_delay_ms: float,
                 meter: ThroughputMeter) -> None:
        self.name = name
        self.max_batch_size = max_batch_size
        self.window = (concurrent_batches + 1) * max_batch_size
        self.queue_delay_ms = queue_delay_ms
        self.meter = meter
        self.dispatched = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def queue_limit(self) -> int:
        """Most requests that may wait: throughput × ``queue_delay_ms``, at least one batch."""
        ips = self.meter.ips
        if ips is None:
            return self.max_batch_size
        return max(self.max_batch_size, int(ips * self.queue_delay_ms / 1000.0))

    @property
    def queued(self) -> int:
        """Requests waiting in the gate now (not yet dispatched)."""
        return sum(1 for w in self._waiting if not w.turn.done())

    def predicted_s(self, high: bool) -> float:
        """Predicted seconds until a request arriving now with priority ``high`` is answered.

        The images ahead of it (dispatched, plus waiting at its priority or higher)
        and itself, times the measured time per image; 0 before anything was measured.
        """
        ms = self.meter.ms_per_image
        if ms is None:
            return 0.0
        ahead = sum(1 for w in self._waiting if not w.turn.done() and (w.rank == 0 or not high))
        return (self.dispatched + ahead + 1) * ms / 1000.0

    def retry_after_s(self) -> float:
        """Seconds until the current queue has drained, at least 1: for ``Retry-After``."""
        ms = self.meter.ms_per_image or 0.0
        return max(1.0, math.ceil((self.dispatched + self.queued) * ms / 1000.0))

    @asynccontextmanager
    async def admit(self, high: bool, budget_s: float) -> AsyncIterator[None]:
        """Admit one request with ``budget_s`` seconds left, wait for its turn, hold a dispatch slot.

        Raises ``Shed`` at once (queue full, predicted late) or while waiting
        (evicted by a high-priority arrival). Waiting is cancelled with the caller.
        """
        predicted = self.predicted_s(high)
        if predicted > budget_s:
            raise Shed("predicted_late", f"{self.name}: predicted {predicted * 1000:.0f} ms > {budget_s * 1000:.0f} ms left")
        if self.dispatched < self.window and not self.queued:
            self.dispatched += 1
        else:
            await self._wait_turn(high)
        try:
            yield
        finally:
            self.dispatched -= 1
            self._dispatch_next()

    async def _wait_turn(self, high: bool) -> None:
        if self.queued >= self.queue_limit and not (high and self._evict_newest_normal()):
            raise Shed("queue_full", f"{self.name}: {self.queued} requests waiting, the limit is {self.queue_limit}")
        waiter = _Waiter(0 if high else 1, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._waiting, waiter)
        try:
            await waiter.turn
        except BaseException:
            if waiter.turn.done() and not waiter.turn.cancelled() and waiter.turn.exception() is None:
                # granted in the same instant the caller gave up: hand the slot on
                self.dispatched -= 1
                self._dispatch_next()
            waiter.turn.cancel()
            raise

    def _evict_newest_normal(self) -> bool:
        live = [w for w in self._waiting if w.rank == 1 and not w.turn.done()]
        if not live:
            return False
        newest = max(live, key=lambda w: w.seq)
        newest.turn.set_exception(Shed("evicted", f"{self.name}: evicted by a high-priority request"))
        return True

    def _dispatch_next(self) -> None:
        while self._waiting and self.dispatched < self.window:
            waiter = heapq.heappop(self._waiting)
            if not waiter.turn.done():
                self.dispatched += 1
                waiter.turn.set_result(None)
