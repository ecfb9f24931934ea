"""Patches of uvicorn 0.54.0's httptools protocol (httptools 0.9.0): the request-head bound and timeout, and arrival stamps.

This module imports ``uvicorn.protocols.http.httptools_impl``, which needs httptools; nothing else
does (the in-flight bound's hook, ``rampart.compat.uvicorn_app``, works with any uvicorn protocol).

**A bound on the HTTP request head (request line and headers), enforced before it is parsed.**

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

**A time limit on each request head, and on idle keep-alive connections.** uvicorn arms its
keep-alive timer (``timeout_keep_alive``; 5 s, the default of BentoML's worker, which has no
configuration key for it) only when a response is complete, and ``data_received`` cancels it at
any byte. A connection that never sends a request, or that trickles its head a byte at a time, was
therefore never closed: each one held a file descriptor for as long as the client wanted.
``HeadLimitedProtocol`` keeps one timer per connection from its first byte of a request head (from
``connection_made`` on a fresh connection) until that head is complete (``on_headers_complete``);
past ``request_head_timeout_ms`` the connection is closed, with no answer (as nginx's
``client_header_timeout`` does). Between requests uvicorn's own keep-alive timer runs, set to
``keep_alive_timeout_s``. Both come from the settings (``rampart.config``) when
``limit_request_heads()`` runs.

**A JSON 400 for what the parser refuses.** uvicorn answers a request llhttp cannot parse (a negative
or repeated ``Content-Length``, a bad chunk size, a lower-case method) with a plain-text 400 and closes
the connection; ``HeadLimitedProtocol.send_400_response`` sends Rampart's JSON error
``malformed_request`` instead, counted and logged like every answer (behind pipelined requests still to be
answered it gets none: they are answered first, in order, and the connection closed after them). A request that asks to
upgrade to another protocol (``Upgrade: h2c``, ``websocket``: no route of Rampart or BentoML serves a
WebSocket, so none is taken; uvicorn's WebSocket side answered the handshake with an empty 403) gets the same answer from ``on_headers_complete``, before any app runs: llhttp stops parsing at the
end of its head, so its body and every later request on the connection were lost.

**A bound on pipelined requests.** uvicorn parses every request of a read at once and queues each behind
the one being answered; a connection writing 256 KiB of tiny requests queued about 8,000. Past
``MAX_PIPELINED_REQUESTS`` queued, ``HeadLimitedProtocol`` stops the parser in that read, reads nothing
more, and closes the connection after answering what was queued (nginx reads a pipelined request only
when the one before it is answered).

**Trailers stay out of the headers.** uvicorn appends every header field llhttp reports to the list
the ASGI scope holds as the request's headers, the trailer fields after a chunked body too; when the
whole request arrived in one read, the app saw them as headers. ``HeadLimitedProtocol.on_header``
drops a field that arrives after the head (RFC 9110, section 6.5.1).

**Nothing unread keeps a connection.** Two parts of a request reached the parser after nobody read them
any more, with no bound. The trailer section of a chunked body: httptools grows a field's value by
copying it at every read (quadratic) until the field ends, and a section that never ended took the worker
to 430 MiB and ``/livez`` to 5 s in 20 s; ``HeadLimitedProtocol`` counts it like a head (the reads that
arrive between the last chunk's size line and the end of the message) and past ``MAX_HEAD_BYTES``
answers 431 ``headers_too_large`` and closes. And the rest of a body whose request was already answered
(``/livez`` answered, its declared body still trickling): each byte cancelled uvicorn's keep-alive
timer, so the connection stayed open for as long as the client sent; now the connection is closed after
such an answer, the rest of the body read and dropped for at most ``LINGER_S``. Such an answer says
``connection: close`` in its head (``EarlyAnswerCycle``): without it a keep-alive client (httpx) sent its
next request on the connection as it closed, and got no answer ("Server disconnected without sending a
response"; a 503 answered during warm-up before the upload had all arrived).

**An answer's head and body in one write.** uvicorn writes an answer's head when the app starts it and
its body when the app sends it: two writes, with the app's send wrappers between them. A replica killed
between the two (SIGKILL, the OOM killer) left its client a 200 head without a body, which a load
balancer has already passed on and cannot send to another replica (one request of 174 in a fresh
clone's two-replica SIGKILL test). ``EarlyAnswerCycle`` holds the head and writes it with the first
piece of the body, so the kernel has the whole (small) answer or none of it.

**First byte.** ``stamp_arrivals()`` notes when each request's first byte arrived in its
ASGI scope (``rampart.api.arrival.ARRIVAL_KEY``), where the deadline clock starts; ``HeadLimitedProtocol``
notes the end of its head (``HEAD_END_KEY``), so a deadline used up by a slowly sent head is told apart from
one used up waiting in the server.

Both are applied by ``rampart.compat.apply_all``; the patched objects' sources are hashed in
``rampart.compat.targets``; docs/compat.md.
"""

