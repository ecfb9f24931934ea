"""The front door (``rampart.api.connections``): the body-rate rule, the in-flight and body bounds' accounting,
and client-gone handling, on raw ASGI channels shaped like uvicorn's and on the real app with stand-in models.
The end-to-end tests are in ``tests/server/test_connections.py``."""

from __future__ import annotations

import asyncio
import time

import pytest

from rampart.api import connections
from rampart.api.app import create_app, refuse_before_admission
from rampart.api.connections import RequestGuard, next_rate_check_s, too_slow
from rampart.api.lifecycle import Lifecycle
from rampart.config import Settings
from rampart.errors import BodyTimeout, ClientDisconnected, Overloaded
from rampart.pipeline import Classifier, decode_pool
from rampart.telemetry import metrics
from tests.support import encode, photo
from tests.unit.standins import StandIn


class Channel:
    """One request's ASGI channel as uvicorn keeps it: body chunks pushed by ``feed``, then (after the body or
    the answer) only ``http.disconnect``, which ``hang_up`` also brings at once; ``sent`` holds the answer."""

    def __init__(self, path: str = "/classify", headers: list | None = None) -> None:
        self.scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": headers or []}
        self.chunks: list[tuple[bytes, bool]] = []
        self.event = asyncio.Event()
        self.gone = self.answered = False
        self.sent: list[dict] = []

    def feed(self, body: bytes, more: bool = False) -> None:
        self.chunks.append((body, more))
        self.event.set()

    def hang_up(self) -> None:
        self.gone = True
        self.event.set()

    async def receive(self) -> dict:
        while not (self.chunks or self.gone or self.answered):
            self.event.clear()
            await self.event.wait()
        if self.gone or self.answered:
            return {"type": "http.disconnect"}
        body, more = self.chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": more}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.answered = True
            self.event.set()

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)


def test_the_rate_rule_counts_from_the_head_after_the_grace_period():
    assert not too_slow(0, 1.9, 1000, 2.0)  # within the grace period anything goes
    assert too_slow(1999, 2.0, 1000, 2.0) and not too_slow(2000, 2.0, 1000, 2.0)
    assert not too_slow(0, 100.0, 0, 2.0)  # a rate of 0 turns the rule off
    assert next_rate_check_s(0, 1000, 2.0) == 2.0 and next_rate_check_s(5000, 1000, 2.0) == 5.0
    # The next check is the first moment the rule can bite if nothing more arrives.
    at = next_rate_check_s(5000, 1000, 2.0)
    assert not too_slow(5000, at - 0.01, 1000, 2.0) and too_slow(5000, at + 0.01, 1000, 2.0)


