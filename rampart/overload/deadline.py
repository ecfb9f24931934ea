"""Deadlines: one end-to-end budget per request, sliced in one place, passed explicitly everywhere.

A ``Deadline`` is fixed when the request arrives (``X-Deadline-Ms``) and covers
everything from its arrival (first byte, or a load balancer's ``X-Request-Start``:
see ``rampart.api.arrival``) to the answer: waiting before the handler, body upload,
decode, queueing and inference. It carries its slices, all in milliseconds from
the arrival::

    |<------------------------------ budget_ms ------------------------------>|
    |<------- Share.PRIMARY ------->|<- fallback_reserve_ms ->|<- margin_ms ->|
    |<------------------ Share.ALL ------------------------->|

- ``Share.ALL``: everything but the answer margin (``answer_margin_ms`` plus the
  event loop's recent lag, so the answer is sent by the client's deadline): for the
  body, decoding and the fallback;
- ``Share.PRIMARY``: that, less ``fallback_reserve_ms``, which is kept for the
  fallback when the primary is slow.

``remaining_s`` and ``epoch_s`` are the only code that turns a slice into a
duration or an instant. The runners live in other processes, so what crosses to
them is the slice's end as an absolute wall-clock time (``epoch_s``, ``time.time()``
seconds, the runner's ``deadline_epoch_s``), comparable across processes on one host.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, TypeVar

if TYPE_CHECKING:
    from rampart.api.arrival import Arrival
    from rampart.config import Settings

T = TypeVar("T")

__all__ = ["Share", "Deadline", "run_within"]


class Share(enum.Enum):
    """A slice of a request's budget that one step may spend (see the module doc)."""

    #: Everything but the answer margin: body upload, decoding, the fallback.
    ALL = "all"
    #: Everything but the answer margin and the fallback reserve: the primary.
    PRIMARY = "primary"


@dataclass(frozen=True)
class Deadline:
    """A request's budget and its slices (ms), counted from its arrival.

    ``budget_ms`` is the whole budget the client gave, counted from
    ``start_monotonic`` (``time.monotonic()`` s) = ``start_wall`` (``time.time()`` s),
    the request's arrival; ``arrival`` says how that was found (None: when the
    ``Deadline`` was made). ``margin_ms`` is kept back at the end to send the answer,
    ``fallback_reserve_ms`` is kept back from the primary for the fallback. With both
    0 (the defaults) every share is the whole budget.
    """

    budget_ms: float
    start_monotonic: float = field(default_factory=time.monotonic)
    start_wall: float = field(default_factory=time.time)
    arrival: "Arrival | None" = None
    margin_ms: float = 0.0
    fallback_reserve_ms: float = 0.0

    @classmethod
    def sliced(cls, budget_ms: float, arrival: "Arrival", settings: "Settings", loop_lag_ms: float = 0.0) -> "Deadline":
        """The deadline of a request that arrived at ``arrival`` with ``budget_ms`` (ms, already validated).

        Its margin is ``settings.deadlines.answer_margin_ms`` + the lag reserve, its fallback reserve
        ``settings.deadlines.fallback_reserve_ms``. The lag reserve is ``loop_lag_ms`` (the event loop's
        recent lag), but never more than the budget's excess over ``settings.min_deadline_ms``:
        every deadline the server accepts keeps at least ``min_service_ms`` for the work, so a
        lagging loop (a busy neighbour on the host) cannot turn a deadline above the minimum
        into a 429 or a ``deadline_exceeded`` before any work was tried; such an answer may
        leave up to the lag late instead. With ``settings.honour_deadlines`` false (an
        experiment's switch, docs/benchmarks.md, "Ablation") the budget is ``settings.deadlines.max_deadline_ms``
        whatever the client asked for.
        """
        if not settings.honour_deadlines:
            budget_ms = settings.deadlines.max_deadline_ms
        lag_reserve_ms = min(loop_lag_ms, max(budget_ms - settings.min_deadline_ms, 0.0))
        return cls(budget_ms, arrival.monotonic, arrival.wall, arrival,
                   margin_ms=settings.deadlines.answer_margin_ms + lag_reserve_ms,
                   fallback_reserve_ms=settings.deadlines.fallback_reserve_ms)

    def share_ms(self, share: Share = Share.ALL) -> float:
        """Milliseconds from the arrival to the end of ``share``: ``budget_ms`` less the margin (never below 0),
        for ``Share.PRIMARY`` less the fallback reserve too (may be negative)."""
        all_ms = max(self.budget_ms - self.margin_ms, 0.0)
        return all_ms - self.fallback_reserve_ms if share is Share.PRIMARY else all_ms

    def before_handler_ms(self) -> float:
        """Milliseconds between the request's arrival and its handler's start (0 when unknown)."""
        return 0.0 if self.arrival is None else self.arrival.before_handler_ms

    def elapsed_ms(self) -> float:
        """Milliseconds since the request arrived."""
        return (time.monotonic() - self.start_monotonic) * 1000.0

    def remaining_s(self, share: Share = Share.ALL) -> float:
        """Seconds left of ``share`` (default: all the budget but the answer margin); may be negative."""
        return (self.share_ms(share) - self.elapsed_ms()) / 1000.0

    def primary_remaining_s(self) -> float:
        """Seconds left of the primary's share (``remaining_s(Share.PRIMARY)``); may be negative."""
        return self.remaining_s(Share.PRIMARY)

    def epoch_s(self, share: Share = Share.ALL) -> float:
        """The ``time.time()`` instant (s) at which ``share`` ends: a deadline other processes can compare."""
        return self.start_wall + self.share_ms(share) / 1000.0


async def run_within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """The result of ``awaitable`` if it finishes within ``timeout_s`` seconds, else ``asyncio.TimeoutError``.

    Unlike ``asyncio.wait_for`` (Python 3.11), it does not wait for the cancelled
    work to finish unwinding: an HTTP call to a runner may take hundreds of
    milliseconds to tear down under load, and the answer must not wait for that.
    """
    task = asyncio.ensure_future(awaitable)
    del awaitable  # a future is its own task
    try:
        finished = bool((await asyncio.wait([task], timeout=max(timeout_s, 0.0)))[0])
    except asyncio.CancelledError:
        task.cancel()
        raise
    if finished:
        try:
            return task.result()
        finally:  # a raised result's traceback holds this frame, which then must not hold its task: no cycle
            del task
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody waits for it any more
    raise asyncio.TimeoutError(f"not finished within {timeout_s * 1000:.0f} ms")
