"""HTTP request parsing and error responses (Starlette, no BentoML).

Everything here turns a malformed request into a ``rampart.errors`` exception,
and ``error_response`` is the one place where an error becomes an HTTP response.
"""

from __future__ import annotations

import asyncio
import re
import uuid

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from .config import Settings
from .deadline import Deadline, run_within
from .errors import (
    BodyTimeout,
    ClientDisconnected,
    EmptyBody,
    InvalidParameter,
    Overloaded,
    PayloadTooLarge,
    RampartError,
    Unavailable,
)
from .results import MAX_TOP_K

__all__ = [
    "request_id_of",
    "parse_top_k",
    "parse_deadline",
    "parse_priority",
    "read_body",
    "multipart_files",
    "error_response",
]

#: Room for multipart boundaries and part headers on top of the image byte cap.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(request: Request) -> str:
    """``X-Request-Id`` when it is 1-128 safe characters, else a new uuid4 hex."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


def parse_top_k(request: Request) -> int:
    """Query ``top_k``: an integer in 1..20, default 5; else ``InvalidParameter``."""
    raw = request.query_params.get("top_k", "5")
    try:
        top_k = int(raw)
    except ValueError:
        raise InvalidParameter(f"top_k must be an integer in 1..{MAX_TOP_K}, got {raw[:32]!r}") from None
    if not 1 <= top_k <= MAX_TOP_K:
        raise InvalidParameter(f"top_k must be in 1..{MAX_TOP_K}, got {top_k}")
    return top_k


def parse_deadline(request: Request, settings: Settings, loop_lag_ms: float = 0.0) -> Deadline:
    """``X-Deadline-Ms``: a positive number of ms, default ``default_deadline_ms``, capped at ``max_deadline_ms``.

    The ``Deadline`` returned ends ``answer_margin_ms`` + ``loop_lag_ms`` (the event
    loop's recent lag) earlier, so the answer is sent by the client's deadline.
    """
    margin_ms = settings.answer_margin_ms + loop_lag_ms
    raw = request.headers.get("x-deadline-ms")
    if raw is None:
        return Deadline(max(settings.default_deadline_ms - margin_ms, 0))
    try:
        budget = float(raw)
    except ValueError:
        raise InvalidParameter(f"X-Deadline-Ms must be a number of milliseconds, got {raw[:32]!r}") from None
    if not budget > 0 or budget != budget or budget == float("inf"):
        raise InvalidParameter(f"X-Deadline-Ms must be positive and finite, got {raw[:32]!r}")
    if budget <= settings.answer_margin_ms:
        raise InvalidParameter(
            f"X-Deadline-Ms={raw[:32]} leaves no time to answer; it must exceed {settings.answer_margin_ms} ms"
        )
    return Deadline(max(min(budget, settings.max_deadline_ms) - margin_ms, 0))


def parse_priority(request: Request) -> bool:
    """``X-Priority``: ``high`` or ``normal`` (default), any case; True for high, else ``InvalidParameter``."""
    raw = request.headers.get("x-priority", "normal").strip().lower()
    if raw not in ("high", "normal"):
        raise InvalidParameter(f"X-Priority must be 'high' or 'normal', got {raw[:32]!r}")
    return raw == "high"


async def read_body(request: Request, limit: int, deadline: Deadline) -> bytes:
    """The body, read as it streams in, within the request's deadline.

    Raises ``PayloadTooLarge`` as soon as it passes ``limit`` bytes,
    ``BodyTimeout`` (408) when it has not fully arrived by the deadline (a slow
    upload holds nothing past its own deadline), and ``ClientDisconnected`` when
    the client hangs up mid-body.
    """
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is {declared} bytes; the limit is {limit} bytes")

    async def stream() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await run_within(stream(), deadline.remaining_s())
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the body did not arrive within the deadline ({deadline.budget_ms:.0f} ms)") from None
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection before sending the whole body") from None


def is_multipart(request: Request) -> bool:
    """True for a ``multipart/form-data`` request."""
    return request.headers.get("content-type", "").lower().startswith("multipart/form-data")


def multipart_files(request: Request, body: bytes, field: str) -> list[tuple[str, bytes]]:
    """``(filename, bytes)`` of every part named ``field``, in order.

    Parts need no Content-Type and no filename. Parsed with python-multipart (the
    parser Starlette itself uses): linear in the body size, with bounded part
    headers, so a hostile body cannot stall the event loop. Raises
    ``InvalidParameter`` for a body that is not valid multipart and ``EmptyBody``
    when no part has that name.
    """
    _, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if not boundary:
        raise InvalidParameter("multipart/form-data needs a boundary parameter")
    parts: list[tuple[list[tuple[bytes, bytes]], list[bytes]]] = []
    header = [b"", b""]

    def begin() -> None:
        parts.append(([], []))
        header[:] = [b"", b""]

    def header_end() -> None:
        parts[-1][0].append((header[0].lower(), header[1]))
        header[:] = [b"", b""]

    callbacks = {
        "on_part_begin": begin,
        "on_header_field": lambda data, start, end: header.__setitem__(0, header[0] + data[start:end]),
        "on_header_value": lambda data, start, end: header.__setitem__(1, header[1] + data[start:end]),
        "on_header_end": header_end,
        "on_part_data": lambda data, start, end: parts[-1][1].append(data[start:end]),
    }
    try:
        parser = MultipartParser(boundary, callbacks=callbacks)
        parser.write(body)
        parser.finalize()
    except Exception as exc:  # python-multipart raises its own errors for malformed bodies
        raise InvalidParameter(f"the multipart/form-data body could not be parsed: {exc}") from None
    files = []
    for headers, chunks in parts:
        disposition = dict(headers).get(b"content-disposition", b"")
        _, params = parse_options_header(disposition)
        if params.get(b"name", b"").decode("utf-8", "replace") == field:
            files.append((params.get(b"filename", b"").decode("utf-8", "replace"), b"".join(chunks)))
    if not files:
        raise EmptyBody(f"the multipart body has no part named {field!r}")
    return files


def error_response(error: RampartError, request_id: str) -> JSONResponse:
    """The JSON error response for ``error``, with ``Retry-After`` on 429 and 503."""
    headers = {"X-Request-Id": request_id}
    if isinstance(error, (Overloaded, Unavailable)):
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return JSONResponse(error.to_body(request_id), status_code=error.status, headers=headers)
