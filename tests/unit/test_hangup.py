"""``rampart.hangup``: a request whose client goes after its body stops where it waits and gives its places back.

Driven at the ASGI level (the messages uvicorn sends: the body, then ``http.disconnect`` when the
connection is lost), alone and in front of a real ``Pipeline`` with stand-in models and a real decode pool.
"""

from __future__ import annotations

import asyncio

import pytest

from rampart.config import Settings
from rampart.hangup import serve_until_hang_up, set_stage
from rampart.inputs.buckets import buckets_for_resolution
from rampart.inputs.pool import BoundedPool
from rampart.overload.deadline import Deadline
from rampart.pipeline import ModelEndpoint, Pipeline
from rampart.telemetry import metrics
from tests.support import encode, photo
from tests.unit.standins import LABELS, StandIn


def gone_count(stage: str) -> float:
    return metrics.CLIENT_GONE.labels(stage)._value.get()


def count(stage: str) -> None:
    """What the service does with a hang-up (``rampart.api.arrival``): count it by stage."""
    metrics.CLIENT_GONE.labels(stage).inc()


class Connection:
    """The ASGI side of one connection: the body in one message, then ``http.disconnect`` once ``hang_up()``
    is called (or once the response is complete, as uvicorn does); ``sent`` keeps what the app sent."""

    def __init__(self, body: bytes = b"x") -> None:
        self.body = body
        self.closed = asyncio.Event()
        self.sent: list[dict] = []
        self.delivered = False

    def hang_up(self) -> None:
        self.closed.set()

    async def receive(self) -> dict:
        if not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.closed.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.closed.set()


async def read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


def test_a_client_gone_while_its_request_waits_stops_it_at_once_and_is_counted_by_stage():
    reached = []

    async def app(scope, receive, send):
        await read_body(receive)
        set_stage("queue")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            reached.append("cancelled")
            raise

    async def scenario():
        connection = Connection()
        serving = asyncio.ensure_future(
            serve_until_hang_up(app, {"type": "http"}, connection.receive, connection.send, count))
        await asyncio.sleep(0.05)
        before = gone_count("queue")
        connection.hang_up()
        done, _ = await asyncio.wait([serving], timeout=1.0)  # ends at once, without anyone cancelling it
        assert serving in done and serving.result() is None  # returns normally: the cancellation is absorbed
        return connection, gone_count("queue") - before

    connection, counted = asyncio.run(scenario())
    assert reached == ["cancelled"] and counted == 1 and connection.sent == []


def test_an_answer_already_started_is_not_cancelled_and_other_cancellations_propagate():
    async def answering(scope, receive, send):
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.05)  # the client goes while the body is on its way: nothing to take back
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario():
        connection = Connection()
        serving = asyncio.ensure_future(
            serve_until_hang_up(answering, {"type": "http"}, connection.receive, connection.send))
        await asyncio.sleep(0.01)
        connection.hang_up()
        await serving
        assert [m["type"] for m in connection.sent] == ["http.response.start", "http.response.body"]
        waiting = asyncio.ensure_future(serve_until_hang_up(
            lambda scope, receive, send: asyncio.sleep(3600), {"type": "http"}, Connection().receive, print))
        await asyncio.sleep(0.01)
        waiting.cancel()  # a shutdown, not a client: propagates
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(scenario())


class ClosingTransport:
    """A transport that is closing, as uvloop's is after a failed write and before ``connection_lost`` runs."""

    def is_closing(self) -> bool:
        return self.closing

    def __init__(self, closing: bool) -> None:
        self.closing = closing


class RefusingCycle:
    """A uvicorn-like request cycle (``transport``, bound ``send``) whose writes the event loop refuses, as
    uvloop does on a closed transport."""

    def __init__(self, closing: bool) -> None:
        self.transport = ClosingTransport(closing)
        self.writes = 0

    async def send(self, message: dict) -> None:
        self.writes += 1
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")


def test_an_answer_whose_connection_closed_under_it_is_a_client_gone_not_an_error():
    """A client that pipelined uploads and hung up: its answer's write is refused before uvicorn marks the
    connection lost (it logged ``Exception in ASGI application``). Counted at ``answer``; the rest of the
    answer is not written; a refused write on an open transport is still an error."""
    async def answering(scope, receive, send):
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario():
        before, closed = gone_count("answer"), RefusingCycle(closing=True)
        await serve_until_hang_up(answering, {"type": "http"}, Connection().receive, closed.send, count)
        assert closed.writes == 1 and gone_count("answer") == before + 1
        open_but_refusing = RefusingCycle(closing=False)
        with pytest.raises(RuntimeError, match="unable to perform operation"):
            await serve_until_hang_up(answering, {"type": "http"}, Connection().receive, open_but_refusing.send, count)
        assert gone_count("answer") == before + 1

    asyncio.run(scenario())


