"""HTTP request parsing and error responses (Starlette, no BentoML).

Everything here turns a malformed request into a ``rampart.errors`` exception,
and ``error_response`` is the one place where an error becomes an HTTP response.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import AsyncIterator, Awaitable, TypeVar

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from rampart.api.arrival import Arrival, arrival_of
from rampart.config import Settings
from rampart.overload.admission import PRIORITIES
from rampart.overload.deadline import Deadline, run_within
from rampart.errors import (
    ClientDisconnected,
    DeadlineTooShort,
    EmptyBody,
    InvalidParameter,
    MethodNotAllowed,
    Overloaded,
    PartHeadersTooLarge,
    PayloadTooLarge,
    RampartError,
    RequestTimeout,
    TooManyParts,
    Unavailable,
)
from rampart.results import MAX_TOP_K

__all__ = [
    "request_id_of",
    "ascii_decimal",
    "parse_top_k",
    "top_k_of",
    "parse_deadline",
    "parse_priority",
    "read_body",
    "read_body_once",
    "body_chunks",
    "within_deadline",
    "is_multipart",
    "read_multipart",
    "error_response",
    "JsonResponse",
]



class JsonResponse(JSONResponse):
    """Starlette's ``JSONResponse`` rendered as ASCII JSON (every non-ASCII character as a ``\\uXXXX`` escape).

    Answers echo strings a client sent (an Open Inference Protocol request's ``id``, names), and a JSON body
    may hold a lone UTF-16 surrogate (``"\\ud800"``), which ``json.loads`` accepts and UTF-8 cannot encode:
    Starlette's own rendering (``ensure_ascii=False``, then UTF-8) raised, and the client got a plain-text 500.
    Escaped, every ``str`` renders, and any JSON parser reads the same characters back. Every JSON answer of
    the API layer uses this class.
    """

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, indent=None, separators=(",", ":")).encode("ascii")


#: Room for multipart boundaries and part headers on top of the image byte cap, per image.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
#: Parts a multipart body may carry besides its image parts (they are skipped).
MAX_OTHER_PARTS = 8
#: Bytes a multipart text field read by name (``read_multipart``'s ``texts``, e.g. ``top_k``) may carry.
MAX_TEXT_FIELD_BYTES = 64
#: Header lines per multipart part and bytes per line: python-multipart's defaults
#: (8 and 4096 + 128 in 0.0.34), ample for browsers, curl and HTTP clients.
MAX_PART_HEADERS = 8
MAX_PART_HEADER_LINE_BYTES = 4096
#: Bytes fed to the multipart parser between yields to the event loop. python-multipart
#: is slowest on part data full of near-boundaries, about 0.15 µs a byte (measured on
#: this 2-core host), so one slice holds the loop for about 2.5 ms.
PARSE_SLICE_BYTES = 16 * 1024
T = TypeVar("T")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
#: ASGI scope key holding the request's id once ``request_id_of`` has given it.
REQUEST_ID_KEY = "rampart.request_id"


def request_id_of(request: Request) -> str:
    """``X-Request-Id`` when it is 1-128 safe characters, sent once (or repeated with the same value), else a new
    uuid4 hex (two different ids: which one the client meant is not for the server to guess, and an error about
    it would need an id); kept in the request's scope (``REQUEST_ID_KEY``), so every call for the same request
    gives the same id (the handler's, and the access line of a request whose client hung up,
    ``rampart.api.app.log_client_gone``)."""
    known = request.scope.get(REQUEST_ID_KEY)
    if known is None:
        given = set(request.headers.getlist("x-request-id"))
        one = given.pop() if len(given) == 1 else ""
        request.scope[REQUEST_ID_KEY] = known = one if _REQUEST_ID.match(one) else uuid.uuid4().hex
    return known


def parse_top_k(request: Request) -> int:
    """Query ``top_k``: an integer in 1..20, default 5; else ``InvalidParameter``, also when it is given more than
    once with different values (``?top_k=3&top_k=4``: which one the client meant is not for the server to guess,
    as for a header, ``single_header``)."""
    given = _one_value(request.query_params.getlist("top_k"), "top_k is given")
    return top_k_of("5" if given is None else given)


#: A whole number as a client sends it: ASCII digits only (``str.isdigit`` and ``int`` also take '²', '١' and
#: ``1_0``, which ``int`` refuses or reads as another number).
_DECIMAL = re.compile(r"[0-9]{1,20}")


def ascii_decimal(text: str) -> int | None:
    """``text`` (a header, query or form value; spaces and tabs around it allowed) as a whole number when it is
    1 to 20 ASCII digits, else None."""
    digits = text.strip(" \t")
    return int(digits) if _DECIMAL.fullmatch(digits) else None


def top_k_of(raw: str) -> int:
    """``raw`` (a query parameter or a multipart field) as ``top_k``: ASCII digits (``ascii_decimal``) for an
    integer in 1..20; else ``InvalidParameter``."""
    top_k = ascii_decimal(raw)
    if top_k is None:
        raise InvalidParameter(f"top_k must be an integer in 1..{MAX_TOP_K}, got {raw[:32]!r}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise InvalidParameter(f"top_k must be in 1..{MAX_TOP_K}, got {top_k}")
    return top_k


#: A number of milliseconds as HTTP clients write one (JSON's grammar, with an optional sign): Python's ``float``
#: also takes ``1_000``, ``infinity`` and ``nan``, which no client means.
_MILLISECONDS = re.compile(r"[+-]?(?:[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?:[eE][+-]?[0-9]{1,3})?")


def single_header(request: Request, name: str) -> str | None:
    """The value of header ``name`` (lower case), None when absent; ``InvalidParameter`` when it is sent more than
    once with different values (``X-Deadline-Ms: 1000`` and ``X-Deadline-Ms: 5``; ``_one_value``)."""
    return _one_value(request.headers.getlist(name), f"{name} is sent")


def _one_value(values: list[str], what: str) -> str | None:
    """The one value of a header's or query parameter's ``values`` (all it was sent), None when there is none.
    Several that differ (spaces and tabs around them aside) are ``InvalidParameter``, its message starting with
    ``what`` ("top_k is given"): which one the client meant is not for the server to guess."""
    if len({value.strip(" \t") for value in values}) > 1:
        shown = ", ".join(repr(value[:32]) for value in values[:3])
        raise InvalidParameter(f"{what} {len(values)} times with different values ({shown}); send one value")
    return values[0] if values else None


def parse_deadline(request: Request, settings: Settings, loop_lag_ms: float = 0.0,
                   arrival: Arrival | None = None) -> Deadline:
    """``X-Deadline-Ms``: a positive number of ms, default ``default_deadline_ms`` (``low_priority_deadline_ms``
    for ``X-Priority: low``), capped at ``max_deadline_ms``.

    The budget is counted from the request's arrival (``rampart.api.arrival``: its
    first byte, or an earlier ``X-Request-Start`` from a load balancer), not from
    the handler's start; ``Deadline.arrival`` keeps it. Pass ``arrival`` when it is
    already known (a second look at the same request), so the clock starts once.
    The ``Deadline`` is sliced by ``Deadline.sliced``: its answer margin is
    ``answer_margin_ms`` + ``loop_lag_ms`` (the event loop's recent lag), so the
    answer is sent by the client's deadline. Raises ``InvalidParameter`` (422) for a
    value that is not a number (``_MILLISECONDS``) or not positive and finite, or a header sent twice with
    different values (``single_header``), and ``DeadlineTooShort`` (422
    ``deadline_too_short``) for one below ``settings.min_deadline_ms``.
    """
    if arrival is None:
        arrival = arrival_of(request.scope, request.headers.get("x-request-start"), settings.deadlines.max_deadline_ms)
    raw = single_header(request, "x-deadline-ms")
    if raw is None:
        low = (single_header(request, "x-priority") or "").strip().lower() == "low"
        # The low class's long default is capped like any deadline: a server with a short max_deadline_ms
        # (a test's, an operator's) must still start with the default low deadline.
        default_ms = min(settings.deadlines.low_priority_deadline_ms, settings.deadlines.max_deadline_ms) if low else \
            settings.deadlines.default_deadline_ms
        return Deadline.sliced(default_ms, arrival, settings, loop_lag_ms)
    if not _MILLISECONDS.fullmatch(raw.strip(" \t")):
        raise InvalidParameter(f"X-Deadline-Ms must be a number of milliseconds, got {raw[:32]!r}")
    budget = float(raw)
    if not budget > 0 or budget != budget or budget == float("inf"):
        raise InvalidParameter(f"X-Deadline-Ms must be positive and finite, got {raw[:32]!r}")
    if budget < settings.min_deadline_ms:
        raise DeadlineTooShort(
            f"X-Deadline-Ms={raw[:32]} is below the minimum deadline of {settings.min_deadline_ms} ms (answer_margin_ms "
            f"{settings.deadlines.answer_margin_ms} + min_service_ms {settings.deadlines.min_service_ms}): too short to classify an image "
            "even on an idle server"
        )
    return Deadline.sliced(min(budget, settings.deadlines.max_deadline_ms), arrival, settings, loop_lag_ms)


def parse_priority(request: Request) -> str:
    """``X-Priority``: ``high``, ``normal`` (default) or ``low``, any case; the class name
    (``rampart.overload.admission.PRIORITIES``), else ``InvalidParameter``."""
    given = single_header(request, "x-priority")
    raw = ("normal" if given is None else given).strip().lower()
    if raw not in PRIORITIES:
        raise InvalidParameter(f"X-Priority must be 'high', 'normal' or 'low', got {raw[:32]!r}")
    return raw


async def read_body(request: Request, limit: int, deadline: Deadline) -> bytes:
    """The body, read as it streams in, within the request's deadline.

    Raises ``PayloadTooLarge`` as soon as it passes ``limit`` bytes,
    ``RequestTimeout`` (408) when it has not fully arrived by the deadline (a slow
    upload holds nothing past its own deadline), and ``ClientDisconnected`` when
    the client hangs up mid-body.
    """

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in body_chunks(request, limit)])

    return await within_deadline(collect(), deadline)


async def read_body_once(request: Request, limit: int, deadline: Deadline) -> bytearray:
    """``read_body``'s body, gathered into one ``bytearray`` as it arrives, so that it is never held twice:
    ``read_body`` keeps the chunks and joins them at the end, which holds the body twice for a moment
    (``bytes`` cannot be filled in place). For a large body read by code that takes a ``bytearray``
    (an ``/infer`` body: up to the batch cap). Growth is amortised (glibc extends a large buffer with
    ``mremap``, without a copy); nothing is allocated for a declared ``Content-Length`` before its bytes
    arrive. Raises what ``read_body`` raises.
    """

    async def collect() -> bytearray:
        body = bytearray()
        async for chunk in body_chunks(request, limit):
            body += chunk
        return body

    return await within_deadline(collect(), deadline)


async def body_chunks(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; ``PayloadTooLarge`` once they pass ``limit`` bytes (or Content-Length says so)."""
    declared = ascii_decimal(request.headers.get("content-length", ""))
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"the body is {declared} bytes; the limit is {limit} bytes")
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
        yield chunk


