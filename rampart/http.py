"""HTTP request parsing and error responses (Starlette, no BentoML).

Everything here turns a malformed request into a ``rampart.errors`` exception,
and ``error_response`` is the one place where an error becomes an HTTP response.
"""

from __future__ import annotations

import email.parser
import email.policy
import re
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from .config import Settings
from .deadline import Deadline
from .errors import EmptyBody, InvalidParameter, Overloaded, PayloadTooLarge, RampartError
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
    return Deadline(max(min(budget, settings.max_deadline_ms) - margin_ms, 0))


def parse_priority(request: Request) -> bool:
    """``X-Priority``: ``high`` or ``normal`` (default), any case; True for high, else ``InvalidParameter``."""
    raw = request.headers.get("x-priority", "normal").strip().lower()
    if raw not in ("high", "normal"):
        raise InvalidParameter(f"X-Priority must be 'high' or 'normal', got {raw[:32]!r}")
    return raw == "high"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read as it streams in and refused (``PayloadTooLarge``) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is {declared} bytes; the limit is {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def is_multipart(request: Request) -> bool:
    """True for a ``multipart/form-data`` request."""
    return request.headers.get("content-type", "").lower().startswith("multipart/form-data")


def multipart_files(request: Request, body: bytes, field: str) -> list[tuple[str, bytes]]:
    """``(filename, bytes)`` of every part named ``field``, in order.

    Parts need no Content-Type and no filename. Parsed with the standard
    library's MIME parser, which keeps binary payloads byte-exact. Raises
    ``InvalidParameter`` for a body that is not multipart or has no such part.
    """
    content_type = request.headers.get("content-type", "")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise InvalidParameter("the multipart/form-data body could not be parsed")
    files = []
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == field:
            files.append((part.get_filename() or "", part.get_payload(decode=True) or b""))
    if not files:
        raise EmptyBody(f"the multipart body has no part named {field!r}")
    return files


def error_response(error: RampartError, request_id: str) -> JSONResponse:
    """The JSON error response for ``error``, with ``Retry-After`` on 429."""
    headers = {"X-Request-Id": request_id}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return JSONResponse(error.to_body(request_id), status_code=error.status, headers=headers)
