"""Rampart's error tree: every answer that is not a result is one of these.

::

    RampartError                      (code, HTTP status, message)
    ├── RequestError                  the client's problem: 4xx
    │   ├── ImageError                the uploaded bytes are not an image Rampart can classify
    │   │   ├── EmptyBody             400 empty_body
    │   │   ├── UndecodableImage      400 undecodable_image
    │   │   ├── CorruptImage          400 corrupt_image
    │   │   ├── PayloadTooLarge       413 payload_too_large
    │   │   ├── ImageTooLarge         413 image_too_large
    │   │   ├── UnsupportedFormat     415 unsupported_format
    │   │   ├── ImageTooSmall         422 image_too_small
    │   │   ├── AspectRatioOutOfRange 422 aspect_ratio_out_of_range
    │   │   ├── TooManyFrames         422 too_many_frames
    │   │   ├── DecodeCostTooHigh     422 decode_cost_too_high
    │   │   └── DecodeTimeout         422 decode_timeout
    │   ├── NotFound                  404 not_found
    │   ├── MethodNotAllowed          405 method_not_allowed
    │   ├── RequestTimeout            408 request_timeout
    │   ├── ClientDisconnected        499 client_disconnected (never seen by the client)
    │   ├── TooManyParts              413 too_many_parts
    │   ├── PartHeadersTooLarge       413 part_headers_too_large
    │   ├── InvalidParameter          422 invalid_parameter
    │   ├── DeadlineTooShort          422 deadline_too_short
    │   └── HeadersTooLarge           431 headers_too_large
    ├── Overloaded                    429 overloaded (with Retry-After)
    ├── Unavailable                   503, with Retry-After: this server cannot serve now
    │   ├── NotReady                  503 not_ready (the runners are still warming up)
    │   └── ShuttingDown              503 shutting_down (draining after SIGTERM)
    └── InternalError                 500 internal_error (Rampart's own fault)

The HTTP status lives on the class, so the service maps errors to responses in
one place (``RampartError.to_body``) and a guard test checks every class.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "RampartError",
    "RequestError",
    "ImageError",
    "EmptyBody",
    "UndecodableImage",
    "CorruptImage",
    "NotFound",
    "MethodNotAllowed",
    "RequestTimeout",
    "ClientDisconnected",
    "PayloadTooLarge",
    "ImageTooLarge",
    "TooManyParts",
    "PartHeadersTooLarge",
    "UnsupportedFormat",
    "ImageTooSmall",
    "AspectRatioOutOfRange",
    "TooManyFrames",
    "DecodeCostTooHigh",
    "DecodeTimeout",
    "InvalidParameter",
    "DeadlineTooShort",
    "HeadersTooLarge",
    "MalformedRequest",
    "Overloaded",
    "Unavailable",
    "NotReady",
    "ShuttingDown",
    "InternalError",
    "ERROR_CLASSES",
]


class RampartError(Exception):
    """Base class: ``code`` (stable, snake_case), ``status`` (HTTP) and a message."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_body(self, request_id: str) -> dict:
        """The JSON error body: ``{"error": {"code", "message", "request_id"}}``."""
        return {"error": {"code": self.code, "message": self.message, "request_id": request_id}}


class RequestError(RampartError):
    """The request itself is wrong; retrying it unchanged will fail again."""

    status = 400


class ImageError(RequestError):
    """The uploaded bytes are not an image Rampart can classify."""


class EmptyBody(ImageError):
    """The request carried no image bytes."""

    code, status = "empty_body", 400


class UndecodableImage(ImageError):
    """The bytes start like a supported format but no decoder accepts them."""

    code, status = "undecodable_image", 400


class CorruptImage(ImageError):
    """The header was read but the pixel data is truncated or corrupt."""

    code, status = "corrupt_image", 400


class NotFound(RequestError):
    """No route serves this path."""

    code, status = "not_found", 404


