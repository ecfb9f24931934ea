"""A lean HTTP/1.1 client for the entry service's calls to its runners, under BentoML's wire format.

BentoML's dependency proxy sends each runner call through httpx (httpx, httpcore, h11
and anyio's socket streams): measured for the SDK at 1.5-3.1 ms of client CPU per call
against 0.17-0.52 ms for aiohttp (``docs/bench/clients.json``). ``RunnerClient`` keeps
BentoML's request and answer exactly (``rampart.compat.bentoml_wire.RunnerWire``: the
same headers, the same pickled body, the same decoding and exceptions) and replaces only
the transport: asyncio streams over the runner's Unix socket (or TCP address), kept
alive and reused, a fixed request head, ``Content-Length`` bodies and
``Content-Length`` or chunked answers.

What it keeps of httpx's behaviour: a connection is reused only after a complete
answer that did not ask to close; a call that fails or is cancelled part-way closes
its connection; a call on a reused connection that the runner had already closed
(keep-alive timeout) is sent again once on a new one, and only when no byte of an
answer had arrived; each call is bounded by ``timeout_s`` (BentoML's: the runner's
``traffic.timeout`` + 1%). ``RAMPART_RUNNER_TRANSPORT=proxy`` sends through BentoML's
proxy instead (docs/serving-cost.md).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Sequence

from rampart.compat.bentoml_wire import RunnerWire

__all__ = ["RunnerClient", "RunnerConnectionError", "HttpConnectionPool"]

#: The longest answer head accepted (bytes); a runner's is a few hundred.
MAX_HEAD_BYTES = 64 * 1024
#: Idle keep-alive connections kept per runner (more are closed when returned).
MAX_IDLE_CONNECTIONS = 64


class RunnerConnectionError(ConnectionError):
    """The runner's connection closed or sent something that is not an HTTP/1.1 answer."""


class _StaleConnection(RunnerConnectionError):
    """A reused connection was closed by the runner before any byte of the answer arrived."""


class HttpConnectionPool:
    """Keep-alive HTTP/1.1 connections to one address: ``("unix", path)`` or ``("tcp", (host, port))``.

    ``request(path, headers, body_parts)`` POSTs and returns ``(status, headers, body)``, headers with
    lower-case names. Raises ``RunnerConnectionError`` for a closed or broken connection and
    ``TimeoutError`` after ``timeout_s`` seconds.
    """

    def __init__(self, address: tuple[str, Any], timeout_s: float, host: str = "127.0.0.1:3000",
                 max_idle: int = MAX_IDLE_CONNECTIONS) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.host = host
        self.max_idle = max_idle
        self._idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = deque()
        self.opened = 0  # connections opened since start (for tests and /stats)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        kind, where = self.address
        self.opened += 1
        if kind == "unix":
            return await asyncio.open_unix_connection(where, limit=MAX_HEAD_BYTES)
        return await asyncio.open_connection(*where, limit=MAX_HEAD_BYTES)

    async def request(self, path: str, headers: dict[str, str], body_parts: Sequence[bytes | memoryview]
                      ) -> tuple[int, dict[str, str], bytes]:
        """One POST of ``body_parts`` to ``path`` with ``headers`` (module doc of ``rampart.runner_client``)."""
        async with asyncio.timeout(self.timeout_s):
            while self._idle:
                reader, writer = self._idle.pop()
                if writer.is_closing() or reader.at_eof():
                    writer.close()
                    continue
                try:
                    return await self._exchange(reader, writer, path, headers, body_parts, reused=True)
                except _StaleConnection:
                    continue
            reader, writer = await self._open()
            return await self._exchange(reader, writer, path, headers, body_parts, reused=False)

    async def _exchange(self, reader, writer, path, headers, body_parts, reused: bool):
        done = False
        try:
            length = sum(len(part) for part in body_parts)
            head = [f"POST {path} HTTP/1.1", f"Host: {self.host}"]
            head += [f"{name}: {value}" for name, value in headers.items() if name.lower() != "content-length"]
            head.append(f"Content-Length: {length}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            for part in body_parts:
                writer.write(part)
            try:
                await writer.drain()
                status_line = await reader.readuntil(b"\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                received = isinstance(exc, asyncio.IncompleteReadError) and bool(exc.partial)
                if reused and not received:
                    raise _StaleConnection("the runner had closed the kept-alive connection") from exc
                raise RunnerConnectionError(f"the runner closed the connection: {exc!r}") from exc
            status, answer_headers, body = await self._read_answer(reader, status_line)
            done = answer_headers.get("connection", "").lower() != "close"
            return status, answer_headers, body
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise RunnerConnectionError(f"not an HTTP/1.1 answer from the runner: {exc!r}") from exc
        finally:
            if done and len(self._idle) < self.max_idle:
                self._idle.append((reader, writer))
            else:
                writer.close()

    @staticmethod
    async def _read_answer(reader: asyncio.StreamReader, status_line: bytes) -> tuple[int, dict[str, str], bytes]:
        version, _, rest = status_line.decode("latin-1").partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"status line {status_line[:80]!r}")
        status = int(rest.split(" ", 1)[0])
        headers: dict[str, str] = {}
        size = len(status_line)
        while True:
            line = await reader.readuntil(b"\r\n")
            size += len(line)
            if size > MAX_HEAD_BYTES:
                raise ValueError("answer head too long")
            if line == b"\r\n":
                break
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise ValueError(f"header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            chunks = []
            while True:
                size_line = await reader.readuntil(b"\r\n")
                chunk_size = int(size_line.split(b";", 1)[0].strip(), 16)
                if chunk_size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                        pass
                    break
                chunks.append(await reader.readexactly(chunk_size))
                await reader.readexactly(2)
            return status, headers, b"".join(chunks)
        if "content-length" in headers:
            return status, headers, await reader.readexactly(int(headers["content-length"]))
        headers["connection"] = "close"  # an answer delimited by the end of the connection
        return status, headers, await reader.read()


class RunnerClient:
    """Calls to the batchable APIs of one runner dependency, BentoML's wire format over ``HttpConnectionPool``.

    ``remote`` is BentoML's async proxy client of the dependency (``runner.to_async``); ``address`` where it
    sends (``rampart.compat.bentoml_wire.runner_address``). ``await client.call(api, items)`` returns what
    ``await getattr(remote, api)(items)`` returns, and raises what it raises for an error answer
    (``BentoMLException`` subclasses), ``RunnerConnectionError`` or ``TimeoutError`` otherwise.
    """

    def __init__(self, remote, address: tuple[str, Any]) -> None:
        self.remote = remote
        self.pool = HttpConnectionPool(address, timeout_s=float(getattr(remote, "timeout", 60)))
        self._wires: dict[str, RunnerWire] = {}

    def wire(self, api: str) -> RunnerWire:
        """The ``RunnerWire`` of ``api`` (made once)."""
        if api not in self._wires:
            self._wires[api] = RunnerWire(self.remote, api)
        return self._wires[api]

    async def call(self, api: str, items: Sequence[Any]) -> Any:
        """One call of ``api`` with ``items`` (class doc)."""
        wire = self.wire(api)
        headers, body = wire.encode(items)
        status, answer_headers, data = await self.pool.request(wire.route, headers, body)
        return wire.decode(status, answer_headers, data)
