"""Batching before the expensive boundary: images bound for one runner bucket travel together.

Every call to a runner crosses BentoML's dependency proxy (pydantic, pickling, an HTTP
round trip over a Unix socket, the runner's own HTTP stack) and back: about a millisecond
of CPU on each side, whatever the payload. A ``Coalescer`` sits in front of one runner's
calls: per bucket, at most ``in_flight`` calls are out at once, and the images that
arrive meanwhile wait here and go together, as one list of items, when one of those
calls returns. No timer is added: an idle bucket sends at once, a busy one sends what
accumulated during the last call, so the number of round trips falls exactly when the
load rises. The runner still batches adaptively across calls and API workers (BentoML's
batchable API counts a list of items and splits it at ``max_batch_size``).

What each caller keeps:

- its order: items leave in the order they arrived here, which is the admission gate's
  dispatch order (high priority first, then arrival; ``rampart.overload.admission``);
- its deadline: an item whose deadline has passed when its call is formed is dropped
  before the boundary (its caller gets ``ExpiredBeforeSend``, a ``TimeoutError``: no
  answer came from the runner, so it is not the runner's progress either), and the
  runner still drops items that expire on the way. A call carries no more items than
  the model can compute before the earliest deadline among them, at the measured cost
  per item (``item_cost_s``): a model that takes 130 ms an image on a CPU gets a few
  images per call within a 1 s deadline, never 16 that would all come back late;
- its own outcome: a call that fails fails each of its items, so every caller's lane
  records its own error (the circuit breaker counts per item); a caller that stops
  waiting before its item is sent takes it out of the queue (it is never sent);
- at most ``max_items`` per call (the runner's ``max_batch_size``).

Riders: a call formed with fewer than ``fill_to()`` items may be topped up to it by ``top_up(boarding)``
(a ``Boarding``: the call's bucket, room, items, when it is predicted done, and the items still waiting here for
later calls), which returns items already taken elsewhere, each with the future of its result (the low priority
class: ``rampart.overload.admission.AdmissionGate.carry`` says when). They go last in the call, only as many as
fit before the earliest deadline in it, and only riders whose own deadline is after ``done_by`` (when the call,
topped up to ``room`` more, is predicted to be computed), and are counted in ``CoalescerStats.riders``.

Plain asyncio, no BentoML: ``send(bucket, items) -> results`` is the runner call.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

__all__ = ["Boarding", "Coalescer", "CoalescerStats", "ExpiredBeforeSend"]

Item = TypeVar("Item")
Result = TypeVar("Result")


class ExpiredBeforeSend(TimeoutError):
    """The item's deadline passed while it waited for its call: it was never sent to the runner."""


@dataclass(frozen=True)
class Boarding:
    """A call being formed that riders may join (``Coalescer.top_up``): for runner bucket ``bucket``, with
    ``in_call`` items in it and room for ``room`` more; ``done_by`` is when it is predicted computed once topped
    up (``time.time()`` s: now + (``in_call`` + ``room``) × the measured cost per item; now while unmeasured), and
    ``behind`` counts the items waiting in the coalescer, any bucket, for calls that will leave after it (a rider
    would delay them)."""

    bucket: str
    room: int
    in_call: int
    done_by: float
    behind: int


@dataclass
class CoalescerStats:
    """Counts since start: ``calls`` sent, ``items`` sent in them, ``expired`` dropped before sending,
    ``abandoned`` taken back by callers that stopped waiting before their item left, ``riders`` added to calls by
    ``top_up`` (counted in ``items`` too)."""

    calls: int = 0
    items: int = 0
    expired: int = 0
    abandoned: int = 0
    riders: int = 0

    @property
    def items_per_call(self) -> float | None:
        """Mean items per call sent (None before the first)."""
        return self.items / self.calls if self.calls else None


@dataclass
class _Bucket:
    waiting: deque = field(default_factory=deque)  # (item, future), oldest first
    busy: int = 0  # calls out now


