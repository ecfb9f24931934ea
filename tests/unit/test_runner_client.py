"""rampart.runner_client and rampart.compat.bentoml_wire: BentoML's runner-call wire format over Rampart's transport.

A recording HTTP/1.1 server on a Unix socket stands in for a runner (the real runners answer
through this client in every server test). The contract: for the same items, the lean client
sends the request BentoML's own proxy client sends (route, headers, body bytes), and reads an
answer into the same objects, or the same exception for an error status.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _bentoml_impl.client.http import AsyncHTTPClient
from _bentoml_impl.serde import PickleSerde
from bentoml.exceptions import BentoMLException

from rampart.compat.bentoml_wire import RunnerWire, runner_address
from rampart.runner_client import HttpConnectionPool, RunnerClient, RunnerConnectionError
from runners.common import RunnerItem, RunnerResult
from runners.primary import Primary

PICKLE = "application/vnd.bentoml+pickle"


def items(count: int = 2) -> list[RunnerItem]:
    rng = np.random.default_rng(7)
    return [RunnerItem(pixels=rng.integers(0, 256, (260, 260, 3), dtype=np.uint8), deadline_epoch_s=1e10 + i,
                       request_id=f"r{i}") for i in range(count)]


def answer_body(count: int = 2) -> tuple[dict[str, str], bytes]:
    """A runner's answer to ``count`` items, serialised by BentoML's pickle serde as the runner serialises it."""
    results = [RunnerResult(probs=np.full(5, i / 10, np.float32), batch_size=count, inference_ms=1.5)
               for i in range(count)]
    payload = PickleSerde().serialize_value(results)
    return {"content-type": PICKLE, **payload.metadata}, b"".join(bytes(part) for part in payload.data)


class RecordingRunner:
    """An HTTP/1.1 server on a Unix socket that records each request (head lines, body) and answers from
    ``answer(index) -> (status, headers, body, mode)``; mode ``"length"``, ``"chunked"``, or ``"close"``
    (answer with Content-Length, then close the connection without saying so)."""

    def __init__(self, path: str, answer) -> None:
        self.path, self.answer = path, answer
        self.requests: list[tuple[list[str], bytes]] = []
        self.connections = 0

    async def __aenter__(self):
        self.server = await asyncio.start_unix_server(self.handle, self.path)
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[:-2]
                fields = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip() for line in lines[1:]}
                body = await reader.readexactly(int(fields["content-length"]))
                self.requests.append((lines, body))
                status, headers, content, mode = self.answer(len(self.requests) - 1)
                if status is None:  # hang: never answer
                    await asyncio.sleep(3600)
                out = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
                if mode == "chunked":
                    out.append("transfer-encoding: chunked")
                    half = len(content) // 2
                    data = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (content[:half], content[half:]) if c)
                    writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + data + b"0\r\n\r\n")
                else:
                    out.append(f"content-length: {len(content)}")
                    writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + content)
                await writer.drain()
                if mode == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def proxy_client(path: str) -> AsyncHTTPClient:
    """BentoML's own async client of the primary runner, as ``bentoml.depends`` makes it (pickle, no wait)."""
    client = AsyncHTTPClient(f"file://{path}", service=Primary, media_type=PICKLE, server_ready_timeout=0, timeout=5)
    client._setup_endpoints()  # what RemoteProxy does for the dependency's async client
    return client


def ok(index: int, mode: str = "length"):
    headers, body = answer_body()
    return 200, headers, body, mode


@pytest.fixture
def sock(tmp_path) -> str:
    return str(tmp_path / "runner.sock")


def test_the_lean_client_sends_what_bentomls_proxy_sends_and_reads_the_same_answer(sock):
    async def main():
        async with RecordingRunner(sock, ok) as runner:
            remote = proxy_client(sock)
            by_proxy = await remote.square(items())
            by_lean = await RunnerClient(remote, runner_address(remote)).call("square", items())
            await remote.close()
            return runner.requests, by_proxy, by_lean

    requests, by_proxy, by_lean = asyncio.run(main())
    (proxy_head, proxy_body), (lean_head, lean_body) = requests
    assert lean_head[0] == proxy_head[0] == "POST /square HTTP/1.1"

    def fields(head):  # header names are case-insensitive; httpx adds its transport's own
        return {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip() for line in head[1:]
                if not line.lower().startswith(("accept", "connection:", "transfer-encoding"))}

    assert fields(lean_head) == fields(proxy_head)
    assert lean_body == proxy_body  # the same pickled input model, byte for byte
    assert len(by_lean) == len(by_proxy) == 2
    for lean, proxy in zip(by_lean, by_proxy):
        assert type(lean) is type(proxy)
        np.testing.assert_array_equal(lean.probs, proxy.probs)
        assert (lean.batch_size, lean.inference_ms, lean.expired) == (proxy.batch_size, proxy.inference_ms, False)


