"""Cheap monitoring: ``GET /stats`` costs a bounded amount however often it is scraped.

A scrape competes with classification for the API worker's event loop and the host's
cores. Before, ``/stats`` made two runner calls per scrape (BentoML's
dependency proxy, an HTTP round trip, each runner's own HTTP stack) and ``/metrics``
merged every process's Prometheus files per scrape (prometheus_client's
``MultiProcessCollector``: 10-16 ms of CPU here with three processes, more with more
series and processes). With 20 scraping loops on the 2-core host ordinary ``/classify``
latency went from 44/48 ms (P50/P95) to 300/450 ms.

- ``Refreshed`` keeps, per key (a runner role), the last value a fetch gave and when
  that fetch began. A value younger than ``max_age_s`` is served as it is; an older one
  is fetched again, at most one fetch in flight per key, which every caller arriving
  meanwhile awaits. ``/stats`` takes the runners' counters from one
  (``rampart.api.app.stats``), so a storm of scrapes costs at most one runner call per
  runner per ``stats_runner_refresh_ms``.

Plain asyncio, no BentoML.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

__all__ = ["Refreshed"]

Value = TypeVar("Value")


@dataclass(frozen=True)
class _Fetched(Generic[Value]):
    value: Value
    started: float  # clock() when the fetch that gave it began


class Refreshed(Generic[Value]):
    """Values of ``fetch(key)``, fetched at most once per ``max_age_s`` per key, one fetch in flight per key.

    ``get(key)`` returns ``(value, age_s)``: the last fetched value, when its fetch began less than
    ``max_age_s`` ago (``age_s``: seconds since that fetch began, so the figures are at most that
    old); else the value of a new fetch, which every ``get`` of that key arriving before it ends
    awaits instead of starting its own. ``max_age_s`` 0: every ``get`` that finds no fetch in flight
    starts one. A fetch that raises raises in every ``get`` awaiting it and is not kept (the next
    ``get`` fetches again); a caller cancelled while it waits does not cancel the fetch.
    ``clock`` (seconds, monotonic) is ``time.monotonic`` unless a test gives another.
    """

    def __init__(self, fetch: Callable[[Hashable], Awaitable[Value]], max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_age_s < 0:
            raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
        self.fetch = fetch
        self.max_age_s = max_age_s
        self.clock = clock
        self.fetches = 0  # fetches begun since start
        self._kept: dict[Hashable, _Fetched[Value]] = {}
        self._in_flight: dict[Hashable, asyncio.Task] = {}

    async def get(self, key: Hashable) -> tuple[Value, float]:
        """``(value, age_s)`` of ``key``: kept if younger than ``max_age_s``, else fetched (see the class)."""
        kept = self._kept.get(key)
        if kept is not None and self.clock() - kept.started < self.max_age_s:
            return kept.value, self.clock() - kept.started
        task = self._in_flight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._fetch(key))
            self._in_flight[key] = task
            task.add_done_callback(_retrieve)
        fetched = await asyncio.shield(task)
        return fetched.value, self.clock() - fetched.started

    def clear(self) -> None:
        """Forget every kept value (a fetch in flight still ends, and is kept): the next ``get`` of each key fetches."""
        self._kept.clear()

    async def _fetch(self, key: Hashable) -> _Fetched[Value]:
        started = self.clock()
        self.fetches += 1
        try:
            fetched = _Fetched(await self.fetch(key), started)
        finally:
            del self._in_flight[key]
        self._kept[key] = fetched
        return fetched


def _retrieve(task: asyncio.Task) -> None:
    """Mark a shared task's exception as seen, so one whose waiters were all cancelled logs no warning."""
    if not task.cancelled():
        task.exception()
