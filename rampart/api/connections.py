"""The front door: what a request may hold while its body arrives, and what happens when its client goes.

``RequestGuard`` sits in front of every middleware (``front``, installed on uvicorn's
app by ``rampart.api.headlimit.serve_behind_front``) for the routes that reach admission
(``service.ADMITTED_ROUTES``). Per API worker it keeps:

- **The in-flight bound** (``limit()``, Rampart: ``Classifier.inflight_limit``): a request
  arriving when ``limit()`` requests are in flight is answered 429 by ``refuse`` before any
  middleware runs (an ``X-Priority: high`` one is held to twice the bound: its place comes
  from evicting a normal request at admission). A request is *in flight* from its arrival
  to its answer, except while its body is still arriving: a slow upload holds no in-flight
  place.
- **The body bound** (``body_limit()``): at most that many requests may be receiving their
  body at once. One more cuts the slowest of them (the lowest average rate among those
  receiving for at least ``EVICTABLE_AFTER_S``) with 408 ``request_timeout``; when none is
  that old, the newcomer is refused 429. So slow senders can neither fill the in-flight
  bound nor keep a fast upload out.
- **The body rate** (``min_rate_bps`` after ``grace_s``, ``body_too_slow``): a body whose
  average rate since the request's head falls below the minimum once the grace period has
  passed is cut with 408 ``request_timeout``. One timer per receiving request, set for the
  moment its bytes so far would fall below the minimum; no periodic sweep.
- **Client gone.** Once the body is in, a watcher task waits on the ASGI ``receive``
  channel, where the server reports ``http.disconnect`` when the connection closes. If that
  comes before the answer, the request's task is cancelled wherever it waits (for a decoder,
  in a model's admission queue, before dispatch), so its decode worker, admission tickets and
  in-flight place are given back at once (their ``finally`` blocks), and nothing is sent to a
  model for it. A disconnect while the body arrives ends the request as before (499).
  Each is counted in ``rampart_client_gone_total{stage}``: ``body``, ``decode`` (from the
  body's end until a model's queue: admission and decoding), ``queue`` (waiting for a turn at
  a model) or ``model`` (already dispatched: the model computes it, the answer is dropped).
  ``enter_stage`` is how the pipeline says where a request is.

A cut request's task is cancelled and answered here with ``answer(scope, receive, send,
error)`` (Rampart: ``rampart.api.app.refuse_before_admission``, which counts and logs it),
with ``Connection: close`` when its body is unread. Everything is plain asyncio on the
ASGI interface, so it works under any ASGI server and in-process tests.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Awaitable, Callable, Collection

from rampart.errors import BodyTimeout, ClientDisconnected, Overloaded, RampartError
from rampart.telemetry import metrics

__all__ = ["EVICTABLE_AFTER_S", "STAGES", "Watch", "RequestGuard", "too_slow", "next_rate_check_s", "enter_stage",
           "front", "install_guard", "current_guard", "install_monitoring"]

#: A receiving request may be cut to make room for another once it has been receiving this long (s):
#: before that its rate says little (its first bytes may not have been read yet).
EVICTABLE_AFTER_S = 0.5
#: Where a request can be when its client goes (label ``stage`` of ``rampart_client_gone_total``).
STAGES = metrics.CLIENT_GONE_STAGES

Refuse = Callable[[dict, Callable, Callable], Awaitable[None]]
Answer = Callable[[dict, Callable, Callable, RampartError], Awaitable[None]]

_CURRENT: contextvars.ContextVar["Watch | None"] = contextvars.ContextVar("rampart_request_watch", default=None)


def too_slow(received_bytes: int, elapsed_s: float, min_rate_bps: float, grace_s: float) -> bool:
    """Whether a body of which ``received_bytes`` arrived in ``elapsed_s`` seconds since the request's head is
    below ``min_rate_bps`` (bytes/s, on average) after the grace period ``grace_s``; never with a rate of 0 (off)."""
    return min_rate_bps > 0 and elapsed_s >= grace_s and received_bytes < min_rate_bps * elapsed_s


def next_rate_check_s(received_bytes: int, min_rate_bps: float, grace_s: float) -> float:
    """Seconds after the head at which ``received_bytes`` would fall below ``min_rate_bps``: when ``too_slow``
    can first become true if nothing more arrives (at least ``grace_s``)."""
    return max(grace_s, received_bytes / min_rate_bps)


def enter_stage(stage: str) -> None:
    """Note that the current request (if the front door watches it) is now at ``stage`` (one of ``STAGES``)."""
    watch = _CURRENT.get()
    if watch is not None:
        watch.stage = stage


class Watch:
    """One request behind a ``RequestGuard``: its task, when it arrived (``started``, ``time.monotonic()``),
    body bytes ``received``, whether it is ``receiving`` (body still arriving), its ``stage``, and ``cut``:
    the error it was cut with (None while it runs)."""

    def __init__(self, guard: "RequestGuard", high: bool) -> None:
        self.guard = guard
        self.high = high
        self.task = asyncio.current_task()
        self.started = time.monotonic()
        self.received = 0
        self.receiving = False
        self.body_done = False
        self.responded = False  # the answer has started: too late to cut
        self.stage = "body"
        self.cut: RampartError | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.watcher: asyncio.Task | None = None

    def rate_bps(self, now: float) -> float:
        """Average body rate so far, bytes per second since the head."""
        return self.received / max(now - self.started, 1e-6)

    def cut_with(self, error: RampartError) -> None:
        """Stop the request: its task is cancelled and the front door answers ``error`` (no-op once answering)."""
        if self.cut is not None or self.responded or self.task is None or self.task.done():
            return
        self.cut = error
        self.task.cancel()

    def receive_from(self, receive: Callable) -> Callable:
        async def watched_receive() -> dict:
            message = await receive()
            if self.body_done:
                return message
            kind = message["type"]
            if kind == "http.request":
                self.received += len(message.get("body", b""))
                if message.get("more_body", False):
                    if not self.receiving:
                        self.guard._start_receiving(self)
                        if self.cut is not None:  # refused a body place: the cancellation lands here
                            await asyncio.sleep(0)
                else:
                    self._body_arrived(receive)
            elif kind == "http.disconnect" and not self.responded:
                metrics.CLIENT_GONE.labels("body").inc()
            return message

        return watched_receive

    def send_to(self, send: Callable) -> Callable:
        async def watched_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.responded = True
            await send(message)

        return watched_send

    def _body_arrived(self, receive: Callable) -> None:
        self.body_done = True
        if self.receiving:
            self.guard._stop_receiving(self)
        self.stage = "decode"
        self.watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Callable) -> None:
        """After the body, the channel only says ``http.disconnect``: the client went away, or the answer was sent."""
        message = await receive()
        if message["type"] == "http.disconnect" and not self.responded and self.cut is None:
            metrics.CLIENT_GONE.labels(self.stage).inc()
            self.cut_with(ClientDisconnected(f"the client closed the connection while its request was at {self.stage}"))

    def close(self) -> None:
        """The request has ended: give back its places, stop its timer and watcher."""
        if self.receiving:
            self.guard._stop_receiving(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.watcher is not None and not self.watcher.done():
            self.watcher.cancel()


class RequestGuard:
    """The in-flight bound, the body bound and rate, and client-gone handling for ``paths`` (module doc).

    ``limit()``: most requests in flight (body in or not yet reading it); ``body_limit()``: most
    requests receiving their body; ``min_rate_bps`` (0: off) and ``grace_s``: the body rate rule.
    ``refuse(scope, receive, send)`` answers a request over the in-flight bound (429);
    ``answer(scope, receive, send, error)`` answers a cut one (default: ``refuse``'s answer for
    ``Overloaded``, nothing else). Counters: ``inflight``, ``receiving`` (the ``senders``),
    ``refused``, ``cut`` (by error code).
    """

    def __init__(self, limit: Callable[[], int], refuse: Refuse, paths: Collection[str], *,
                 answer: Answer | None = None, body_limit: Callable[[], int] | None = None,
                 min_rate_bps: float = 0.0, grace_s: float = 2.0) -> None:
        self.limit = limit
        self.refuse = refuse
        self.answer = answer
        self.paths = frozenset(paths)
        self.body_limit = body_limit or (lambda: max(1, self.limit() // 2))
        self.min_rate_bps = min_rate_bps
        self.grace_s = grace_s
        self.inflight = 0
        self.senders: dict[Watch, None] = {}  # requests receiving their body, in arrival order
        self.refused = 0
        self.cuts: dict[str, int] = {}
        self._wrapped: dict[int, Callable] = {}

    def state(self) -> dict:
        """For ``GET /stats``: requests ``in_flight`` and ``receiving`` (their body) now, the two ``limit`` s, and
        ``refused`` (over the in-flight bound) and ``cut`` (by error code) so far."""
        return {"in_flight": self.inflight, "in_flight_limit": self.limit(), "receiving": len(self.senders),
                "receiving_limit": self.body_limit(), "refused": self.refused, "cut": dict(self.cuts)}

    @property
    def receiving(self) -> int:
        """Requests whose body is still arriving."""
        return len(self.senders)

    def wrap(self, app: Callable) -> Callable:
        """``app`` (an ASGI app) behind this guard; one wrapper per app."""
        wrapped = self._wrapped.get(id(app))
        if wrapped is None:
            async def guarded(scope, receive, send) -> None:
                if scope.get("type") != "http" or scope.get("path") not in self.paths:
                    return await app(scope, receive, send)
                return await self.handle(app, scope, receive, send)

            wrapped = self._wrapped[id(app)] = guarded
        return wrapped

    async def handle(self, app: Callable, scope: dict, receive: Callable, send: Callable) -> None:
        """Run ``app`` for one request to the guarded paths (already matched), or refuse it."""
        high = _is_high_priority(scope)
        if self.inflight >= self.limit() * (2 if high else 1):
            self.refused += 1
            return await self.refuse(scope, receive, send)
        watch = Watch(self, high)
        self.inflight += 1
        token = _CURRENT.set(watch)
        try:
            await app(scope, watch.receive_from(receive), watch.send_to(send))
        except asyncio.CancelledError:
            if watch.cut is None or watch.task.uncancel() > 0:
                raise  # not ours (the server is stopping): let it through
            await self._answer_cut(watch, scope, receive, send)
        finally:
            watch.close()  # a request still receiving goes back into the in-flight count first
            self.inflight -= 1
            _CURRENT.reset(token)

    async def _answer_cut(self, watch: Watch, scope: dict, receive: Callable, send: Callable) -> None:
        error = watch.cut
        self.cuts[error.code] = self.cuts.get(error.code, 0) + 1
        if watch.responded:
            return
        if self.answer is not None:
            await self.answer(scope, receive, send, error)
        elif isinstance(error, Overloaded):
            await self.refuse(scope, receive, send)

    def _start_receiving(self, watch: Watch) -> None:
        """``watch``'s body is still arriving: it leaves the in-flight count for a body place (module doc)."""
        now = time.monotonic()
        if len(self.senders) >= self.body_limit():
            victim = self._slowest(now)
            if victim is None:
                watch.cut_with(Overloaded("too many uploads are arriving at once; retry later", 1.0))
                return
            victim.cut_with(BodyTimeout(
                f"the body arrived at {victim.rate_bps(now):.0f} bytes/s, the slowest of "
                f"{len(self.senders)} uploads arriving at once; another needed its place"))
            self._stop_receiving(victim)
        watch.receiving = True
        self.senders[watch] = None
        self.inflight -= 1
        if self.min_rate_bps > 0:
            self._schedule_rate_check(watch)

    def _stop_receiving(self, watch: Watch) -> None:
        """``watch`` no longer receives (its body is in, or it was cut): back into the in-flight count."""
        if not watch.receiving:
            return
        watch.receiving = False
        del self.senders[watch]
        self.inflight += 1
        if watch.timer is not None:
            watch.timer.cancel()
            watch.timer = None

    def _slowest(self, now: float) -> Watch | None:
        """The receiving request with the lowest average rate among those receiving for ``EVICTABLE_AFTER_S``."""
        old = [w for w in self.senders if now - w.started >= EVICTABLE_AFTER_S and w.cut is None]
        return min(old, key=lambda w: w.rate_bps(now), default=None)

    def _schedule_rate_check(self, watch: Watch) -> None:
        at = watch.started + next_rate_check_s(watch.received, self.min_rate_bps, self.grace_s)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        watch.timer = loop.call_at(loop.time() + max(at - now, 0.001), self._check_rate, watch)

    def _check_rate(self, watch: Watch) -> None:
        watch.timer = None
        if not watch.receiving:
            return
        elapsed = time.monotonic() - watch.started
        if too_slow(watch.received, elapsed, self.min_rate_bps, self.grace_s):
            watch.cut_with(BodyTimeout(
                f"the body arrived at {watch.rate_bps(time.monotonic()):.0f} bytes/s; the minimum is "
                f"{self.min_rate_bps:.0f} bytes/s after {self.grace_s:g} s"))
            self._stop_receiving(watch)
        else:
            self._schedule_rate_check(watch)