from __future__ import annotations

import time
import uuid

from asyncio import TimerHandle

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from rampart.api.arrival import ARRIVAL_KEY, HEAD_END_KEY
from rampart.api.http import JsonResponse
from rampart.config import ConnectionSettings, Settings, get_settings
from rampart.telemetry import metrics
from rampart.telemetry.accesslog import log_request
from rampart.errors import HeadersTooLarge, MalformedRequest, RampartError

__all__ = [
    "MAX_HEAD_BYTES", "MAX_PIPELINED_REQUESTS", "EarlyAnswerCycle", "HeadLimitedProtocol", "limit_request_heads",
    "stamp_arrivals",
]

#: Longest request head (request line, headers, their line ends) accepted, in bytes.
#: AWS ALB allows 64 KiB in all; nginx 4 × 8 KiB lines by default, Node.js 16 KiB.
MAX_HEAD_BYTES = 64 * 1024
#: After a 431, how long the rest of the head is read and dropped before the connection
#: is closed (nginx's lingering close): closing with unread data would make the kernel
#: reset the connection, and the client could lose the 431 before reading it.
LINGER_S = 2.0
_END_OF_HEAD = b"\r\n\r\n"
#: Requests a connection may queue behind the one being answered (HTTP/1.1 pipelining). uvicorn parses every
#: request of a read at once and queued each: 50 connections writing 256 KiB of ``GET /livez`` each (12.5 MiB)
#: took the API worker from 106 MiB to about 1 GB and stalled its event loop for seconds. Past this many the
#: rest of the read is not parsed, nothing more is read, and the connection closes after the queued answers.
MAX_PIPELINED_REQUESTS = 32


class EarlyAnswerCycle(RequestResponseCycle):
    """uvicorn's request-response cycle for ``HeadLimitedProtocol``: an answer that starts while its request's
    body is still arriving says ``connection: close``, and ends the connection after it.

    An app may answer before it has read the whole body (a 503 during warm-up, a 429, ``/livez``). The
    protocol then closes the connection after the answer (lingering, ``LINGER_S``: closing at once with
    unread bytes makes the kernel reset the connection). The head must say so, or a keep-alive client
    takes the connection for reusable and sends its next request into the close. ``on_early_answer`` (the
    protocol's, set when the cycle is made) is called once, when such an answer's head is written.
    """

    on_early_answer = None  # set by HeadLimitedProtocol.on_headers_complete
    _held: "_HeldWrites | None" = None  # the answer's head, until its body's first piece is written with it

    async def send(self, message) -> None:
        """uvicorn's ``send``, except that the answer's head is written together with the first piece of its
        body, in one write: uvicorn wrote them apart, and a process killed between the two (a replica's
        SIGKILL) left the client a head without its body, a broken answer that the load balancer cannot
        send again elsewhere. In one write (a Rampart answer is a few KiB) the kernel has all of it or none."""
        if message["type"] == "http.response.start" and not self.response_started:
            real, self.transport = self.transport, _HeldWrites(self.transport)
            try:
                await self._send_marking_early_answers(message)
            finally:
                self._held, self.transport = self.transport, real
            return
        held, self._held = self._held, None
        if held is None:
            await self._send_marking_early_answers(message)
            return
        if not message.get("body") or self.scope["method"] == "HEAD":  # no bytes to write the head with
            held.flush()
            await self._send_marking_early_answers(message)
            return
        # uvicorn writes a body piece before anything else it does at the answer's end (close, on_response)
        real, self.transport = self.transport, held.writing_through_with_the_next_write()
        try:
            await self._send_marking_early_answers(message)
        finally:
            self.transport = real
            held.flush()

    async def _send_marking_early_answers(self, message) -> None:
        if self.response_started or not self.more_body:
            await super().send(message)
            return
        self.keep_alive = False  # uvicorn writes ``connection: close`` in the head...
        await super().send(message)
        self.keep_alive = True  # ...and does not close at the answer's end: the protocol closes after LINGER_S
        if self.response_started:
            self.on_early_answer()


