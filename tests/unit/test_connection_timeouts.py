"""``rampart.compat.uvicorn_httptools.HeadLimitedProtocol``'s head and keep-alive timeouts, on a real uvicorn server.

Each test runs uvicorn (``HeadLimitedProtocol`` with short timeouts) on 127.0.0.1 in the test's own
event loop and talks to it with asyncio streams: a connection that sends nothing, or trickles its
head, is closed once the head timeout has passed; an answered keep-alive connection is closed by the
keep-alive timeout, not the head timeout, and its next request's head is timed again. The same on
``bentoml serve``: ``tests/server/test_idle_connections.py``. Last, the same protocol keeps the trailer
fields of a chunked body out of the request's headers, bounds the requests a connection may pipeline, bounds
a trailer section as it bounds a head, and closes a connection whose answered request is still arriving.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import uvicorn

from rampart.compat.uvicorn_httptools import LINGER_S, MAX_HEAD_BYTES, MAX_PIPELINED_REQUESTS, HeadLimitedProtocol

HEAD_S = 0.3
KEEP_ALIVE_S = 0.8
#: Extra time allowed for the loop to get round to a timer (the suite shares its CPUs).
MARGIN_S = 1.0
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


class FastProtocol(HeadLimitedProtocol):
    """``HeadLimitedProtocol`` with short timeouts; remembers its connections."""

    head_timeout_s = HEAD_S
    keep_alive_timeout_s = KEEP_ALIVE_S
    made: list[HeadLimitedProtocol] = []

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        FastProtocol.made.append(self)


async def hello(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serving(test, app=hello, protocol=None, loop_factory=None):
    """Run ``test(port)`` against a uvicorn server of ``app`` with ``protocol`` (default ``FastProtocol``) on
    127.0.0.1, in an event loop from ``loop_factory`` (default asyncio's; ``uvloop.new_event_loop`` is what
    ``bentoml serve`` runs); stop it after."""

    async def run() -> None:
        FastProtocol.made.clear()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, http=protocol or FastProtocol, lifespan="off", log_level="warning",
                                access_log=False)
        server = uvicorn.Server(config)
        serving_task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            await test(listener.getsockname()[1])
        finally:
            server.should_exit = True
            await serving_task

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())


async def closed_after(reader: asyncio.StreamReader) -> float:
    """Seconds until the server closes the connection (EOF or a reset); whatever it sends is skipped."""
    started = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(65536), HEAD_S + KEEP_ALIVE_S + MARGIN_S * 3):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


async def answered(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    await reader.readexactly(2)
    return head


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert HEAD_S - 0.05 <= await closed_after(reader) <= HEAD_S + MARGIN_S
        writer.close()

    serving(test)


def test_a_trickled_head_is_closed_after_the_head_timeout():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def trickle() -> None:
            for byte in REQUEST[:-1]:
                writer.write(bytes([byte]))
                await asyncio.sleep(HEAD_S / 6)

        trickling = asyncio.create_task(trickle())
        assert await closed_after(reader) <= HEAD_S + MARGIN_S
        trickling.cancel()
        writer.close()

    serving(test)


def test_an_answered_connection_is_closed_by_the_keep_alive_timeout_and_the_head_timer_costs_nothing():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        assert (await answered(reader)).startswith(b"HTTP/1.1 200")
        protocol = FastProtocol.made[-1]
        assert protocol._head_timer is None  # cancelled when the head was complete, before the answer
        assert protocol.timeout_keep_alive_task is not None
        idle = await closed_after(reader)
        assert KEEP_ALIVE_S - 0.05 <= idle <= KEEP_ALIVE_S + MARGIN_S  # not the head timeout, which is shorter
        writer.close()

    serving(test)


def test_requests_on_a_kept_alive_connection_are_answered_and_a_later_trickled_head_is_closed():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(3):  # each head in one piece: answered, the connection kept
            writer.write(REQUEST)
            assert (await answered(reader)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(HEAD_S)  # idle longer than a head may take: the keep-alive timer runs instead
        protocol = FastProtocol.made[-1]
        assert len(FastProtocol.made) == 1 and protocol._head_timer is None
        writer.write(REQUEST[:5])  # the next head starts, then stops
        await asyncio.sleep(0.05)
        assert protocol._head_timer is not None and protocol.timeout_keep_alive_task is None
        assert await closed_after(reader) <= HEAD_S + MARGIN_S
        writer.close()

    serving(test)


def test_a_head_that_times_out_behind_a_response_in_progress_closes_after_that_response():
    release = asyncio.Event()

    async def slow(scope, receive, send) -> None:
        await release.wait()
        await hello(scope, receive, send)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        await asyncio.sleep(0.05)
        writer.write(REQUEST[:5])  # the start of a pipelined request that never ends
        await asyncio.sleep(HEAD_S + 0.2)  # its head has timed out while the first request is being answered
        protocol = FastProtocol.made[-1]
        assert not protocol.transport.is_closing()
        release.set()
        head = await answered(reader)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower()
        assert await closed_after(reader) <= MARGIN_S
        writer.close()

    serving(test, slow)


def test_limit_request_heads_takes_both_timeouts_from_the_settings():
    from rampart.compat.uvicorn_httptools import limit_request_heads
    from rampart.config import Settings

    before = HeadLimitedProtocol.head_timeout_s, HeadLimitedProtocol.keep_alive_timeout_s
    assert (Settings().connections.request_head_timeout_ms, Settings().connections.keep_alive_timeout_s) == (10_000, 5.0)
    settings = Settings.from_env({"RAMPART_REQUEST_HEAD_TIMEOUT_MS": "1500", "RAMPART_KEEP_ALIVE_TIMEOUT_S": "2.5"})
    try:
        limit_request_heads(settings)
        assert (HeadLimitedProtocol.head_timeout_s, HeadLimitedProtocol.keep_alive_timeout_s) == (1.5, 2.5)
    finally:
        HeadLimitedProtocol.head_timeout_s, HeadLimitedProtocol.keep_alive_timeout_s = before


def test_trailer_fields_of_a_chunked_body_never_reach_the_request_s_headers():
    """A chunked request whose trailer carries ``X-Priority`` and ``X-Deadline-Ms``, sent in one write (uvicorn
    appended the trailer fields to the scope's headers, so an app that read them after the body saw them)."""
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(list(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nX-Request-Id: from-head\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"4\r\nbody\r\n0\r\nX-Priority: high\r\nX-Deadline-Ms: 1\r\nX-Request-Id: from-trailer\r\n\r\n"
                     + REQUEST)  # and a pipelined request after it: its head is read as usual
        await answered(reader)
        await answered(reader)
        writer.close()

    serving(test, app)
    first, second = ({name for name, _ in headers} for headers in seen)
    assert first == {b"host", b"x-request-id", b"transfer-encoding"}, seen[0]
    assert dict(seen[0])[b"x-request-id"] == b"from-head" and second == {b"host"}, seen


def test_a_connection_pipelining_past_the_bound_gets_the_queued_answers_then_is_closed():
    """2,000 requests in one write (uvicorn queued every one): the one being answered and
    ``MAX_PIPELINED_REQUESTS`` queued behind it are answered in order, the last with ``connection: close``,
    and the connection is closed; nothing past them was parsed. A connection pipelining fewer is served whole."""
    answers: dict[str, list[bytes]] = {}

    async def test(port: int) -> None:
        for name, count in (("flood", 2000), ("within", MAX_PIPELINED_REQUESTS)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(REQUEST * count + (b"" if name == "flood" else b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
            heads = []
            while True:
                try:
                    heads.append(await answered(reader))
                except (asyncio.IncompleteReadError, ConnectionResetError):
                    break
            answers[name] = heads
            writer.close()

    serving(test)
    flood, within = answers["flood"], answers["within"]
    assert len(flood) == 1 + MAX_PIPELINED_REQUESTS, len(flood)
    assert all(head.startswith(b"HTTP/1.1 200") for head in flood)
    assert b"connection: close" in flood[-1].lower() and not any(b"connection: close" in h.lower() for h in flood[:-1])
    assert len(within) == MAX_PIPELINED_REQUESTS + 1 and all(head.startswith(b"HTTP/1.1 200") for head in within)


async def read_body_then_answer(scope, receive, send) -> None:
    """An app that reads the whole request body (as an upload route does), then answers 200 ``ok``."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


CHUNKED_HEAD = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nbody\r\n0\r\n"


@pytest.mark.parametrize("field", [b"X-Trailer: " + b"a" * 4096, b"X-A: b\r\n" * 512], ids=["one_long_field", "many_fields"])
def test_a_trailer_section_past_the_head_limit_is_answered_431_and_closed(field):
    """The trailer section after a chunked body's last chunk, streamed without end while the app waits for the
    body's end (httptools grew one field's value by copying it at every read, with no bound): past
    ``MAX_HEAD_BYTES`` a JSON 431, the connection closed, and the app's own answer never written."""

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(CHUNKED_HEAD)

        async def stream() -> None:
            for _ in range(4 * MAX_HEAD_BYTES // len(field)):
                writer.write(field)
                await writer.drain()
                await asyncio.sleep(0.001)

        streaming = asyncio.create_task(stream())
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 431") and b"connection: close" in head, head
            body = await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            assert json.loads(body)["error"]["code"] == "headers_too_large", body
            assert b"trailer" in body
            assert await closed_after(reader) <= LINGER_S + MARGIN_S
        finally:  # on a failure too: the server's shutdown waits for this connection
            streaming.cancel()
            writer.close()

    serving(test, read_body_then_answer)


@pytest.mark.parametrize("request_start", [
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nbody",  # a declared body still arriving
    CHUNKED_HEAD + b"X-Trailer: ",  # a trailer section that never ends
], ids=["content_length", "chunked_trailer"])
def test_the_rest_of_an_answered_request_does_not_hold_its_connection(request_start):
    """An app that answers without reading the body (``/livez``, a 404), and a client that keeps sending the
    rest of it a byte at a time: each byte cancelled uvicorn's keep-alive timer, and the connection stayed open
    for as long as the client sent. The answer arrives whole, says ``connection: close``, and the connection is
    closed ``LINGER_S`` after it."""

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_start)
        head = await answered(reader)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower(), head

        async def trickle() -> None:
            while True:
                writer.write(b"a")
                await asyncio.sleep(KEEP_ALIVE_S / 8)

        trickling = asyncio.create_task(trickle())
        try:
            assert await closed_after(reader) <= LINGER_S + MARGIN_S
        finally:  # on a failure too: the server's shutdown waits for this connection
            trickling.cancel()
            writer.close()

    serving(test)


@pytest.mark.parametrize("malformed", [
    b"GARBAGE\r\n\r\n",  # a head the parser refuses
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a queued request's broken body
], ids=["head", "queued_body"])
def test_a_malformed_request_behind_pipelined_ones_leaves_their_answers_first_and_in_order(malformed, capfd):
    """Two requests and a malformed third in one write (uvicorn wrote its 400 at once, ahead of the two answers,
    and closed the connection under them: the client took the 400 for the first request's answer). Both are
    answered, in order, the second with ``connection: close``; then the connection ends, and nothing is logged
    as an error."""

    async def slow_hello(scope, receive, send) -> None:
        await asyncio.sleep(0.2)  # still computing when the malformed request is parsed
        await hello(scope, receive, send)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(REQUEST * 2 + malformed)
            heads = [await answered(reader), await answered(reader)]
            assert all(head.startswith(b"HTTP/1.1 200") for head in heads), heads
            assert b"connection: close" in heads[1].lower() and b"connection: close" not in heads[0].lower(), heads
            assert await closed_after(reader) <= MARGIN_S
        finally:
            writer.close()

    serving(test, slow_hello)
    assert "ASGI" not in capfd.readouterr().err


def test_a_keep_alive_client_answered_before_its_upload_arrived_sends_its_next_request_on_a_new_connection():
    """An app that answers before the body has all arrived (a 503 while warming up, a 429): the connection is
    closed after the answer, and the answer said so. Without ``connection: close`` httpx kept the connection
    for its next request, which met the close: "Server disconnected without sending a response"."""

    async def test(port: int) -> None:
        async def upload():  # the body in pieces, the app answering after the first
            for _ in range(4):
                yield b"x" * 16384
                await asyncio.sleep(0.05)

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(3):
                early = await client.post("/", content=upload())
                assert early.status_code == 200 and early.headers["connection"] == "close", early.headers
                await asyncio.sleep(0.05)  # the close has reached the client's pool
                assert (await client.get("/")).status_code == 200
        assert len(FastProtocol.made) == 1 + 3  # each early answer ended its connection (a GET's is kept alive)

    serving(test)


async def slow_hello(scope, receive, send) -> None:
    """Reads the whole request, answers 200 after 0.2 s (a request in progress when the client's FIN comes)."""
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(0.2)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("answer_half_closed", [True, False], ids=["answered", "gone"])
def test_a_client_that_half_closes_after_its_request_is_answered_only_when_hang_ups_are_not_cancelled(
        monkeypatch, answer_half_closed):
    """``shutdown(SHUT_WR)`` after two whole requests: uvicorn closed the transport at the FIN, so nothing could be
    answered. With ``answer_half_closed`` (``cancel_on_hang_up`` false) both answers come, then the close; without
    it (the default) the client is gone, as before, and nothing is answered."""
    monkeypatch.setattr(FastProtocol, "answer_half_closed", answer_half_closed)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbody" + REQUEST)  # one queued behind
        await writer.drain()
        writer.write_eof()
        reply = await asyncio.wait_for(reader.read(), HEAD_S + MARGIN_S * 3)  # to the server's close
        writer.close()
        if answer_half_closed:  # both requests, in order; the last says it closes
            first, _, last = reply.partition(b"ok")
            assert first.startswith(b"HTTP/1.1 200") and b"connection: close" not in first.lower(), reply
            assert last.startswith(b"HTTP/1.1 200") and last.endswith(b"ok"), reply
            assert b"connection: close" in last.lower(), reply
        else:
            assert reply == b"", reply

    serving(test, slow_hello)


class RecordingProtocol(FastProtocol):
    """``FastProtocol`` whose transport records each ``write``."""

    writes: list[bytes] = []

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(_Recording(transport, RecordingProtocol.writes))


class _Recording:
    def __init__(self, transport, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


async def slow_stream(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await asyncio.sleep(0.05)
    await send({"type": "http.response.body", "body": b"first", "more_body": True})
    await send({"type": "http.response.body", "body": b"second"})


def test_an_answers_head_is_written_with_its_body_in_one_write():
    """A process killed between the head and the body left its client a broken answer; written together, the
    kernel has all of it or none. A streamed answer's head goes with its first piece."""

    async def test(port: int) -> None:
        for path in ("/", "/stream"):
            RecordingProtocol.writes.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            await writer.drain()
            answer = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n" if path == "/stream" else b"ok"), 5)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200 OK")
            first = RecordingProtocol.writes[0]
            assert first.startswith(b"HTTP/1.1 200 OK") and first.endswith(b"ok" if path == "/" else b"first\r\n")
            assert len(RecordingProtocol.writes) == (1 if path == "/" else 2), RecordingProtocol.writes

    async def app(scope, receive, send) -> None:
        await (slow_stream if scope["path"] == "/stream" else hello)(scope, receive, send)

    serving(test, app, protocol=RecordingProtocol)


async def large_answer(scope, receive, send) -> None:
    body = b"x" * (1 << 20)
    await asyncio.sleep(0.05)  # as /metrics, which collects in a worker thread
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def test_answers_queued_on_a_connection_the_client_closed_are_dropped_without_an_error(capfd):
    """A client pipelines requests for large answers, never reads them and closes. uvicorn marks only its newest
    request's cycle as disconnected, so the answer being written went on writing: on uvloop, into a closed
    transport, a ``RuntimeError`` and an "Exception in ASGI application" traceback each time. Every unfinished
    cycle of the connection now ends quietly, and the server answers the next connection."""
    import uvloop

    async def test(port: int) -> None:
        client = socket.create_connection(("127.0.0.1", port))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # the answers back up in the server
        client.sendall(REQUEST * 5)
        await asyncio.sleep(0.1)
        client.close()
        await asyncio.sleep(0.3)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        await asyncio.wait_for(reader.readexactly(1 << 20), 5)
        writer.close()
        assert head.startswith(b"HTTP/1.1 200")

    serving(test, large_answer, loop_factory=uvloop.new_event_loop)
    logged = capfd.readouterr().err
    assert "Exception in ASGI application" not in logged and "Traceback" not in logged, logged