def _is_high_priority(scope: dict) -> bool:
    """Whether the request's ``X-Priority`` header says ``high`` (any case), read from the raw ASGI headers."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"x-priority":
            return value.strip().lower() == b"high"
    return False


_guard: RequestGuard | None = None


def install_guard(guard: RequestGuard | None) -> RequestGuard | None:
    """Make ``guard`` the one ``front`` puts in front of the app (None: none); returns it."""
    global _guard
    _guard = guard
    return guard


def current_guard() -> RequestGuard | None:
    """The guard ``front`` uses now."""
    return _guard


_monitoring = None


def install_monitoring(lane) -> None:
    """Make ``lane`` (a ``rampart.api.monitoring.MonitoringLane``, or None) the one ``front`` answers monitoring with."""
    global _monitoring
    _monitoring = lane


def front(app: Callable) -> Callable:
    """``app`` behind whatever guard and monitoring lane are installed when each request arrives
    (``install_guard``, ``install_monitoring``)."""

    async def front_door(scope, receive, send) -> None:
        guard, lane = _guard, _monitoring
        if guard is not None and scope.get("type") == "http" and scope.get("path") in guard.paths:
            return await guard.handle(app, scope, receive, send)
        if lane is not None and lane.wants(scope):
            return await lane.handle(app, scope, receive, send)
        return await app(scope, receive, send)

    front_door._rampart_front = True
    return front_door