def test_an_error_status_raises_the_exception_bentomls_proxy_raises(sock):
    async def main():
        async with RecordingRunner(sock, lambda i: (500, {"content-type": "text/plain"}, b"boom", "length")):
            remote = proxy_client(sock)
            with pytest.raises(BentoMLException) as by_proxy:
                await remote.square(items())
            with pytest.raises(BentoMLException) as by_lean:
                await RunnerClient(remote, runner_address(remote)).call("square", items())
            await remote.close()
            return by_proxy.value, by_lean.value

    by_proxy, by_lean = asyncio.run(main())
    assert type(by_lean) is type(by_proxy)
    assert (str(by_lean), by_lean.error_code) == (str(by_proxy), by_proxy.error_code)


def test_connections_are_kept_alive_and_chunked_answers_are_read(sock):
    async def main():
        async with RecordingRunner(sock, lambda i: ok(i, "chunked" if i % 2 else "length")) as runner:
            client = RunnerClient(proxy_client(sock), ("unix", sock))
            answers = [await client.call("square", items()) for _ in range(4)]
            return runner.connections, client.pool.opened, answers

    connections, opened, answers = asyncio.run(main())
    assert connections == opened == 1
    assert all(len(answer) == 2 and answer[1].probs[0] == pytest.approx(0.1) for answer in answers)


def test_a_connection_the_runner_closed_while_idle_is_replaced_and_the_call_sent_once_more(sock):
    async def main():
        async with RecordingRunner(sock, lambda i: ok(i, "close")) as runner:
            client = RunnerClient(proxy_client(sock), ("unix", sock))
            first = await client.call("square", items())
            await asyncio.sleep(0.05)  # the runner's close reaches the idle connection
            second = await client.call("square", items())
            return runner, client, first, second

    runner, client, first, second = asyncio.run(main())
    assert len(first) == len(second) == 2
    assert client.pool.opened == runner.connections == 2
    assert len(runner.requests) == 2  # the stale connection carried nothing to the runner


def test_a_call_cancelled_or_timed_out_mid_answer_closes_its_connection(sock):
    async def main():
        async with RecordingRunner(sock, lambda i: (None, {}, b"", "length") if i == 0 else ok(i)) as runner:
            client = RunnerClient(proxy_client(sock), ("unix", sock))
            client.pool.timeout_s = 0.2
            with pytest.raises(TimeoutError):
                await client.call("square", items())
            answer = await client.call("square", items())  # not on the connection still waiting
            return runner, client, answer

    runner, client, answer = asyncio.run(main())
    assert len(answer) == 2 and client.pool.opened == runner.connections == 2


def test_a_runner_that_closes_without_answering_is_a_connection_error_not_a_retry(sock):
    async def main():
        calls = []

        async def hang_up(reader, writer):
            calls.append(await reader.read(100))
            writer.close()

        server = await asyncio.start_unix_server(hang_up, sock)
        pool = HttpConnectionPool(("unix", sock), timeout_s=2)
        try:
            with pytest.raises(RunnerConnectionError):
                await pool.request("/square", {"Content-Type": PICKLE}, [b"x" * 10])
        finally:
            server.close()
        return calls

    assert len(asyncio.run(main())) == 1  # a fresh connection is never sent twice


def test_runner_address_reads_bentomls_urls(sock):
    assert runner_address(proxy_client(sock)) == ("unix", sock)
    tcp = AsyncHTTPClient("tcp://10.0.0.7:3001", service=Primary, media_type=PICKLE, server_ready_timeout=0)
    assert runner_address(tcp) == ("tcp", ("10.0.0.7", 3001))
    assert RunnerWire(tcp, "square").route == "/square"
