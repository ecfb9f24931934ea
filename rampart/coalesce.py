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
- its deadline: an item whose ``deadline_epoch_s`` has passed when its call is formed
  is dropped before the boundary and answered ``expired`` (as the runner's TTL drop
  would, without the trip), and the runner still drops items that expire on the way;
- its own outcome: a call that fails fails each of its items, so every caller's lane
  records its own error (the circuit breaker counts per item); a caller that stops
  waiting before its item is sent takes it out of the queue (it is never sent);
- at most ``max_items`` per call (the runner's ``max_batch_size``).

Plain asyncio, no BentoML: ``send(bucket, items) -> results`` is the runner call.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

__all__ = ["Coalescer", "CoalescerStats"]

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class CoalescerStats:
    """Counts since start: ``calls`` sent, ``items`` sent in them, ``expired`` dropped before sending,
    ``abandoned`` taken back by callers that stopped waiting before their item left."""

    calls: int = 0
    items: int = 0
    expired: int = 0
    abandoned: int = 0

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
    is the item's deadline in ``time.time()`` seconds and ``expired()`` the result that
    stands for a dropped item. ``max_items`` bounds a call (≥ 1), ``in_flight`` the calls
    out per bucket (≥ 1). Raises ``ValueError`` for bounds below 1.
    """

    def __init__(self, send: Callable[[str, list[Item]], Awaitable[list[Result]]],
                 deadline_of: Callable[[Item], float], expired: Callable[[], Result],
                 max_items: int, in_flight: int = 1, clock: Callable[[], float] = time.time) -> None:
        if max_items < 1 or in_flight < 1:
            raise ValueError(f"max_items and in_flight must be at least 1, got {max_items} and {in_flight}")
        self._send, self._deadline_of, self._expired = send, deadline_of, expired
        self.max_items, self.in_flight, self._clock = max_items, in_flight, clock
        self._buckets: dict[str, _Bucket] = {}
        self.stats = CoalescerStats()

    async def call(self, bucket: str, item: Item) -> Result:
        """``item``'s result, sent alone at once or with the items waiting when a call for ``bucket`` returns.

        Raises what ``send`` raised for the call that carried it (or ``RuntimeError`` when
        ``send`` returned the wrong number of results). Cancelled before its item left,
        the item is taken out of the queue and never sent.
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
        """Form one call from what waits (dropping expired items) and send it, if anything is left."""
        now = self._clock()
        batch = []
        while state.waiting and len(batch) < self.max_items:
            item, future = state.waiting.popleft()
            if future.done():
                continue
            if self._deadline_of(item) <= now:
                future.set_result(self._expired())
                self.stats.expired += 1
                continue
            batch.append((item, future))
        if not batch:
            return
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
