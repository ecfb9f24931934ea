"""Monitoring that cannot slow classification: ``GET /stats`` and ``GET /metrics`` answered in a lane of their own.

Each ``/stats`` asks both runners for their counters (two RPCs) and each ``/metrics``
merges every process's Prometheus files; both run on the API worker's event loop,
the one that reads uploads and answers. Scraped in 20 loops, they raised ordinary
P50/P95 from 44/48 ms to 300/450 ms. ``MonitoringLane`` (in front of every middleware,
``rampart.api.connections.front``) bounds what they can cost, whoever asks how often:

- each (path, query, ``Accept``) has one answer made at a time, at most once per
  ``interval_s`` (setting ``monitoring_interval_ms``, 500: twice a second), so a slow
  ``/stats`` (a runner that does not answer) holds up no ``/metrics``;
- every request waiting when an answer starts to be made gets that answer (its status,
  headers and body replayed): an answer is never older than its request, so a scrape
  right after a request sees it, and a storm of scrapers costs one answer per interval;
- at most ``max_waiting`` requests wait; more are answered 429 ``overloaded`` at once.

A Prometheus server scraping every 15 s never waits; a scrape within ``interval_s`` of
the previous one waits for the rest of the interval.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Collection

from starlette.responses import JSONResponse

from rampart.errors import Overloaded

__all__ = ["MAX_KEYS", "MonitoringLane"]

#: Keys (path, query, ``Accept``) kept before the old ones are dropped: the query and header come from clients.
MAX_KEYS = 64


class MonitoringLane:
    """``GET`` requests to ``paths``, answered as the module doc says; ``made`` counts the answers made by the app,
    ``served`` the requests answered, ``refused`` those over ``max_waiting``."""

    def __init__(self, paths: Collection[str], interval_s: float = 0.5, max_waiting: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.paths = frozenset(paths)
        self.interval_s = interval_s
        self.max_waiting = max_waiting
        self.clock = clock
        self.waiting = 0
        self.made = self.served = self.refused = 0
        self._next: dict[tuple, asyncio.Task] = {}  # per key, the answer not started yet that newcomers wait for
        self._last: dict[tuple, float] = {}  # per key, when its last answer started
        self._locks: dict[tuple, asyncio.Lock] = {}  # one answer at a time per key

    def wants(self, scope: dict) -> bool:
        """Whether this lane answers the request of ``scope``."""
        return scope.get("type") == "http" and scope.get("method") == "GET" and scope.get("path") in self.paths

    async def handle(self, app: Callable, scope: dict, receive: Callable, send: Callable) -> None:
        """Answer one request the lane ``wants`` with a fresh answer of ``app``, made once for all who wait."""
        key = (scope["path"], scope.get("query_string", b""),
               next((v for k, v in scope.get("headers") or () if k == b"accept"), b""))
        if self.waiting >= self.max_waiting:
            self.refused += 1
            error = Overloaded("too many monitoring requests waiting; retry later", 1.0)
            response = JSONResponse(error.to_body(""), status_code=error.status, headers={"Retry-After": "1"})
            return await response(scope, receive, send)
        made = self._next.get(key)
        if made is None:
            if len(self._last) > MAX_KEYS:
                self._forget_old_keys()
            made = self._next[key] = asyncio.get_running_loop().create_task(self._make(key, app, scope))
        self.waiting += 1
        try:
            messages = await asyncio.shield(made)
        finally:
            self.waiting -= 1
        self.served += 1
        for message in messages:
            await send(message)

    def _forget_old_keys(self) -> None:
        """Drop what is kept for keys whose interval is over and that nobody waits for (queries are the client's)."""
        now = self.clock()
        for key in [k for k, at in self._last.items() if at + self.interval_s < now and k not in self._next
                    and not self._locks[k].locked()]:
            del self._last[key], self._locks[key]

    async def _make(self, key: tuple, app: Callable, scope: dict) -> list[dict]:
        """``app``'s answer for ``scope`` as ASGI messages, made when the lane is free and the key's interval is over."""
        try:
            wait_s = self._last.get(key, float("-inf")) + self.interval_s - self.clock()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            async with self._locks.setdefault(key, asyncio.Lock()):
                return await self._make_now(key, app, scope)
        finally:
            if self._next.get(key) is asyncio.current_task():  # it failed before it started
                del self._next[key]

    async def _make_now(self, key: tuple, app: Callable, scope: dict) -> list[dict]:
        del self._next[key]  # from here on, a newcomer waits for the next answer: this one may predate it
        self._last[key] = self.clock()  # set under the key's lock, which _forget_old_keys checks
        self.made += 1
        messages: list[dict] = []
        asked = False

        async def no_body() -> dict:
            nonlocal asked
            if asked:  # a GET has no body; after it only the end of the connection could come
                await asyncio.Event().wait()
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}

        async def keep(message: dict) -> None:
            messages.append(message)

        await app(scope, no_body, keep)
        return messages
