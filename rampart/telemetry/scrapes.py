"""Cheap monitoring: ``GET /stats`` and ``GET /metrics`` cost a bounded amount however often they are scraped.

A scrape competes with classification for the API worker's event loop and the host's
cores. Before these two pieces, ``/stats`` made two runner calls per scrape (BentoML's
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
- ``CoalescedMetrics``, an ASGI middleware around BentoML's app, answers ``GET /metrics``
  from shared renderings: each scrape waits for the next rendering that starts after it
  arrived (so it shows every metric written before it arrived, as an unshared scrape
  would), renderings start at most once per ``interval_s`` and never two at once, and
  every scrape waiting for one gets a copy of its response. A storm of scrapes costs at
  most one aggregation per interval; a lone scrape after a quiet interval is rendered at
  once.

Plain asyncio and ASGI, no BentoML.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Refreshed", "CoalescedMetrics", "METRICS_PATH"]

Value = TypeVar("Value")

#: The path BentoML serves its Prometheus exposition on (every process's metrics merged).
METRICS_PATH = "/metrics"


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
        if task is None or task.done():  # done while still here: cancelled before it began (the loop is closing)
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


class CoalescedMetrics:
    """ASGI middleware: ``GET`` ``path`` is answered from renderings shared by the scrapes waiting for them.

    ``app`` renders the exposition (under ``bentoml serve``: BentoML's app, whose ``/metrics``
    merges every process's metric files and whose answer does not depend on the request). A
    scrape joins the next rendering that has not started yet (starting one when there is
    none): it starts once the rendering in progress, if any, has ended and ``interval_s`` has
    passed since the last one began, so it shows every metric written before the scrape
    arrived; every scrape that joined it gets a copy of its response (status, headers, body).
    An error in the rendering reaches every scrape that joined it, as it would have reached
    each alone. Any other method or path, and every request when ``interval_s`` is 0, passes
    through untouched. ``renders`` counts the renderings begun.
    """

    def __init__(self, app: ASGIApp, interval_s: float, path: str = METRICS_PATH,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.app = app
        self.interval_s = interval_s
        self.path = path
        self.clock = clock
        self.renders = 0
        self._next: asyncio.Task | None = None  # the rendering scrapes arriving now join: not started yet
        self._running: asyncio.Task | None = None
        self._last_start = -math.inf

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.interval_s <= 0 or scope["type"] != "http" or scope["method"] != "GET"
                or scope["path"] != self.path):
            await self.app(scope, receive, send)
            return
        if self._next is None or self._next.done():  # done before it began: cancelled (the loop is closing)
            self._next = asyncio.ensure_future(self._render(dict(scope)))
            self._next.add_done_callback(_retrieve)
        for message in await asyncio.shield(self._next):
            # A copy each: a middleware outside may add headers to the message it is given.
            await send({**message, "headers": list(message["headers"])} if "headers" in message else dict(message))

    async def _render(self, scope: Scope) -> list[Message]:
        """Wait for the rendering in progress and the interval, then render once and keep the response's messages."""
        this = asyncio.current_task()
        if self._running is not None:
            await asyncio.wait([self._running])
        wait_s = self._last_start + self.interval_s - self.clock()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self._next, self._running = None, this  # scrapes arriving from now on wait for the next one
        self._last_start = self.clock()
        self.renders += 1
        messages: list[Message] = []
        answered = asyncio.Event()
        request_sent = False

        async def receive() -> Message:
            nonlocal request_sent
            if not request_sent:
                request_sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await answered.wait()
            return {"type": "http.disconnect"}

        async def keep(message: Message) -> None:
            messages.append(message)

        try:
            await self.app(scope, receive, keep)
        finally:
            answered.set()
            self._running = None
        return messages


def _retrieve(task: asyncio.Task) -> None:
    """Mark a shared task's exception as seen, so one whose waiters were all cancelled logs no warning."""
    if not task.cancelled():
        task.exception()
