"""When a request arrived: the start of its deadline clock.

A request's deadline is counted from the earliest moment the server can know of
it, not from when the handler starts. Between the two lie the kernel's socket
buffers, the event loop's backlog and BentoML's middlewares; on the 2-core
machine under a 256-connection overload that was 60-270 ms per request that the
deadline never saw (measured in the closed-loop overload, docs/benchmarks.md).

- **First byte.** ``rampart.compat.uvicorn_httptools.stamp_arrivals()`` makes uvicorn
  (httptools protocol, the one BentoML runs when ``httptools`` is installed) note
  ``time.monotonic()`` in the ASGI scope (key ``ARRIVAL_KEY``) when the parser sees the
  first byte of each request (``on_message_begin``), for keep-alive connections too, and
  ``HeadLimitedProtocol`` notes the end of its head (key ``HEAD_END_KEY``): the time the
  client took to send the head (``Arrival.head_ms``) is the client's, not the server's.
- **A load balancer's stamp.** ``X-Request-Start: t=<epoch>`` (nginx
  ``"t=${msec}"``, Heroku's router, the New Relic and Datadog convention) is the
  time the request reached the proxy in front. Seconds, milliseconds and
  microseconds since the epoch are told apart by magnitude, as those APM agents
  do. It is taken when it is earlier than the first byte and within a sanity
  bound: not older than ``max_deadline_ms`` (an older stamp is a clock problem,
  not a request) and not more than ``FUTURE_SKEW_MS`` in the future (a stamp up
  to that far ahead counts as now: clocks of two hosts disagree a little).
  Anything else is ignored.

Without either (an ASGI server other than uvicorn+httptools, an in-process
call) the handler's start is used. This module itself imports no server.

**What may wait before admission sees it.** Admission runs at the start of the
handler, behind BentoML's middlewares. ``bound_inflight(limit, refuse, paths)``
puts a counter in front of everything (the app uvicorn calls, with any of its protocols:
``behind_bound``, installed by ``rampart.compat.uvicorn_app``): when ``limit()``
requests to ``paths`` are already in flight in this worker, the next one is
answered by ``refuse`` at once (Rampart: 429 ``overloaded`` with
``Retry-After``), before any middleware runs. Rampart derives ``limit`` from its
admission queues (``Pipeline.inflight_limit``). With HTTP/1.1 keep-alive each
connection has at most one request in flight (uvicorn stops reading a
connection while a pipelined request waits), so a request can wait unseen only
in the kernel's accept queue (``backlog``, sized in ``service.py``) or its
socket buffer, and that time too is counted against its deadline once its first
byte is read.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Collection

from rampart.hangup import serve_until_hang_up
from rampart.heap import IdleTrim

__all__ = ["ARRIVAL_KEY", "HEAD_END_KEY", "FUTURE_SKEW_MS", "Arrival", "arrival_of", "parse_request_start", "bound_inflight",
           "behind_bound", "InflightBound", "HOLD_BODY_BYTES_KEY", "hold_body_bytes", "LARGE_BODY_SHARE",
           "SLOW_WINDOW_MIN_S"]

#: ASGI scope key holding the ``time.monotonic()`` of the request's first byte.
ARRIVAL_KEY = "rampart.first_byte_monotonic"
#: ASGI scope key holding the ``time.monotonic()`` at which the request's head (request line and headers) ended.
HEAD_END_KEY = "rampart.head_end_monotonic"
#: ASGI scope key holding the request's ``hold(size) -> bool`` on the worker's budget of body bytes
#: (``InflightBound``; read through ``hold_body_bytes``).
HOLD_BODY_BYTES_KEY = "rampart.hold_body_bytes"
#: The share of the budget of body bytes (``max_held_body_bytes``) that requests holding more than one
#: upload's worth (``small_body_bytes``) may fill together; the rest stays for single uploads.
LARGE_BODY_SHARE = 0.75
#: A request that held at least this many body bytes leaves freed heap behind (``InflightBound``, "The heap they
#: leave"): glibc serves smaller blocks from its heap and reuses them, so a body under it leaves nothing to give back.
HEAP_TRIM_BODY_BYTES = 1 << 20
#: The shortest window over which a body's recent bytes decide whether it is slow ("Slow holders give way").
SLOW_WINDOW_MIN_S = 1.0
#: Chunks of one body that arrive within this many seconds of each other are noted as one (``_Body.recent``
#: holds at most about window ÷ this entries, however small the reads).
RECENT_BUCKET_S = 0.1
#: An ``X-Request-Start`` stamp up to this far in the future is taken as "now" (clock skew between hosts).
FUTURE_SKEW_MS = 1000.0
_STAMP = re.compile(r"^\s*(?:t=)?\s*(\d{1,20}(?:\.\d{1,9})?)\s*$")


@dataclass(frozen=True)
class Arrival:
    """When a request arrived: ``monotonic`` (``time.monotonic()`` s) and ``wall`` (``time.time()`` s) of
    the same instant, ``before_handler_ms`` (ms from arrival to the handler's start), ``source``:
    ``x-request-start``, ``first-byte`` or ``handler``, and ``head_ms``: ms from the first byte to the end
    of the head, the client's own sending time (0 when not stamped)."""

    monotonic: float
    wall: float
    before_handler_ms: float
    source: str
    head_ms: float = 0.0


def parse_request_start(raw: str | None, now_wall: float) -> float | None:
    """The epoch seconds of an ``X-Request-Start`` value (``t=<epoch s|ms|µs>``), or None when malformed.

    The unit is inferred from magnitude against ``now_wall`` (epoch seconds):
    about 1e9 is seconds, 1e12 milliseconds, 1e15 microseconds.
    """
    if not raw:
        return None
    match = _STAMP.match(raw)
    if match is None:
        return None
    value = float(match.group(1))
    for scale in (1.0, 1e3, 1e6):
        if value / scale < now_wall * 10:  # the first unit that gives a plausible epoch
            return value / scale
    return None


def arrival_of(scope: dict, request_start: str | None, max_age_ms: float) -> Arrival:
    """The arrival of the request with ASGI ``scope`` and ``X-Request-Start`` header ``request_start``.

    The earliest of: the handler's start (now), the first byte (``ARRIVAL_KEY``),
    and ``X-Request-Start`` when it lies within ``max_age_ms`` in the past and
    ``FUTURE_SKEW_MS`` in the future (see the module doc); with the head's sending time
    (``HEAD_END_KEY`` less ``ARRIVAL_KEY``) when both are stamped.
    """
    now_monotonic, now_wall = time.monotonic(), time.time()
    age_s, source = 0.0, "handler"
    first_byte = scope.get(ARRIVAL_KEY)
    if first_byte is not None and now_monotonic - first_byte > 0:
        age_s, source = now_monotonic - first_byte, "first-byte"
    head_end = scope.get(HEAD_END_KEY)
    head_ms = max(head_end - first_byte, 0.0) * 1000.0 if first_byte is not None and head_end is not None else 0.0
    stamp = parse_request_start(request_start, now_wall)
    if stamp is not None:
        stamp_age_s = now_wall - stamp
        if -FUTURE_SKEW_MS / 1000.0 <= stamp_age_s <= max_age_ms / 1000.0 and stamp_age_s > age_s:
            age_s, source = stamp_age_s, "x-request-start"
    return Arrival(now_monotonic - age_s, now_wall - age_s, age_s * 1000.0, source, head_ms)


#: Requests may be receiving their bodies at once, per in-flight place (``InflightBound``): receivers never hold
#: an in-flight place, and one slower than the minimum body rate is cut after the grace, so this bounds only
#: the connections (and the bytes) of bodies on their way.
RECEIVING_PER_INFLIGHT_PLACE = 2


class _BodyStop(BaseException):
    """Raised from a request's ``receive`` to stop its app once the front has answered it (408 or 429):
    a ``BaseException``, so no handler's ``except Exception`` takes it; ``InflightBound`` absorbs it."""


@dataclass
class _Body:
    """One request's body phase at the front: ``started`` (event loop time of its head), ``due`` (event loop
    time by which more of the body must have come; None: no rate check), ``received`` bytes so far,
    ``recent`` (event loop time a bucket began, bytes) of its chunks within the last window, one bucket per
    ``RECENT_BUCKET_S`` (``InflightBound._note_chunk``),
    ``held`` bytes it counts against the worker's budget (received, and whatever its handler holds through
    ``hold_body_bytes``), whether it still ``receiving`` or is ``admitted`` (in flight), ``timer``, the
    ``asyncio.Timeout`` its wait for the next chunk runs under (rescheduled to cut it), and whether it was
    ``cut_for_room`` ("Slow holders give way")."""

    started: float
    due: float | None
    received: int = 0
    recent: deque = field(default_factory=deque)
    held: int = 0
    receiving: bool = True
    admitted: bool = False
    timer: asyncio.Timeout | None = None
    cut_for_room: bool = False


class InflightBound:
    """At most ``limit()`` requests to ``paths`` in flight in this worker; the next gets ``refuse(scope, receive, send)``.

    Sits in front of every middleware (see ``bound_inflight``). A request holds an in-flight place only once
    its body is in: while its body arrives it is *receiving*, bounded apart (``RECEIVING_PER_INFLIGHT_PLACE``
    × ``limit()`` receivers; the next is refused at once), so slow bodies cannot take the places of requests
    whose body has arrived. A body whose last byte completes with every in-flight place taken gets
    ``refuse`` then. With ``min_body_bytes_per_s`` > 0 a body must arrive at that rate after
    ``body_grace_s`` (at time t after the head, at least ``(t − grace) × rate`` bytes), else it is cut:
    ``too_slow(scope, receive, send)`` answers (Rampart: 408 ``request_timeout``, connection closed).
    ``inflight`` is the number of requests in flight now, ``receiving`` those still receiving their body;
    ``refused`` counts refusals (at the head or when the body completed), ``cut`` the slow bodies cut.
    With ``watch_hang_ups`` each request runs under ``rampart.hangup.serve_until_hang_up``: when its
    client goes, it stops and its places are given back at once, and ``gone(scope, stage, seconds)`` is told
    (Rampart: its access line, ``rampart.api.app.log_client_gone``).

    **Bytes held.** With ``over_budget`` and ``max_held_bytes`` > 0, the bytes the requests to ``paths`` hold
    at once are bounded: each body chunk as it arrives, and what a handler adds through
    ``hold_body_bytes(scope, size)`` (an inflated ``/v2`` body), count against ``max_held_bytes`` until
    the request ends (``held`` now; ``over_budget_refused`` counts refusals). A chunk that does not fit
    gets ``over_budget(scope, receive, send)`` (Rampart: 429 ``overloaded``, connection closed); a handler's
    ``hold`` that does not fit returns False. A request that holds more than ``small_body_bytes`` may
    fill only ``LARGE_BODY_SHARE`` of the budget, so large bodies leave room for single uploads, except the
    oldest request holding bytes (of large bodies growing together, the first completes while the later are
    refused), and a request may always hold what its own caps allow while no other request holds any byte.

    **Slow holders give way.** A body that sent most of itself quickly and then stalls (or trickles) is ahead
    of the minimum rate for a long time, and while it waits it holds its bytes: a few dozen such bodies filled
    the budget and every upload was refused until their deadlines. So when a chunk does not fit, the bodies
    still arriving that brought less than ``window × min_body_bytes_per_s`` bytes (at least one) in the last
    ``window`` (``body_grace_s``, at least ``SLOW_WINDOW_MIN_S``), and are older than that window, are cut
    (``too_slow``: 408, connection closed; ``slow_cut_for_room`` counts them), slowest first, as many as it
    takes for the chunk to fit; their bytes leave the budget at once. If cutting all of them would not make
    room, none is cut and the chunk is refused as before. Without contention for the budget nothing changes.

    **The heap they leave.** glibc keeps what large bodies freed (its mmap threshold rises to the largest
    block freed, up to 32 MiB, so later ones come from the heap): after bursts of 19 MB uploads an API worker
    stayed at 482 MiB RSS, against 106 before and 178 once trimmed. With ``heap_trim`` (``rampart.heap.IdleTrim``)
    each request that held at least ``HEAP_TRIM_BODY_BYTES`` marks work when it ends, so the heap is given
    back once no such request has ended for ``heap_trim.idle_s``.
    """

    def __init__(self, limit: Callable[[], int], refuse: Callable[[dict, Callable, Callable], Awaitable[None]],
                 paths: Collection[str], watch_hang_ups: bool = True,
                 too_slow: Callable[[dict, Callable, Callable], Awaitable[None]] | None = None,
                 min_body_bytes_per_s: float = 0.0, body_grace_s: float = 0.0,
                 over_budget: Callable[[dict, Callable, Callable], Awaitable[None]] | None = None,
                 max_held_bytes: int = 0, small_body_bytes: int = 0,
                 gone: Callable[[dict, str, float], None] | None = None, heap_trim: IdleTrim | None = None) -> None:
        self.limit = limit
        self.heap_trim = heap_trim
        self.gone = gone
        self.refuse = refuse
        self.paths = frozenset(paths)
        self.watch_hang_ups = watch_hang_ups
        self.too_slow = too_slow
        self.min_body_bytes_per_s = min_body_bytes_per_s if too_slow is not None else 0.0
        self.body_grace_s = body_grace_s
        self.slow_window_s = max(body_grace_s, SLOW_WINDOW_MIN_S)
        self.over_budget = over_budget
        self.max_held_bytes = max_held_bytes if over_budget is not None else 0
        self.small_body_bytes = small_body_bytes
        self.inflight = 0
        self.receiving = 0
        self.refused = 0
        self.cut = 0
        self.held = 0
        self.over_budget_refused = 0
        self.slow_cut_for_room = 0
        self._holders: dict[int, _Body] = {}  # the requests holding bytes, oldest first
        self._wrapped: dict[int, Callable] = {}

    def hold(self, body: _Body, size: int) -> bool:
        """Count ``size`` more bytes of ``body`` against the budget; False (nothing counted) when they do not fit:
        past ``max_held_bytes``, or past ``LARGE_BODY_SHARE`` of it once ``body`` holds more than
        ``small_body_bytes``, unless ``body`` is the oldest of the requests holding bytes (so that of several
        large bodies growing at once, one completes). A body that alone holds bytes always fits (its own caps
        bound it)."""
        if size and self.max_held_bytes and self.held > body.held:
            room = self.max_held_bytes
            oldest = next(iter(self._holders.values()))
            if body is not oldest and body.held + size > self.small_body_bytes:
                room = int(room * LARGE_BODY_SHARE)
            if self.held + size > room and not self._cut_slow_holders(body, self.held + size - room):
                self.over_budget_refused += 1
                return False
        if size and not body.held:
            self._holders[id(body)] = body
        body.held += size
        self.held += size
        return True

    def _drop_old_buckets(self, body: _Body, now: float) -> None:
        """Drop from ``body.recent`` the buckets whose end is out of the last ``slow_window_s`` before ``now``."""
        while body.recent and body.recent[0][0] + RECENT_BUCKET_S <= now - self.slow_window_s:
            body.recent.popleft()

    def _recent_bytes(self, body: _Body, now: float) -> int:
        """The bytes ``body`` received in the last ``slow_window_s`` before ``now`` (event loop time), counting a
        bucket whole until its end passes out of the window; older buckets leave ``body.recent``."""
        self._drop_old_buckets(body, now)
        return sum(size for _, size in body.recent)

    def _note_chunk(self, body: _Body, now: float, size: int) -> None:
        """Note ``size`` bytes of ``body`` received at ``now`` in ``body.recent``: added to the last bucket when it
        began under ``RECENT_BUCKET_S`` ago (a bucket spans at most that, and counts as recent until its end
        leaves the window: a little longer, never shorter), and buckets past the window dropped, so the log
        stays short whatever the size of the reads."""
        if body.recent and now - body.recent[-1][0] < RECENT_BUCKET_S:
            body.recent[-1] = (body.recent[-1][0], body.recent[-1][1] + size)
        else:
            body.recent.append((now, size))
        self._drop_old_buckets(body, now)

    def _cut_slow_holders(self, needing: _Body, excess: int) -> bool:
        """Cut the slow bodies still arriving (class doc, "Slow holders give way"), slowest first, until ``excess``
        bytes have left the budget; True when they have. Cuts none when all of them together hold less."""
        now = asyncio.get_running_loop().time()
        floor = max(1.0, self.slow_window_s * self.min_body_bytes_per_s)
        slow = []
        for index, other in enumerate(self._holders.values()):
            if (other is needing or not other.receiving or other.timer is None
                    or now - other.started < self.slow_window_s):
                continue
            recent = self._recent_bytes(other, now)
            if recent < floor:
                slow.append((recent, -other.held, index, other))
        if sum(-negative_held for _, negative_held, _, _ in slow) < excess:
            return False
        for _, _, _, other in sorted(slow):
            if excess <= 0:
                break
            excess -= other.held
            self.held -= other.held
            other.held, other.cut_for_room = 0, True
            self._holders.pop(id(other), None)
            other.timer.reschedule(now)  # its wait for the next chunk ends with TimeoutError: 408, closed
            self.slow_cut_for_room += 1
        return True

    def wrap(self, app: Callable) -> Callable:
        """``app`` (an ASGI app) behind this bound; one wrapper per app."""
        wrapped = self._wrapped.get(id(app))
        if wrapped is None:
            async def bounded(scope, receive, send) -> None:
                if scope.get("type") != "http" or scope.get("path") not in self.paths:
                    return await app(scope, receive, send)
                # X-Priority: high gets twice the bound: its place comes from evicting a normal
                # request at admission (rampart.overload.admission), which needs it to get that far.
                limit = self.limit() * (2 if _is_high_priority(scope) else 1)
                has_body = _has_body(scope)
                if self.inflight >= limit or (has_body and self.receiving >= RECEIVING_PER_INFLIGHT_PLACE * limit):
                    self.refused += 1
                    return await self.refuse(scope, receive, send)
                started = asyncio.get_running_loop().time()
                body = _Body(started, started + self.body_grace_s if self.min_body_bytes_per_s > 0 else None)
                scope[HOLD_BODY_BYTES_KEY] = lambda size: self.hold(body, size)
                if has_body:
                    self.receiving += 1
                else:  # nothing to wait for: in flight from its head
                    body.receiving, body.admitted = False, True
                    self.inflight += 1

                async def receive_body() -> dict:
                    if not body.receiving:
                        return await receive()
                    try:
                        async with asyncio.timeout_at(body.due) as body.timer:
                            message = await receive()
                        if body.cut_for_room:  # its chunk came in the same turn of the loop as the cut
                            raise TimeoutError
                    except TimeoutError:
                        self._stop_receiving(body)
                        self.cut += 1
                        await (self.too_slow or self.over_budget)(scope, receive, send)  # a cut for room: no rate
                        raise _BodyStop from None
                    finally:
                        body.timer = None
                    if message.get("type") != "http.request":
                        return message  # a disconnect: the handler's own body read reports it
                    size = len(message.get("body", b""))
                    if not self.hold(body, size):
                        self._stop_receiving(body)
                        await self.over_budget(scope, receive, send)
                        raise _BodyStop
                    body.received += size
                    if size and self.max_held_bytes:
                        self._note_chunk(body, asyncio.get_running_loop().time(), size)
                    if self.min_body_bytes_per_s > 0:  # due when (t - grace) x rate passes what came
                        body.due = started + self.body_grace_s + body.received / self.min_body_bytes_per_s
                    if not message.get("more_body", False):
                        self._stop_receiving(body)
                        if self.inflight >= limit:
                            self.refused += 1
                            await self.refuse(scope, receive, send)
                            raise _BodyStop
                        self.inflight += 1
                        body.admitted = True
                    return message

                try:
                    if self.watch_hang_ups:  # a client that goes takes its request with it (rampart.hangup)
                        await serve_until_hang_up(app, scope, receive_body, send,
                                                  lambda stage: self._client_gone(scope, started, stage))
                    else:
                        await app(scope, receive_body, send)
                except _BodyStop:
                    pass
                finally:
                    self._stop_receiving(body)
                    if self.heap_trim is not None and body.held >= HEAP_TRIM_BODY_BYTES:
                        self.heap_trim.worked()
                    self.held -= body.held
                    self._holders.pop(id(body), None)
                    if body.admitted:
                        self.inflight -= 1

            bounded._rampart_bound = self
            wrapped = self._wrapped[id(app)] = bounded
        return wrapped

    def _client_gone(self, scope: dict, started: float, stage: str) -> None:
        """A request whose client hung up at ``stage`` (``rampart.hangup``): counted in
        ``rampart_client_gone_total``, then handed to ``gone(scope, stage, seconds since it was let in)``."""
        _count_client_gone(stage)
        if self.gone is not None:
            self.gone(scope, stage, asyncio.get_running_loop().time() - started)

    def _stop_receiving(self, body: _Body) -> None:
        if body.receiving:
            body.receiving = False
            self.receiving -= 1


def hold_body_bytes(scope: dict, size: int) -> bool:
    """Count ``size`` more bytes against the budget of body bytes of the request with ASGI ``scope`` until it ends
    (``InflightBound``, "Bytes held"); False when they do not fit. True where no bound stands in front."""
    hold = scope.get(HOLD_BODY_BYTES_KEY)
    return True if hold is None else hold(size)


def _count_client_gone(stage: str) -> None:
    from rampart.telemetry import metrics  # here: the decode workers import this module's callers too

    metrics.CLIENT_GONE.labels(stage).inc()


def _has_body(scope: dict) -> bool:
    """Whether the request's head announces a body: a ``Content-Length`` other than 0, or any
    ``Transfer-Encoding`` (chunked), read from the raw ASGI headers."""
    for name, value in scope.get("headers") or ():
        lowered = name.lower()
        if lowered == b"content-length":
            return value.strip() not in (b"0", b"")
        if lowered == b"transfer-encoding":
            return True
    return False


def _is_high_priority(scope: dict) -> bool:
    """Whether the request's ``X-Priority`` header says ``high`` (any case), read from the raw ASGI headers."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"x-priority":
            return value.strip().lower() == b"high"
    return False


_bound: InflightBound | None = None


def bound_inflight(limit: Callable[[], int], refuse: Callable[[dict, Callable, Callable], Awaitable[None]],
                   paths: Collection[str], **options) -> InflightBound:
    """Install (or replace) the in-flight bound that ``behind_bound`` puts in front of the app; returns it.
    The arguments are ``InflightBound``'s."""
    global _bound
    _bound = InflightBound(limit, refuse, paths, **options)
    return _bound


#: Gives, for the app uvicorn serves, the ASGI apps that answer some paths in front of it (``route_at_front``).
_routes_of: Callable[[Callable], dict[str, Callable] | None] | None = None


def route_at_front(routes_of: Callable[[Callable], dict[str, Callable] | None] | None) -> None:
    """Answer some paths in front of the app uvicorn serves: ``routes_of(app)`` gives ``{path: ASGI app}`` for that
    app (asked at each request until it gives a dict; None means "not yet"), and a request to one of those paths
    goes to its ASGI app instead of ``app`` (behind the in-flight bound, if any). None removes the routes of
    apps that have not asked yet. A runner answers its batch calls so
    (``rampart.compat.bentoml_runner_calls``)."""
    global _routes_of
    _routes_of = routes_of


def behind_bound(app: Callable) -> Callable:
    """``app`` (an ASGI app) behind whatever in-flight bound ``bound_inflight`` has installed when each request
    arrives (none: ``app`` itself answers), with the paths ``route_at_front`` gives answered in front of it.
    ``rampart.compat.uvicorn_app`` puts the app uvicorn serves behind it, whichever protocol uvicorn runs
    (httptools or h11)."""
    routes: dict[str, Callable] | None = None

    async def front(scope, receive, send) -> None:
        nonlocal routes
        target = app
        if routes is None and _routes_of is not None:
            routes = _routes_of(app)
        if routes:
            target = routes.get(scope.get("path"), app)
        bound = _bound
        if bound is None:
            return await target(scope, receive, send)
        return await bound.wrap(target)(scope, receive, send)

    front._rampart_front = True
    return front