async def within_deadline(reading: Awaitable[T], deadline: Deadline, late: str = "the body did not arrive") -> T:
    """``reading``'s result; ``RequestTimeout`` past the deadline (its message starts with ``late``),
    ``ClientDisconnected`` if the client hangs up."""
    try:
        return await run_within(reading, deadline.remaining_s())
    except asyncio.TimeoutError:
        raise RequestTimeout(f"{late} within the deadline ({deadline.share_ms():.0f} ms)") from None
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection before sending the whole body") from None


def is_multipart(request: Request) -> bool:
    """True for a ``multipart/form-data`` request."""
    return request.headers.get("content-type", "").lower().startswith("multipart/form-data")


async def read_multipart(request: Request, field: str, max_files: int, part_limit: int,
                         deadline: Deadline, texts: dict[str, str | None] | None = None) -> list[tuple[str, bytes]]:
    """``(filename, bytes)`` of every part named ``field`` (1..``max_files`` of them), in order.

    ``texts``: the names of text fields wanted besides (its keys, values None); each such part's value
    (UTF-8, at most ``MAX_TEXT_FIELD_BYTES``, else ``InvalidParameter``) is stored under its
    name, the last one winning. BentoML's client sends ``top_k`` so (``rampart.api.bentoml_api``).

    The body is parsed as it streams in (python-multipart, the parser Starlette
    uses), so it is never held twice, and every dimension is bounded before work is
    spent on it:

    - the body: ``max_files`` × (``part_limit`` + ``MULTIPART_OVERHEAD_BYTES``) bytes,
      and each part named ``field``: ``part_limit`` bytes (``PayloadTooLarge``, 413);
    - the parts: ``max_files`` named ``field``, ``max_files`` + ``MAX_OTHER_PARTS`` in
      all (``TooManyParts``, 413), refused at the first part over either limit;
    - each part's headers: ``MAX_PART_HEADERS`` lines of at most
      ``MAX_PART_HEADER_LINE_BYTES`` (``PartHeadersTooLarge``, 413);
    - the event loop: the parser gets at most ``PARSE_SLICE_BYTES`` between yields.

    Parts need no Content-Type and no filename; parts with another name are
    counted and skipped. Raises ``InvalidParameter`` for a body that is not valid
    multipart (including one that ends before its closing boundary), ``EmptyBody``
    when no part has that name, and, like ``read_body``, ``RequestTimeout`` and
    ``ClientDisconnected``.
    """
    _, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if not boundary:
        raise InvalidParameter("multipart/form-data needs a boundary parameter")
    parts = MultipartParts(field, max_files, part_limit, texts)
    try:
        parser = MultipartParser(boundary, callbacks=parts.callbacks(), max_header_count=MAX_PART_HEADERS,
                                 max_header_size=MAX_PART_HEADER_LINE_BYTES)
    except FormParserError as exc:  # a boundary longer than the parser allows
        raise InvalidParameter(f"the multipart/form-data boundary is not valid: {exc}") from None

    preamble = Preamble(boundary)

    async def parse() -> None:
        async for chunk in body_chunks(request, max_files * (part_limit + MULTIPART_OVERHEAD_BYTES)):
            chunk = preamble.skip(chunk)
            for start in range(0, len(chunk), PARSE_SLICE_BYTES):
                if start:
                    await asyncio.sleep(0)  # let other requests run between slices
                feed(parser, chunk[start:start + PARSE_SLICE_BYTES])
        if parser.state != MultipartState.END:
            raise InvalidParameter("the multipart/form-data body ends before its closing boundary")

    await within_deadline(parse(), deadline)
    if not parts.files:
        raise EmptyBody(f"the multipart body has no part named {field!r}")
    return parts.files