def answers() -> tuple[list, callable]:
    """An ``answer`` callback that records the errors and sends their status."""
    errors: list = []

    async def answer(scope, receive, send, error=None):
        errors.append(error)
        await send({"type": "http.response.start", "status": 429 if error is None else error.status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return errors, answer


async def reader(scope, receive, send):
    """An app that reads the whole body, then answers 200."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_body_still_arriving_holds_a_body_place_not_an_in_flight_place():
    async def scenario():
        errors, answer = answers()
        guard = RequestGuard(lambda: 2, answer, ["/classify"], answer=answer, body_limit=lambda: 10)
        app = guard.wrap(reader)
        slow = [Channel() for _ in range(5)]
        tasks = [asyncio.create_task(app(c.scope, c.receive, c.send)) for c in slow]
        for channel in slow:
            channel.feed(b"x", more=True)
        await asyncio.sleep(0.01)
        assert (guard.inflight, guard.receiving) == (0, 5)  # five slow bodies, none in flight
        fast = Channel()
        fast.feed(b"whole body")
        await app(fast.scope, fast.receive, fast.send)
        assert fast.status == 200 and guard.refused == 0
        for channel in slow:
            channel.feed(b"end")
        await asyncio.gather(*tasks)
        return guard, slow

    guard, slow = asyncio.run(scenario())
    assert [c.status for c in slow] == [200] * 5 and (guard.inflight, guard.receiving) == (0, 0)


def test_a_full_body_bound_cuts_the_slowest_old_sender_else_refuses_the_newcomer(monkeypatch):
    monkeypatch.setattr(connections, "EVICTABLE_AFTER_S", 0.05)

    async def scenario():
        errors, answer = answers()
        guard = RequestGuard(lambda: 100, answer, ["/classify"], answer=answer, body_limit=lambda: 2)
        app = guard.wrap(reader)
        first, second, third, fourth = (Channel() for _ in range(4))
        tasks = [asyncio.create_task(app(c.scope, c.receive, c.send)) for c in (first, second)]
        first.feed(b"x", more=True)
        second.feed(b"x" * 1000, more=True)
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(app(third.scope, third.receive, third.send)))
        third.feed(b"x", more=True)  # both senders are too young to cut: the newcomer is refused
        await asyncio.sleep(0.1)
        assert third.status == 429 and isinstance(errors[-1], Overloaded)
        tasks.append(asyncio.create_task(app(fourth.scope, fourth.receive, fourth.send)))
        fourth.feed(b"x", more=True)  # now the slowest (first: 1 byte) is cut for it
        await asyncio.sleep(0.01)
        assert first.status == 408 and isinstance(errors[-1], BodyTimeout) and second.status is None
        for channel in (second, fourth):
            channel.feed(b"end")
        await asyncio.gather(*tasks)
        return guard, second, fourth

    guard, second, fourth = asyncio.run(scenario())
    assert (second.status, fourth.status) == (200, 200)
    assert (guard.inflight, guard.receiving) == (0, 0) and guard.cuts == {"overloaded": 1, "request_timeout": 1}


def test_a_body_below_the_minimum_rate_is_cut_with_408_after_the_grace_period():
    async def scenario():
        errors, answer = answers()
        guard = RequestGuard(lambda: 10, answer, ["/classify"], answer=answer, min_rate_bps=1000, grace_s=0.1)
        app = guard.wrap(reader)
        trickle, steady = Channel(), Channel()
        tasks = [asyncio.create_task(app(c.scope, c.receive, c.send)) for c in (trickle, steady)]
        started = time.monotonic()
        trickle.feed(b"x", more=True)
        steady.feed(b"x" * 100, more=True)
        while time.monotonic() - started < 0.3:  # steady sends 100 bytes every 20 ms: 5000 bytes/s
            await asyncio.sleep(0.02)
            steady.feed(b"x" * 100, more=True)
        assert trickle.status == 408 and steady.status is None
        steady.feed(b"end")
        await asyncio.gather(*tasks)
        return guard, steady, errors

    guard, steady, errors = asyncio.run(scenario())
    assert steady.status == 200 and "bytes/s" in errors[0].message and guard.receiving == 0


def test_the_in_flight_bound_still_refuses_over_its_limit():
    async def scenario():
        errors, answer = answers()
        guard = RequestGuard(lambda: 1, answer, ["/classify"], answer=answer)
        app = guard.wrap(reader)
        held, over = Channel(), Channel()
        task = asyncio.create_task(app(held.scope, held.receive, held.send))
        await asyncio.sleep(0.01)  # in flight, its body not read yet
        await app(over.scope, over.receive, over.send)
        held.feed(b"body")
        await task
        return guard, held, over

    guard, held, over = asyncio.run(scenario())
    assert (held.status, over.status, guard.refused, guard.inflight) == (200, 429, 1, 0)


def gone(stage: str) -> float:
    return metrics.CLIENT_GONE.labels(stage)._value.get()


@pytest.mark.parametrize("stage", ["queue", "model", "decode"])
def test_a_client_that_hangs_up_after_its_body_gives_back_every_place_at_once(stage):
    """The real app and pipeline with stand-in models: the request waits in the primary's queue (window full),
    at the model (which takes seconds) or for a decoder (both busy); its client hangs up."""
    settings = Settings(decode_mode="threads", decode_workers=1, primary_throughput_ips=100,
                        fallback_throughput_ips=100)
    primary, fallback = StandIn(best=281), StandIn(best=967)
    primary.delay_s = fallback.delay_s = 5.0

    async def scenario():
        classifier = Classifier(settings, primary.endpoint("rampart-primary", 260),
                                fallback.endpoint("rampart-fallback", 224), decode_pool(settings))
        lifecycle = Lifecycle()
        lifecycle.mark_ready()
        app = create_app(settings, classifier=classifier, lifecycle=lifecycle)
        refuse = refuse_before_admission(app)
        guard = RequestGuard(classifier.inflight_limit, refuse, ["/classify"], answer=refuse)
        front = guard.wrap(app)
        gate = classifier.primary.gate
        held = [gate.reserve(False, 60.0) for _ in range(gate.window)] if stage == "queue" else []
        for ticket in held:
            gate._take(ticket)  # the window is full: the next request waits for its turn
        blocker = None
        if stage == "decode":  # the only decoder is busy: the upload waits for it
            blocker = asyncio.ensure_future(classifier.pool.run(time.sleep, 1.0))
        before = gone(stage)
        channel = Channel(headers=[(b"x-deadline-ms", b"30000")])
        channel.feed(encode(photo("chelsea")))
        task = asyncio.create_task(front(channel.scope, channel.receive, channel.send))
        for _ in range(300):
            await asyncio.sleep(0.01)
            if {"queue": lambda: gate._heap, "model": lambda: primary.calls,
                    "decode": lambda: classifier.pool.pending == 2}[stage]():
                break
        channel.hang_up()
        await task
        # What it waited for is still busy: the places came back without waiting for it.
        still_busy = {"queue": lambda: gate.dispatched == len(held), "model": lambda: classifier.primary.responses == 0,
                      "decode": lambda: not blocker.done()}[stage]()
        state = (guard.inflight, lifecycle.in_flight, gate.queued, classifier.fallback.gate.queued,
                 classifier.pool.pending - (stage == "decode"))
        if blocker is not None:
            await blocker
        return still_busy, state, gone(stage) - before, channel.status

    still_busy, state, counted, status = asyncio.run(scenario())
    assert still_busy and state == (0, 0, 0, 0, 0) and counted == 1, (still_busy, state, counted)
    assert status == ClientDisconnected.status  # logged as 499, nothing reaches the client
    if stage != "model":
        assert primary.calls == 0  # dropped before anything was sent to a model


# -- uvicorn's protocol, patched (rampart.api.headlimit): timed heads, idle keep-alive, the front door --------------

class InProcessServer:
    """uvicorn with ``HeadLimitedProtocol`` (the patched protocol, as ``bentoml serve`` runs it) on a free loopback
    port, in a thread, serving ``app``; ``port``; ``stop()``."""

    def __init__(self, app) -> None:
        import socket
        import threading

        import uvicorn

        from rampart.api.headlimit import HeadLimitedProtocol

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.config = uvicorn.Config(app, http=HeadLimitedProtocol, loop="asyncio", lifespan="off", log_config=None)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def connect(self, timeout_s: float = 5.0):
        import socket

        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


async def hello(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


#: Timeouts of the in-process server (s); a connection not closed within ``NEVER_S`` counts as never closed.
SHORT_S, NEVER_S = 0.3, 5.0
GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture
def timed_server(monkeypatch):
    from rampart.api.headlimit import HeadLimitedProtocol

    monkeypatch.setattr(HeadLimitedProtocol, "head_timeout_s", SHORT_S)
    monkeypatch.setattr(HeadLimitedProtocol, "keep_alive_s", SHORT_S)
    server = InProcessServer(hello)
    yield server
    server.stop()


def get(sock) -> None:
    """One ``GET /`` on ``sock``, its whole answer read (``hello``'s body ends it)."""
    sock.sendall(GET)
    reply = b""
    while not reply.endswith(b"ok"):
        reply += sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200 "), reply


def closed_after(sock, trickle: bytes = b"", every_s: float = 0.05) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock`` (``NEVER_S`` if it does not), sending ``trickle`` a byte at a time
    every ``every_s`` meanwhile; and what the server sent."""
    import socket

    started, reply, sent = time.monotonic(), b"", 0
    sock.settimeout(every_s)
    while time.monotonic() - started < NEVER_S:
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except OSError:
                return time.monotonic() - started, reply
            sent += 1
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - started, reply
        if not chunk:
            return time.monotonic() - started, reply
        reply += chunk
    return NEVER_S, reply


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(timed_server):
    with timed_server.connect() as sock:
        took, reply = closed_after(sock)
    assert took < NEVER_S and reply == b""


def test_a_trickled_head_is_closed_with_a_408_whether_or_not_a_request_came_before(timed_server):
    trickle = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    with timed_server.connect() as sock:
        took, reply = closed_after(sock, trickle)
    assert took < NEVER_S and reply.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in reply
    with timed_server.connect() as sock:
        get(sock)
        took, reply = closed_after(sock, trickle)  # each byte would disarm uvicorn's keep-alive timer
    assert took < NEVER_S and b"HTTP/1.1 408 " in reply


def test_the_trickled_rest_of_an_answered_body_is_closed_after_the_head_timeout(timed_server):
    """``hello`` answers without reading the body: the rest, a byte at a time, would disarm the keep-alive timer."""
    with timed_server.connect() as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nab")
        took, reply = closed_after(sock, b"c" * 200)
    assert took < NEVER_S and reply.startswith(b"HTTP/1.1 200 ") and b"408" not in reply


def test_an_idle_keep_alive_connection_is_closed_and_a_busy_one_is_not(timed_server):
    with timed_server.connect() as sock:
        get(sock)
        took, reply = closed_after(sock)
    assert took < NEVER_S and reply == b""
    with timed_server.connect() as sock:  # requests every SHORT_S / 3 keep it open past several timeouts
        for _ in range(10):
            get(sock)
            time.sleep(SHORT_S / 3)


def test_uvicorn_serves_its_app_behind_the_front_door():
    """``serve_behind_front`` wraps the app uvicorn loads: a guard installed later refuses on its paths."""
    from rampart.api.headlimit import serve_behind_front

    serve_behind_front()
    errors, answer = answers()
    connections.install_guard(RequestGuard(lambda: 0, answer, ["/guarded"], answer=answer))
    server = InProcessServer(hello)
    try:
        assert getattr(server.config.loaded_app, "_rampart_front", False)
        replies = []
        for path in (b"/guarded", b"/other"):
            with server.connect() as sock:
                sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
                replies.append(sock.recv(65536).split(b"\r\n")[0])
    finally:
        connections.install_guard(None)
        server.stop()
    assert replies == [b"HTTP/1.1 429 Too Many Requests", b"HTTP/1.1 200 OK"]


# -- the monitoring lane (rampart.api.monitoring) -----------------------------------------------------------------

def test_monitoring_answers_are_made_once_per_interval_shared_and_never_older_than_their_request():
    from rampart.api.monitoring import MonitoringLane

    async def scenario():
        made = []

        async def stats(scope, receive, send):
            made.append(time.monotonic())
            await asyncio.sleep(0.01)  # like two runner calls
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": str(len(made)).encode()})

        lane = MonitoringLane(["/stats"], interval_s=0.2, max_waiting=30)

        async def get() -> tuple[float, bytes]:
            channel = Channel("/stats")
            channel.scope["method"] = "GET"
            asked = time.monotonic()
            await lane.handle(stats, channel.scope, channel.receive, channel.send)
            return asked, channel.sent[-1]["body"]

        storm = await asyncio.gather(*(get() for _ in range(25)))  # 25 at once: one answer for all
        later = await asyncio.gather(*(get() for _ in range(3)))  # right after: the next answer, an interval later
        refused = Channel("/stats")
        refused.scope["method"] = "GET"
        crowd = [asyncio.ensure_future(get()) for _ in range(30)]
        await asyncio.sleep(0)
        await lane.handle(stats, refused.scope, refused.receive, refused.send)  # the 31st waiting: 429 at once
        await asyncio.gather(*crowd)
        return made, storm, later, refused.status, lane

    made, storm, later, refused, lane = asyncio.run(scenario())
    assert {body for _, body in storm} == {b"1"} and {body for _, body in later} == {b"2"}
    assert made[1] - made[0] >= 0.2 and all(asked <= made[1] for asked, _ in later)  # fresh for its requests
    assert refused == 429 and lane.refused == 1 and lane.made == 3


def test_monitoring_keeps_a_bounded_state_whatever_queries_clients_send(monkeypatch):
    from rampart.api import monitoring

    monkeypatch.setattr(monitoring, "MAX_KEYS", 8)

    async def scenario():
        lane = monitoring.MonitoringLane(["/metrics"], interval_s=0.0)
        for i in range(100):
            channel = Channel("/metrics")
            channel.scope.update(method="GET", query_string=b"name[]=x%d" % i)
            await lane.handle(hello, channel.scope, channel.receive, channel.send)
            assert channel.status == 200
        return lane

    lane = asyncio.run(scenario())
    assert lane.made == 100 and len(lane._last) <= 9 and len(lane._locks) <= 9
