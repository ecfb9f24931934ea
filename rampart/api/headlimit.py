"""A bound on the HTTP request head (request line and headers), enforced before it is parsed.

``bentoml serve`` 1.4.29 runs uvicorn with ``http="auto"``, which picks the
httptools protocol. Neither has a limit on the head: llhttp hands each header line
over in pieces as they arrive, httptools concatenates them until the line ends
(quadratic copying on the event loop for a long line), and uvicorn keeps them all,
so a 1 MB header line was accepted. uvicorn's h11 protocol does bound the head
(``h11_max_incomplete_event_size``, 16 KiB), but it answers a plain-text 400, and
BentoML has no setting to choose it. An ASGI-level check would only run after the
whole head had been buffered and parsed.

So ``HeadLimitedProtocol`` (uvicorn's httptools protocol plus a byte count)
counts each request's head as it arrives, before the parser sees it, and above
``MAX_HEAD_BYTES`` answers 431 ``headers_too_large`` in Rampart's JSON error shape
and closes the connection. ``limit_request_heads()`` makes uvicorn use it for
``http="auto"`` and ``"httptools"``; it is applied when ``service.py`` is imported,
before BentoML's worker builds its uvicorn config.

**Time.** uvicorn arms its keep-alive timer (``timeout_keep_alive``, 5 s as BentoML
passes it) only once a response has been sent, and any byte received disarms it: a
connection that never sends a request, or sends its head a byte at a time, stays
open for ever (1,000 idle sockets and 100 trickled heads were all still open after
70 s). ``HeadLimitedProtocol`` also times the head: from the connection's start, or
from the first byte of the next request on a kept-alive connection, a complete head
must arrive within ``head_timeout_s`` (setting ``head_timeout_ms``); else the
connection is closed, after a 408 ``request_timeout`` when part of a head had come.
So must the rest of a body whose request was answered before it was all in.
An idle kept-alive connection is closed after ``keep_alive_s`` (setting
``keep_alive_timeout_ms``, replacing BentoML's ``--timeout-keep-alive``). Each close
is counted in ``rampart_connections_closed_total{reason}`` (``head_timeout``, ``idle``).

``serve_behind_front()`` puts ``rampart.api.connections.front`` around the app uvicorn
serves, whichever protocol it runs (the in-flight and body bounds, client-gone handling).
"""

from __future__ import annotations

import asyncio
import uuid

from starlette.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rampart.telemetry import metrics
from rampart.telemetry.accesslog import log_request
from rampart.config import Settings, get_settings
from rampart.errors import BodyTimeout, HeadersTooLarge, RampartError

__all__ = ["MAX_HEAD_BYTES", "HeadLimitedProtocol", "limit_request_heads", "serve_behind_front"]