#: Bytes a multipart body may carry before its first boundary (RFC 2046, section 5.1.1: a preamble, to be ignored).
MAX_PREAMBLE_BYTES = 64 * 1024


class Preamble:
    """Drops a multipart body's preamble, the text before its first boundary line that RFC 2046 (section 5.1.1)
    lets a sender put there and tells a receiver to ignore; python-multipart 0.0.34 takes only a blank line there.

    ``skip(chunk)`` gives what of ``chunk`` the parser should see: nothing until the first ``--boundary`` at the
    start of the body or of a line, then everything from it. ``InvalidParameter`` when none has come within
    ``MAX_PREAMBLE_BYTES``.
    """

    def __init__(self, boundary: bytes) -> None:
        self.delimiter = b"--" + boundary
        self.seen = bytearray()
        self.done = False

    def skip(self, chunk: bytes) -> bytes:
        if self.done:
            return chunk
        self.seen += chunk
        if self.seen.startswith(self.delimiter):
            start = 0
        else:
            found = self.seen.find(b"\r\n" + self.delimiter, 0, MAX_PREAMBLE_BYTES + 2 + len(self.delimiter))
            if found < 0:
                if len(self.seen) >= MAX_PREAMBLE_BYTES + 2 + len(self.delimiter):
                    raise InvalidParameter(f"the multipart/form-data body has no boundary line in its first "
                                           f"{MAX_PREAMBLE_BYTES} bytes")
                return b""
            start = found + 2
        self.done = True
        rest, self.seen = bytes(self.seen[start:]), bytearray()
        return rest