def pipeline_with_a_slow_primary(seconds: float) -> tuple[Pipeline, list]:
    calls: list = []
    inner = StandIn(1)

    async def slow(bucket_name, pixels, deadline):
        calls.append(bucket_name)
        await asyncio.sleep(seconds)
        return await inner.call(bucket_name, pixels, deadline)

    primary = ModelEndpoint("primary", "v1", LABELS, buckets_for_resolution(260), slow)
    fallback = ModelEndpoint("fallback", "v1", LABELS, buckets_for_resolution(224), StandIn(2).call)
    return Pipeline(Settings(), primary, fallback, BoundedPool(2, 64)), calls


def test_a_mass_hang_up_gives_every_admission_place_back_and_the_next_upload_gets_the_primary():
    pipeline, calls = pipeline_with_a_slow_primary(0.5)
    data = encode(photo("chelsea"))

    async def app(scope, receive, send):
        body = await read_body(receive)
        answer = await pipeline.classify(body, 3, Deadline(10_000))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": repr(answer["model"]).encode()})

    async def scenario():
        connections = [Connection(data) for _ in range(40)]
        serving = [asyncio.ensure_future(serve_until_hang_up(app, {"type": "http"}, c.receive, c.send, count))
                   for c in connections]
        await asyncio.sleep(0.3)  # decoded, queued for the primary or in its (slow) call
        held = pipeline.primary.gate.queued + pipeline.primary.gate.dispatched
        before = sum(gone_count(stage) for stage in ("decode", "queue", "model"))
        for connection in connections:
            connection.hang_up()
        done, _ = await asyncio.wait(serving, timeout=1.0)
        assert len(done) == len(serving) and all(task.result() is None for task in done)
        after = sum(gone_count(stage) for stage in ("decode", "queue", "model"))
        freed = pipeline.primary.gate.queued + pipeline.primary.gate.dispatched
        answer = await pipeline.classify(data, 3, Deadline(10_000))
        return held, freed, after - before, connections, answer

    held, freed, counted, connections, answer = asyncio.run(scenario())
    assert held >= 8, held  # the 40 uploads held the primary's places
    assert freed == 0 and counted == 40 and all(c.sent == [] for c in connections)
    assert answer["model"]["name"] == "primary" and answer["degraded_reason"] is None


def test_a_request_whose_client_hung_up_gets_an_access_line_with_status_499_its_id_class_and_stage():
    """As nginx logs 499: the hang-up is counted and written to the access log with the id its handler used
    (``X-Request-Id`` absent: the id the handler made), its class (``X-Priority``) and where it waited."""
    import json
    import logging

    from starlette.requests import Request

    from rampart.api import http
    from rampart.api.app import log_client_gone
    from rampart.api.arrival import InflightBound

    lines, ids = [], []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(record.getMessage()))

    async def app(scope, receive, send):
        await read_body(receive)
        ids.append(http.request_id_of(Request(scope)))  # what a handler does first
        set_stage("queue")
        await asyncio.sleep(3600)

    async def refuse(scope, receive, send):
        raise AssertionError("refused")

    async def scenario():
        bounded = InflightBound(lambda: 4, refuse, ["/classify"], gone=log_client_gone).wrap(app)  # as service.py
        connection = Connection()
        request = {"type": "http", "method": "POST", "path": "/classify", "query_string": b"",
                   "headers": [(b"x-priority", b"Low"), (b"content-length", b"1")]}
        serving = asyncio.ensure_future(bounded(request, connection.receive, connection.send))
        await asyncio.sleep(0.05)
        before = gone_count("queue")
        connection.hang_up()
        await asyncio.wait_for(serving, 1.0)
        return gone_count("queue") - before, connection

    keep = Keep()
    logging.getLogger("rampart.access").addHandler(keep)
    try:
        counted, connection = asyncio.run(scenario())
    finally:
        logging.getLogger("rampart.access").removeHandler(keep)
    assert counted == 1 and connection.sent == []
    assert len(lines) == 1, lines
    line = lines[0]
    assert (line["status"], line["code"], line["path"], line["priority"], line["stage"]) == (
        499, "client_disconnected", "/classify", "low", "queue"), line
    assert line["request_id"] == ids[0] and line["duration_ms"] >= 40, line