class Coalescer(Generic[Item, Result]):
    """Per bucket, at most ``in_flight`` ``send`` calls at once; items that arrive meanwhile share the next.

    ``send(bucket, items)`` must return one result per item, in order. ``deadline_of(item)``
    is the item's deadline in ``time.time()`` seconds. ``max_items`` bounds a call (≥ 1),
    ``in_flight`` the calls out per bucket (≥ 1). ``item_cost_s()`` is the model's
    measured seconds per item (None or 0 while unmeasured: no bound but ``max_items``).
    ``top_up`` and ``fill_to`` (attributes, None and ``lambda: 1`` by default: no riders) add riders
    (module doc). Raises ``ValueError`` for bounds below 1.
    """

    #: ``top_up(boarding) -> [(item, future)]``: at most ``boarding.room`` items to carry in the call
    #: ``boarding`` (a ``Boarding``) describes, each with the future its result is set on and a deadline after
    #: ``boarding.done_by``; None: calls carry no riders.
    top_up: Callable[[Boarding], list[tuple[Item, asyncio.Future]]] | None = None
    #: The number of items a call is topped up to (the runner's compute batch size).
    fill_to: Callable[[], int] = staticmethod(lambda: 1)

    def __init__(self, send: Callable[[str, list[Item]], Awaitable[list[Result]]],
                 deadline_of: Callable[[Item], float], max_items: int, in_flight: int = 1,
                 item_cost_s: Callable[[], float | None] = lambda: None, clock: Callable[[], float] = time.time) -> None:
        if max_items < 1 or in_flight < 1:
            raise ValueError(f"max_items and in_flight must be at least 1, got {max_items} and {in_flight}")
        self._send, self._deadline_of = send, deadline_of
        self.max_items, self.in_flight, self.item_cost_s, self._clock = max_items, in_flight, item_cost_s, clock
        self._buckets: dict[str, _Bucket] = {}
        self.stats = CoalescerStats()

    async def call(self, bucket: str, item: Item) -> Result:
        """``item``'s result, sent alone at once or with the items waiting when a call for ``bucket`` returns.

        Raises ``ExpiredBeforeSend`` when its deadline passed before it was sent, what
        ``send`` raised for the call that carried it (or ``RuntimeError`` when ``send``
        returned the wrong number of results). Cancelled before its item left, the item
        is taken out of the queue and never sent.
        """
        state = self._buckets.setdefault(bucket, _Bucket())
        future = asyncio.get_running_loop().create_future()
        entry = (item, future)
        state.waiting.append(entry)
        if state.busy < self.in_flight:
            self._dispatch(bucket, state)
        try:
            return await future
        except asyncio.CancelledError:
            if not future.done() or future.cancelled():
                try:
                    state.waiting.remove(entry)
                    self.stats.abandoned += 1
                except ValueError:  # already sent: the runner answers it, nobody reads it
                    pass
            raise

    def _dispatch(self, bucket: str, state: _Bucket) -> None:
        """Form one call from what waits (dropping expired items, bounded by ``max_items`` and by what
        can be computed before the earliest deadline in it) and send it, if anything is left."""
        now = self._clock()
        cost_s = self.item_cost_s() or 0.0
        batch: list = []
        earliest = float("inf")
        while state.waiting and len(batch) < self.max_items:
            item, future = state.waiting[0]
            if future.done():
                state.waiting.popleft()
                continue
            deadline = self._deadline_of(item)
            if deadline <= now:
                state.waiting.popleft()
                future.set_exception(ExpiredBeforeSend("the deadline passed before the item was sent"))
                self.stats.expired += 1
                continue
            if batch and cost_s > 0 and now + (len(batch) + 1) * cost_s > min(earliest, deadline):
                break  # one more would make the call late for someone in it: it goes in the next call
            state.waiting.popleft()
            earliest = min(earliest, deadline)
            batch.append((item, future))
        if not batch:
            return
        room = min(self.fill_to(), self.max_items) - len(batch)
        if cost_s > 0:  # riders only where they keep everyone in the call in time
            room = min(room, int((earliest - now) / cost_s) - len(batch))
        if room > 0 and self.top_up is not None:
            behind = sum(len(other.waiting) for other in self._buckets.values())
            riders = self.top_up(Boarding(bucket, room, len(batch), now + (len(batch) + room) * cost_s, behind))
            batch.extend(riders)
            self.stats.riders += len(riders)
        state.busy += 1
        self.stats.calls += 1
        self.stats.items += len(batch)
        asyncio.ensure_future(self._run(bucket, state, batch))

    async def _run(self, bucket: str, state: _Bucket, batch: list) -> None:
        try:
            results = await self._send(bucket, [item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the runner returned {len(results)} results for {len(batch)} items")
        except BaseException as exc:  # every caller hears it: none is stranded
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
        else:
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
        finally:
            state.busy -= 1
            if state.waiting:
                self._dispatch(bucket, state)
