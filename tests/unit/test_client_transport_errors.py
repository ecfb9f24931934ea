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