#: Longest request head (request line, headers, their line ends) accepted, in bytes.
#: AWS ALB allows 64 KiB in all; nginx 4 × 8 KiB lines by default, Node.js 16 KiB.
MAX_HEAD_BYTES = 64 * 1024
#: After a 431, how long the rest of the head is read and dropped before the connection
#: is closed (nginx's lingering close): closing with unread data would make the kernel
#: reset the connection, and the client could lose the 431 before reading it.
LINGER_S = 2.0
_END_OF_HEAD = b"\r\n\r\n"


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that refuses a request head over ``MAX_HEAD_BYTES`` with a JSON 431.

    The count covers the bytes from the end of the previous request up to the
    blank line that ends this head. A request pipelined behind another in the
    same read is counted from the next read on, so a head is refused at the
    latest ``MAX_HEAD_BYTES`` plus one read (256 KiB with asyncio and uvloop) later.
    """

    max_head_bytes = MAX_HEAD_BYTES
    #: Seconds a connection has to send a complete head, from its start or the first byte of its next request.
    head_timeout_s = 10.0
    #: Seconds an idle kept-alive connection stays open (None: uvicorn's ``timeout_keep_alive``).
    keep_alive_s: float | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # from the end of a message to the end of the next head
        self._head_bytes = 0
        self._head_tail = b""  # the head's last bytes so far, to find an end cut between two reads
        self._refused = False  # a 431 was sent: what still arrives is dropped until the connection closes
        self._head_timer: asyncio.TimerHandle | None = None
        if self.keep_alive_s is not None:
            self.timeout_keep_alive = self.keep_alive_s

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._time_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _time_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        """No complete head within ``head_timeout_s``: close (after a 408 if part of a head came)."""
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a partial head pipelined behind a request: close after its answer
            return
        if self._in_head and self._head_bytes:
            self._answer(BodyTimeout(f"the request head did not arrive within {self.head_timeout_s * 1000:.0f} ms"),
                         b"408 Request Timeout")
        metrics.CONNECTIONS_CLOSED.labels("head_timeout").inc()
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            metrics.CONNECTIONS_CLOSED.labels("idle").inc()
        super().timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._time_head()  # the first byte of a kept-alive connection's next request starts its clock
            self._head_bytes += self._head_part(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse()
                return
            self._head_tail = (self._head_tail + data[-3:])[-3:]
        super().data_received(data)

    def _head_part(self, data: bytes) -> int:
        """How many bytes of ``data`` belong to the head: up to its end (a blank line), else all of them."""
        across = (self._head_tail + data[:3]).find(_END_OF_HEAD)  # an end cut between the last read and this one
        if across >= 0:
            return across + len(_END_OF_HEAD) - len(self._head_tail)
        end = data.find(_END_OF_HEAD)
        return len(data) if end < 0 else end + len(_END_OF_HEAD)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._head_tail = True, 0, b""
        self._stop_head_timer()  # a timer for the rest of an answered body; the next head's starts with its first byte

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._in_head and not self.transport.is_closing():
            # Answered before its body was all in (an error, a route that reads none): each byte of the rest
            # would disarm uvicorn's keep-alive timer, so the rest must come within the head timeout too.
            self._time_head()

    def _refuse(self) -> None:
        """Answer 431 with the JSON error body, count and log it, and close the connection after ``LINGER_S``."""
        self._stop_head_timer()
        self._answer(HeadersTooLarge(f"the request line and headers are over the limit of {self.max_head_bytes} bytes"),
                     b"431 Request Header Fields Too Large")
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client sees the answer end; its own close then ends the connection
        self.loop.call_later(LINGER_S, self.transport.close)
        self._refused = True

    def _answer(self, error: RampartError, status_line: bytes) -> None:
        """Write ``error`` as Rampart's JSON error answer with ``Connection: close``; count and log it."""
        request_id = uuid.uuid4().hex
        body = JSONResponse(error.to_body(request_id)).body
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nx-request-id: %s\r\nconnection: close\r\n\r\n%s"
            % (status_line, len(body), request_id.encode(), body))
        metrics.RESPONSES.labels(str(error.status), error.code).inc()
        log_request(request_id, "", error.status, error.code, False, 0.0)


def limit_request_heads(settings: Settings | None = None) -> None:
    """Make uvicorn's ``http="auto"`` and ``"httptools"`` use ``HeadLimitedProtocol`` (idempotent), with the head
    and keep-alive timeouts of ``settings`` (default: the process's, ``rampart.config.get_settings``)."""
    from uvicorn import config

    settings = settings or get_settings()
    HeadLimitedProtocol.head_timeout_s = settings.head_timeout_ms / 1000
    HeadLimitedProtocol.keep_alive_s = settings.keep_alive_timeout_ms / 1000

    target = f"{__name__}:{HeadLimitedProtocol.__name__}"
    config.HTTP_PROTOCOLS["auto"] = target
    config.HTTP_PROTOCOLS["httptools"] = target



def serve_behind_front() -> None:
    """Patch ``uvicorn.Config.load`` so the app uvicorn serves is ``rampart.api.connections.front(app)`` (idempotent).

    ``Config.load`` builds ``loaded_app``, the app every protocol (httptools, h11, any
    ``http=`` choice) calls for each request, after uvicorn's own wrappers; the front door
    then runs before any of BentoML's middlewares, whichever protocol uvicorn runs.
    """
    from uvicorn import config

    from rampart.api.connections import front

    if getattr(config.Config.load, "_rampart_front", False):
        return
    load = config.Config.load

    def load_behind_front(self) -> None:
        load(self)
        if not getattr(self.loaded_app, "_rampart_front", False):
            self.loaded_app = front(self.loaded_app)

    load_behind_front._rampart_front = True
    config.Config.load = load_behind_front