class _HeldWrites:
    """Stands in for a cycle's transport while an answer's head waits for its body: ``write`` keeps the bytes
    until ``writing_through_with_the_next_write`` (then the next write sends them with its own, in one write, and
    later writes go straight through) or ``flush``. ``close`` flushes first. Anything else is the real
    transport's."""

    def __init__(self, transport) -> None:
        self._transport = transport
        self._chunks: list[bytes] = []
        self._through = False

    def writing_through_with_the_next_write(self) -> "_HeldWrites":
        self._through = True
        return self

    def write(self, data: bytes) -> None:
        if not self._through:
            self._chunks.append(data)
            return
        chunks, self._chunks = self._chunks, []
        self._transport.write(b"".join([*chunks, data]) if chunks else data)

    def flush(self) -> None:
        chunks, self._chunks = self._chunks, []
        if chunks:
            self._transport.write(b"".join(chunks))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _PipelineTooDeep(Exception):
    """Raised from a parser callback to stop llhttp inside a read (``HeadLimitedProtocol._stop_pipelining``)."""


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that refuses a request head over ``MAX_HEAD_BYTES`` with a JSON 431,
    and closes a connection whose request head is not complete within ``head_timeout_s``.

    The count covers the bytes from the end of the previous request up to the
    blank line that ends this head. A request pipelined behind another in the
    same read is counted from the next read on, so a head is refused at the
    latest ``MAX_HEAD_BYTES`` plus one read (256 KiB with asyncio and uvloop) later.

    The head timer (one ``loop.call_later`` per connection at a time) starts at ``connection_made``
    and, on a kept-alive connection, at the first read that arrives between the end of one request
    and the end of the next head; ``on_headers_complete`` cancels it. When it fires while no response
    is in progress the connection is closed; while one is (a head trickled behind a request that is
    being answered), that response is sent with ``connection: close`` and the connection closed after
    it. An idle connection between requests is closed by uvicorn's keep-alive timer after
    ``keep_alive_timeout_s``.
    """

    max_head_bytes = MAX_HEAD_BYTES
    #: Seconds from a head's first byte (or a fresh connection) to its end; set by ``limit_request_heads``.
    head_timeout_s = ConnectionSettings.model_fields["request_head_timeout_ms"].default / 1000
    #: Seconds an idle keep-alive connection is kept; replaces uvicorn's ``timeout_keep_alive``.
    keep_alive_timeout_s = ConnectionSettings.model_fields["keep_alive_timeout_s"].default
    #: Whether a client that half-closes after a whole request still gets its answer (``eof_received``): only when
    #: hang-ups are not cancelled (``cancel_on_hang_up`` false); set by ``limit_request_heads``.
    answer_half_closed = not ConnectionSettings.model_fields["cancel_on_hang_up"].default

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # from the end of a message to the end of the next head
        self._head_bytes = 0
        self._head_tail = b""  # the head's last bytes so far, to find an end cut between two reads
        self._refused = False  # the connection is ending (a 431, an upgrade refused, a lingering close, a malformed
        # request behind pipelined ones): what still arrives is dropped until the close
        self._pipeline_stopped = False  # more than MAX_PIPELINED_REQUESTS were queued: nothing more is parsed
        self._head_timer: TimerHandle | None = None  # armed while a head is awaited or incomplete
        self._chunk_without_body = False  # a chunk's size line was parsed and none of its data yet: the last chunk's
        self._trailer_bytes = 0  # bytes of reads that ended inside the trailer section of this message
        self._previous_cycle: RequestResponseCycle | None = None  # the cycle before the newest (self.cycle)
        self._answered_early = False  # the answer in progress started while its request's body was arriving
        self._unfinished_cycles: list[RequestResponseCycle] = []  # this connection's cycles, the answered pruned
        self.timeout_keep_alive = self.keep_alive_timeout_s

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's, and every unfinished cycle of the connection is told its client is gone, not only the
        newest (``self.cycle``): with pipelined requests the one being answered is older, and it went on writing
        into the closed transport (on uvloop a ``RuntimeError``, logged as "Exception in ASGI application")."""
        self._cancel_head_timer()
        for cycle in self._unfinished_cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self._unfinished_cycles.clear()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        """The client sent its FIN. TCP shows a half-close (``shutdown(SHUT_WR)`` after the request, then reading
        the answer, as ``nc -N`` does) and a close alike. With ``answer_half_closed`` and whole requests not yet
        answered, the transport stays open: they are answered in order, the last (``self.cycle``, the newest) with
        ``connection: close``, and the connection closed after it. Otherwise, as uvicorn does (``None``), the transport closes and the request sees its
        client gone: with ``cancel_on_hang_up`` (the default) it stops spending, as nginx ends a request whose
        client closed unless ``proxy_ignore_client_abort`` is on."""
        cycle = self.cycle
        if self.answer_half_closed and self._in_head and cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
            return True
        return None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
            self._head_bytes += self._head_part(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse()
                return
            self._head_tail = (self._head_tail + data[-3:])[-3:]
        elif self._chunk_without_body:  # after the last chunk's size line (or a chunk's, with its data to come)
            super().data_received(data)
            if self._chunk_without_body and not self._refused:  # no data came: all of it was trailer section
                self._trailer_bytes += len(data)
                if self._trailer_bytes > self.max_head_bytes:
                    self._refuse_trailer()
            return
        super().data_received(data)

    def _head_part(self, data: bytes) -> int:
        """How many bytes of ``data`` belong to the head: up to its end (a blank line), else all of them."""
        across = (self._head_tail + data[:3]).find(_END_OF_HEAD)  # an end cut between the last read and this one
        if across >= 0:
            return across + len(_END_OF_HEAD) - len(self._head_tail)
        end = data.find(_END_OF_HEAD)
        return len(data) if end < 0 else end + len(_END_OF_HEAD)

    def on_header(self, name: bytes, value: bytes) -> None:
        """A header field of the head; a trailer field (after a chunked body, when the head is complete) is
        dropped. uvicorn appended it to the list the ASGI scope holds as the request's headers, so a trailer
        ``X-Priority`` or ``X-Deadline-Ms`` took effect as a header, past any proxy that checks the head only;
        RFC 9110, section 6.5.1: trailer fields are not merged into the header section unless known to be safe."""
        if self._in_head:
            super().on_header(name, value)

    def on_chunk_header(self) -> None:
        """httptools: a chunk's size line was parsed (the last chunk's too, whose trailer section follows)."""
        self._chunk_without_body = True

    def on_chunk_complete(self) -> None:
        self._chunk_without_body = False

    def on_body(self, body: bytes) -> None:
        self._chunk_without_body = False
        super().on_body(body)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self.scope[HEAD_END_KEY] = time.monotonic()  # the head's sending time is the client's (Arrival.head_ms)
        self._cancel_head_timer()
        upgrade = self._get_upgrade()
        if upgrade is not None and not self._should_upgrade():
            self._refuse_upgrade(upgrade)
            return
        self._previous_cycle = self.cycle  # the request before this one: being answered, or queued
        super().on_headers_complete()
        if self.cycle is not self._previous_cycle:  # uvicorn made this request's cycle (its task not yet run)
            self.cycle.__class__ = EarlyAnswerCycle
            self.cycle.on_early_answer = self._close_after_answer
            self._unfinished_cycles = [cycle for cycle in self._unfinished_cycles if not cycle.response_complete]
            self._unfinished_cycles.append(self.cycle)
        if len(self.pipeline) > MAX_PIPELINED_REQUESTS:
            self._stop_pipelining()

    def _stop_pipelining(self) -> None:
        """A connection that queued more than ``MAX_PIPELINED_REQUESTS`` requests: the one whose head just
        ended is dropped (its body is never read), the ``MAX_PIPELINED_REQUESTS`` before it are answered in
        order, the last of them with ``connection: close`` (uvicorn closes after it), and nothing more is
        parsed or read. Raises ``_PipelineTooDeep`` to stop the parser inside this read; uvicorn's
        ``data_received`` takes it for a parse error and calls ``send_400_response``, which then sends nothing."""
        self._refused = True  # data_received drops what still arrives
        self._pipeline_stopped = True
        self.pipeline.popleft()  # uvicorn queues the newest on the left
        last, _ = self.pipeline[0]
        last.keep_alive = False
        raise _PipelineTooDeep(f"more than {MAX_PIPELINED_REQUESTS} requests queued on one connection")

    def _refuse_upgrade(self, upgrade: bytes) -> None:
        """Answer a request asking to upgrade to another protocol (``Connection: upgrade``, ``Upgrade: h2c``,
        ``websocket`` or any other: ``_should_upgrade`` takes none) with the JSON 400 ``malformed_request``, and close.

        llhttp stops parsing at the end of such a request's head, so uvicorn ran the app with an empty body
        (a false ``empty_body``) and never parsed the bytes after it: the next request on the connection
        waited for the keep-alive timeout. Behind a response still being sent (pipelining) that response
        ends the connection instead; nothing more is read.
        """
        self._refused = True  # what the parser left unread is dropped until the connection closes
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
            return
        name = upgrade.decode("latin-1")[:40]
        self._write_error(MalformedRequest(f"an upgrade to {name!r} is not supported; send the request without "
                                           "the Upgrade and Connection: upgrade headers"), b"400 Bad Request")
        self.transport.close()

    def _should_upgrade(self) -> bool:
        """False: no route of Rampart or BentoML serves a WebSocket, so no upgrade is taken (uvicorn took a
        ``websocket`` upgrade whenever a WebSocket library was installed, and its handshake was refused with an
        empty 403, or 400 without its key)."""
        return False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._head_tail = True, 0, b""
        self._chunk_without_body, self._trailer_bytes = False, 0

    def _close_after_answer(self) -> None:
        """``EarlyAnswerCycle``: the answer being sent started while its request's body was still arriving,
        and said ``connection: close``."""
        self._answered_early = True

    def on_response_complete(self) -> None:
        """uvicorn's end of a response; when the answer started while its request's body was still arriving
        (``EarlyAnswerCycle``: it said ``connection: close``), or that request is still arriving now (its head
        parsed, its message not complete, nothing queued after it), the connection is closed as
        ``_linger_close`` does: the client sees the answer end, and the rest of its body no longer holds the
        connection. Requests queued after an early answer are not answered (the client was told to close)."""
        body_still_arriving = not self._in_head and not self.pipeline and not self._refused
        close = self._answered_early or body_still_arriving
        if self._answered_early:
            self._answered_early = False
            self.pipeline.clear()
        super().on_response_complete()
        if close and not self.transport.is_closing():
            self._linger_close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        """Close the connection (after the response in progress, if any): its head took over ``head_timeout_s``."""
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # uvicorn closes the connection once this response is sent
        else:
            self.transport.close()

    def _refuse(self) -> None:
        """Answer 431 with the JSON error body, count and log it, and close the connection after ``LINGER_S``."""
        self._cancel_head_timer()
        error = HeadersTooLarge(f"the request line and headers are over the limit of {self.max_head_bytes} bytes")
        self._write_error(error, b"431 Request Header Fields Too Large")
        self._linger_close()

    def _refuse_trailer(self) -> None:
        """The trailer section of a chunked body is over ``max_head_bytes``: answer 431 (unless an answer has
        started), end the request for the app (it sees the client gone, as at a hang-up, and whatever it
        still sends is dropped), and close as ``_linger_close`` does."""
        cycle = self.cycle
        if not cycle.response_started:
            error = HeadersTooLarge(f"the trailer fields after the chunked body are over the limit of "
                                    f"{self.max_head_bytes} bytes")
            self._write_error(error, b"431 Request Header Fields Too Large")
        cycle.disconnected = True  # uvicorn's cycle drops what the app still sends
        cycle.message_event.set()
        self._linger_close()

    def _linger_close(self) -> None:
        """End the connection after what was written: the write side is shut (the client reads the end of the
        answer), what still arrives is dropped, and the connection is closed after ``LINGER_S`` (or at the
        client's own close). Closing at once with unread bytes would make the kernel reset the connection,
        and the client could lose the answer before reading it (nginx's lingering close)."""
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes the HTTP parser refuses (``msg``: its text), as Rampart's JSON
        ``malformed_request``; the connection is closed, as uvicorn closes it. Nothing when the parser was
        stopped on purpose (``_stop_pipelining``): the queued requests are still to be answered.

        Behind earlier requests of the same connection that are still to be answered (pipelining), the
        malformed one gets no answer: those are answered in order, the last with ``connection: close``, and
        nothing more is read (``_close_after_earlier_answers``). uvicorn wrote its 400 at once, ahead of their
        answers (so the client took it for the first request's), and closed the connection under them."""
        if self._pipeline_stopped:
            return
        self._cancel_head_timer()
        if self._close_after_earlier_answers():
            return
        self._write_error(MalformedRequest(f"{msg} The request could not be parsed as HTTP/1.1."), b"400 Bad Request")
        self.transport.close()

    def _close_after_earlier_answers(self) -> bool:
        """When the malformed bytes come after requests still to be answered: drop the malformed request (a
        queued one whose body broke, or a head that never completed), end the connection after the answer
        to the last request before it, read nothing more, and return True. False when no earlier request
        waits for its answer (or the broken body is the request being answered: it gets the 400)."""
        if not self._in_head:  # the body of the newest parsed request broke
            if not self.pipeline:
                return False  # it is the request being answered: its app sees the connection end
            self.pipeline.popleft()  # queued, never started (uvicorn queues the newest on the left)
            last = self.pipeline[0][0] if self.pipeline else self._previous_cycle
        else:
            last = self.cycle
        if last is None or last.response_complete:
            return False
        last.keep_alive = False  # uvicorn closes the connection once that answer is sent
        self._refused = True
        return True

    def _write_error(self, error: RampartError, status_line: bytes) -> None:
        """Write ``error`` as a JSON answer with ``connection: close`` (no ASGI app runs), count and log it;
        the caller closes the connection."""
        request_id = uuid.uuid4().hex
        body = JsonResponse(error.to_body(request_id)).body  # the API layer's one JSON rendering
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nx-request-id: %s\r\nconnection: close\r\n\r\n%s"
            % (status_line, len(body), request_id.encode(), body))
        metrics.RESPONSES.labels(str(error.status), error.code).inc()
        log_request(request_id, "", error.status, error.code, False, 0.0)


def limit_request_heads(settings: Settings | None = None) -> None:
    """Make uvicorn's ``http="auto"`` and ``"httptools"`` use ``HeadLimitedProtocol`` (idempotent), with the
    head and keep-alive timeouts of ``settings`` (``get_settings()`` by default).

    Fixes: no bound on a request head's size or time with httptools, and no timeout on a connection
    that has sent no request (module doc). Upstream: uvicorn has no head-size
    limit for httptools (https://github.com/Kludex/uvicorn/issues/157, closed; the limit proposed in
    https://github.com/Kludex/uvicorn/pull/1684 was not merged, and
    https://github.com/MagicStack/httptools/issues/87 explains that it must act before parsing); a
    connection that sends nothing is never timed out (https://github.com/Kludex/uvicorn/pull/1192, closed
    unmerged, reported still so in 0.23.2), and any byte cancels the keep-alive timer. Written for uvicorn 0.54.0 with httptools 0.9.0; targets ``uvicorn.config.HTTP_PROTOCOLS`` and the
    ``HttpToolsProtocol`` methods ``HeadLimitedProtocol`` overrides or relies on (``__init__`` for
    ``timeout_keep_alive``, ``on_response_complete`` and ``timeout_keep_alive_handler`` for the
    keep-alive timer, ``RequestResponseCycle.send`` for closing after a response, ``send_400_response``
    replaced by the JSON ``malformed_request``, ``on_headers_complete``, ``_get_upgrade`` and ``_should_upgrade``
    for refusing an upgrade).
    """
    from uvicorn import config

    settings = settings or get_settings()
    HeadLimitedProtocol.head_timeout_s = settings.connections.request_head_timeout_ms / 1000
    HeadLimitedProtocol.keep_alive_timeout_s = settings.connections.keep_alive_timeout_s
    HeadLimitedProtocol.answer_half_closed = not settings.connections.cancel_on_hang_up

    target = f"{__name__}:{HeadLimitedProtocol.__name__}"
    config.HTTP_PROTOCOLS["auto"] = target
    config.HTTP_PROTOCOLS["httptools"] = target


def stamp_arrivals() -> None:
    """Patch uvicorn's httptools protocol to note each request's first byte in its scope (idempotent).

    ``on_message_begin`` runs when the HTTP parser meets the first byte of a
    request and creates the scope; the patch adds one ``time.monotonic()`` call
    (tens of nanoseconds). Under another protocol (h11) no stamp is made and the
    handler's start is used (``rampart.api.arrival``).

    Fixes: a deadline clock that started only in the handler, after the event loop's backlog and
    BentoML's middlewares (60-270 ms per request under overload). Upstream: no upstream report
    found (an ASGI server has no standard way to pass the arrival time). Written for uvicorn 0.54.0
    with httptools 0.9.0; target ``HttpToolsProtocol.on_message_begin``.
    """
    if getattr(HttpToolsProtocol.on_message_begin, "_rampart_stamped", False):
        return
    begin = HttpToolsProtocol.on_message_begin

    def on_message_begin(self) -> None:
        arrived = time.monotonic()
        begin(self)
        self.scope[ARRIVAL_KEY] = arrived

    on_message_begin._rampart_stamped = True
    HttpToolsProtocol.on_message_begin = on_message_begin