def feed(parser: MultipartParser, data: bytes) -> None:
    """Parse ``data``; python-multipart's own errors become ``PartHeadersTooLarge`` or ``InvalidParameter``."""
    try:
        parser.write(data)
    except FormParserError as exc:
        message = str(exc)
        if message.startswith("Maximum header"):  # python-multipart's two header limits (0.0.34)
            raise PartHeadersTooLarge(
                f"a multipart part has over {MAX_PART_HEADERS} header lines or one over "
                f"{MAX_PART_HEADER_LINE_BYTES} bytes") from None
        raise InvalidParameter(f"the multipart/form-data body could not be parsed: {message}") from None


class MultipartParts:
    """python-multipart callbacks that keep the parts named ``field`` and enforce the part limits.

    ``files`` holds ``(filename, bytes)`` of each finished part named ``field``.
    Part data goes into one ``bytearray`` per part, so a body cut into millions of
    tiny pieces costs no object per piece.
    """

    def __init__(self, field: str, max_files: int, part_limit: int, texts: dict[str, str | None] | None = None) -> None:
        self.field, self.max_files, self.part_limit = field, max_files, part_limit
        self.texts = {} if texts is None else texts  # wanted text fields: name -> value, filled in place
        self.text_name: str | None = None  # the current part's name, when it is a wanted text field
        self.max_parts = max_files + MAX_OTHER_PARTS
        self.files: list[tuple[str, bytes]] = []
        self.parts = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.name, self.value = bytearray(), bytearray()
        self.data: bytearray | None = None  # the current part's bytes, when it is named ``field``
        self.filename = ""

    def callbacks(self) -> dict:
        """The callback table for ``MultipartParser``."""
        return {
            "on_part_begin": self.part_begin,
            "on_header_field": lambda data, start, end: self.name.extend(memoryview(data)[start:end]),
            "on_header_value": lambda data, start, end: self.value.extend(memoryview(data)[start:end]),
            "on_header_end": self.header_end,
            "on_headers_finished": self.headers_finished,
            "on_part_data": self.part_data,
            "on_part_end": self.part_end,
        }

    def part_begin(self) -> None:
        self.parts += 1
        if self.parts > self.max_parts:
            raise TooManyParts(f"the multipart body has over {self.max_parts} parts; the limit is {self.max_parts} "
                               f"({self.max_files} named {self.field!r} and {MAX_OTHER_PARTS} others)")
        self.headers, self.data = [], None

    def header_end(self) -> None:
        self.headers.append((bytes(self.name).lower(), bytes(self.value)))
        self.name, self.value = bytearray(), bytearray()

    def headers_finished(self) -> None:
        _, params = parse_options_header(dict(self.headers).get(b"content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        self.text_name = None
        if name != self.field:
            if name in self.texts:
                self.text_name, self.data = name, bytearray()
            return
        if len(self.files) == self.max_files:
            hint = "; use /classify_batch for several images" if self.max_files == 1 else ""
            raise TooManyParts(f"the multipart body has over {self.max_files} parts named {self.field!r}; "
                               f"the limit is {self.max_files}{hint}")
        self.data, self.filename = bytearray(), params.get(b"filename", b"").decode("utf-8", "replace")

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self.data is None:
            return
        self.data.extend(memoryview(data)[start:end])
        if self.text_name is not None and len(self.data) > MAX_TEXT_FIELD_BYTES:
            raise InvalidParameter(f"the multipart field {self.text_name!r} is over {MAX_TEXT_FIELD_BYTES} bytes")
        if len(self.data) > self.part_limit:
            raise PayloadTooLarge(f"the part named {self.field!r} is over the limit of {self.part_limit} bytes")

    def part_end(self) -> None:
        if self.data is not None and self.text_name is not None:
            self.texts[self.text_name] = bytes(self.data).decode("utf-8", "replace")
        elif self.data is not None:
            self.files.append((self.filename, bytes(self.data)))
        self.data, self.text_name = None, None


def bodies_over_budget(settings: Settings, retry_after_s: float) -> Overloaded:
    """The 429 for a request whose body bytes do not fit in ``MAX_HELD_BODY_BYTES`` beside the other requests'
    (``rampart.api.arrival.InflightBound``, "Bytes held")."""
    return Overloaded(f"the request bodies this worker holds would pass {settings.inputs.max_held_body_bytes} bytes "
                      "(MAX_HELD_BODY_BYTES); retry later", retry_after_s)


def error_response(error: RampartError, request_id: str) -> JsonResponse:
    """The JSON error response for ``error``, with ``Retry-After`` on 429 and 503 and ``Allow`` on 405."""
    headers = {"X-Request-Id": request_id}
    if isinstance(error, (Overloaded, Unavailable)):
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    if isinstance(error, MethodNotAllowed) and error.allowed:
        headers["Allow"] = ", ".join(error.allowed)
    return JsonResponse(error.to_body(request_id), status_code=error.status, headers=headers)
