"""The SDK's errors when no answer comes at all: ``ConnectionFailed`` (nothing listens, or the connection broke) and
``ClientTimeout`` (the client's own timeout), each a ``ServiceError`` with ``status`` None and its own ``code``, from
both transports (httpx in ``Client``, aiohttp in ``AsyncClient``). Before, both were a bare ``ServiceError`` whose
code was empty, so a caller could not tell a server that is down from one that is slow."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from rampart_client import AsyncClient, BackoffPolicy, Client, ClientTimeout, ConnectionFailed, ServiceError
from tests.support import encode, photo

ONE_ATTEMPT = BackoffPolicy(throttle=False, max_attempts=1)
IMAGE = encode(photo("chelsea"))


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.fixture
def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and reads, but never answers; yields its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held, stop = [], threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    listener.close()


def _classify_sync(url: str, timeout: float) -> None:
    with Client(url, timeout=timeout, backoff=ONE_ATTEMPT) as client:
        client.classify(IMAGE)


def _classify_async(url: str, timeout: float) -> None:
    async def call() -> None:
        async with AsyncClient(url, timeout=timeout, backoff=ONE_ATTEMPT) as client:
            await client.classify(IMAGE)

    asyncio.run(call())


@pytest.mark.parametrize("classify", [_classify_sync, _classify_async], ids=["httpx", "aiohttp"])
def test_nothing_listening_is_connection_failed(classify):
    with pytest.raises(ConnectionFailed) as failed:
        classify(f"http://127.0.0.1:{_closed_port()}", 2.0)
    assert isinstance(failed.value, ServiceError) and failed.value.status is None
    assert failed.value.code == "connection_failed"


@pytest.mark.parametrize("classify", [_classify_sync, _classify_async], ids=["httpx", "aiohttp"])
def test_no_answer_within_the_clients_timeout_is_client_timeout(classify, silent_server):
    with pytest.raises(ClientTimeout) as timed_out:
        classify(silent_server, 0.3)
    assert isinstance(timed_out.value, ServiceError) and timed_out.value.status is None
    assert timed_out.value.code == "client_timeout"


@pytest.mark.parametrize("url", ["http://127.0.0.1:3917?x=1", "http://127.0.0.1:3917/#top", "ftp://127.0.0.1",
                                 "127.0.0.1:3000", "http://", "not a url"])
def test_a_server_url_with_a_query_or_without_http_and_a_host_is_refused_at_once(url):
    """``http://h:3917?x=1`` sent every call to ``/`` (a 405) instead of ``/classify``."""
    for make in (lambda: Client(url), lambda: AsyncClient(url)):
        with pytest.raises(ValueError, match="URL"):
            make()


def test_a_server_url_with_a_path_prefix_is_taken():
    with Client("http://127.0.0.1:3000/rampart/") as client:
        assert str(client._http.base_url) == "http://127.0.0.1:3000/rampart/"


def raw_server(answer: bytes):
    """A TCP server on 127.0.0.1 that reads a request head and body, writes ``answer`` as it is and closes; returns
    (its URL, stop)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection = listener.accept()[0]
            except OSError:
                continue
            with connection:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += connection.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += connection.recv(65536)
                connection.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", lambda: (stop.set(), listener.close())


PREDICTION_JSON = (b'{"request_id": "r", "labels": [{"index": 285, "label": "Egyptian cat", "score": 0.9}], '
                   b'"model": {"name": "m", "version": "1"}, "degraded": false, "degraded_reason": null, '
                   b'"timings_ms": {"decode": 1.0, "queue": 0.0, "inference": 1.0, "total": 2.0}}')


@pytest.mark.parametrize("classify", [_classify_sync, _classify_async], ids=["httpx", "aiohttp"])
def test_an_answer_gzipped_by_a_proxy_is_read_by_both_transports(classify):
    """nginx's ``gzip on`` for JSON, or a CDN: aiohttp inflated the body and the SDK handed httpx a response that
    still said ``Content-Encoding: gzip``, which inflated it again: a raw ``httpx.DecodingError``."""
    import gzip

    body = gzip.compress(PREDICTION_JSON)
    url, stop = raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                           b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    try:
        classify(url, 5.0)
    finally:
        stop()


@pytest.mark.parametrize("classify", [_classify_sync, _classify_async], ids=["httpx", "aiohttp"])
@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n" + PREDICTION_JSON[:40],
    b"HTTP/1.1 2OO OK\r\nContent-Length: 2\r\n\r\n{}",
], ids=["answer_cut_short", "garbled_status_line"])
def test_a_connection_that_breaks_mid_answer_is_connection_failed_on_both_transports(classify, answer):
    """aiohttp raised its payload or response errors, which the SDK turned into a bare ``ServiceError`` with an
    empty code; httpx's were ``ConnectionFailed`` already, as docs/api.md says of a connection that broke."""
    url, stop = raw_server(answer)
    try:
        with pytest.raises(ConnectionFailed) as broke:
            classify(url, 5.0)
    finally:
        stop()
    assert broke.value.code == "connection_failed" and broke.value.status is None