class MethodNotAllowed(RequestError):
    """The path is served, but not for this HTTP method; ``allowed`` lists those that are."""

    code, status = "method_not_allowed", 405

    def __init__(self, message: str, allowed: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.allowed = allowed


class RequestTimeout(RequestError):
    """The request (its head or its body) did not fully arrive, or could not be read, before its deadline."""

    code, status = "request_timeout", 408


class ClientDisconnected(RequestError):
    """The client hung up before sending the whole body (nginx's 499; only logged and counted)."""

    code, status = "client_disconnected", 499


class PayloadTooLarge(ImageError):
    """The body is larger than ``max_body_bytes``."""

    code, status = "payload_too_large", 413


class ImageTooLarge(ImageError):
    """The header declares more than ``max_pixels`` pixels (a decompression bomb), or a WebP more than its
    share of them (``rampart.inputs.decoding.WEBP_PIXEL_SHARE``)."""

    code, status = "image_too_large", 413


class TooManyParts(RequestError):
    """A multipart body has more parts than the route accepts (``rampart.api.http`` limits)."""

    code, status = "too_many_parts", 413


class PartHeadersTooLarge(RequestError):
    """A multipart part has too many header lines, or one that is too long (``rampart.api.http`` limits)."""

    code, status = "part_headers_too_large", 413


class UnsupportedFormat(ImageError):
    """The bytes are not one of the supported image formats."""

    code, status = "unsupported_format", 415


class ImageTooSmall(ImageError):
    """A side is shorter than ``min_side_px``."""

    code, status = "image_too_small", 422


class AspectRatioOutOfRange(ImageError):
    """The long side is more than ``max_aspect_ratio`` times the short side."""

    code, status = "aspect_ratio_out_of_range", 422


class TooManyFrames(ImageError):
    """An animation or multipage file has more than ``max_frames`` frames."""

    code, status = "too_many_frames", 422


class DecodeCostTooHigh(ImageError):
    """The container declares more decoding work than the limits allow (JPEG scans, chunks): see ``rampart.inputs.decode_cost``."""

    code, status = "decode_cost_too_high", 422


class DecodeTimeout(ImageError):
    """Decoding one upload took longer than ``decode_timeout_ms``."""

    code, status = "decode_timeout", 422


class InvalidParameter(RequestError):
    """A query parameter, header or form field is malformed or out of range."""

    code, status = "invalid_parameter", 422


class DeadlineTooShort(RequestError):
    """``X-Deadline-Ms`` is below ``min_deadline_ms``: too short to classify an image even on an idle server."""

    code, status = "deadline_too_short", 422


class HeadersTooLarge(RequestError):
    """The request line and headers together are longer than ``rampart.compat.uvicorn_httptools.MAX_HEAD_BYTES``."""

    code, status = "headers_too_large", 431


class MalformedRequest(RequestError):
    """Not an HTTP/1.1 request Rampart serves (bad length, chunk, method or header; an upgrade); then closed."""

    code, status = "malformed_request", 400


class Overloaded(RampartError):
    """No capacity now; retry after ``retry_after_s`` seconds.

    ``cause`` (in the body as ``error.cause``) says why: ``capacity`` (no model has room) or
    ``deadline`` (the request's deadline, though above ``min_deadline_ms``, was used up before
    work on it could start: by waiting to be read or by the event loop's lag; or, for a low-priority
    request, which has no fallback, before the primary answered). A client counts
    only ``capacity`` as the server's overload (``rampart_client.backoff``). Raised by the
    pipeline, the decode pool and the in-flight bound alike; the SDK raises its own
    ``rampart_client.Overloaded`` (``retry_after``, ``cause``) for this answer.
    """

    code, status = "overloaded", 429
    CAUSES: ClassVar[tuple[str, ...]] = ("capacity", "deadline")

    def __init__(self, message: str, retry_after_s: float = 1.0, cause: str = "capacity") -> None:
        if cause not in self.CAUSES:
            raise ValueError(f"cause must be one of {self.CAUSES}, got {cause!r}")
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.cause = cause

    def to_body(self, request_id: str) -> dict:
        """``{"error": {"code", "message", "request_id", "cause"}}``."""
        body = super().to_body(request_id)
        body["error"]["cause"] = self.cause
        return body


class Unavailable(RampartError):
    """This server cannot serve requests now (start-up or drain); retry after ``retry_after_s`` seconds,
    on this server or another replica."""

    code, status = "unavailable", 503

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(Unavailable):
    """The model runners have not finished warm-up; ``/readyz`` is 503 meanwhile."""

    code = "not_ready"


class ShuttingDown(Unavailable):
    """The server got SIGTERM: it answers the requests it already admitted and refuses new ones."""

    code = "shutting_down"


class InternalError(RampartError):
    """Rampart's own fault. No input may cause one."""

    code, status = "internal_error", 500


def _concrete(base: type[RampartError]) -> tuple[type[RampartError], ...]:
    """The classes under ``base`` that nothing subclasses (the errors actually raised), depth first in
    definition order; the grouping classes (``RequestError``, ``ImageError``, ``Unavailable``) are left out."""
    below = base.__subclasses__()
    return tuple(leaf for cls in below for leaf in _concrete(cls)) if below else (base,)


#: Every error Rampart answers with, one class per ``code``: the leaves of the tree above, derived once
#: this module has defined them (a guard test checks each is documented in docs/api.md and mapped by the SDK).
ERROR_CLASSES: tuple[type[RampartError], ...] = _concrete(RampartError)
