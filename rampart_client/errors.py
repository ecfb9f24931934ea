"""Errors raised by the Rampart client.

::

    RampartClientError
    ├── ImageRejected     a 4xx: the request or image was refused; ``code`` says why
    ├── Overloaded        a 429: retry after ``retry_after`` seconds
    │   └── Throttled     refused by the client itself (adaptive throttling, rampart_client.backoff)
    └── ServiceError      anything else: 5xx, a bad body, and
        ├── ConnectionFailed  no answer: the connection could not be made or broke (``code`` "connection_failed")
        └── ClientTimeout     no answer within the client's own ``timeout`` (``code`` "client_timeout")
"""

from __future__ import annotations

__all__ = ["RampartClientError", "ImageRejected", "Overloaded", "Throttled", "ServiceError", "ConnectionFailed",
           "ClientTimeout"]


class RampartClientError(Exception):
    """Base class: ``status`` (HTTP, or None), ``code``, ``message``, ``request_id``."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "", request_id: str = "") -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.message = message
        self.status = status
        self.code = code
        self.request_id = request_id


class ImageRejected(RampartClientError):
    """The server answered 4xx (not 429): fix the request; retrying it unchanged fails again."""


class Overloaded(RampartClientError):
    """The server answered 429 (its ``rampart.errors.Overloaded``); ``retry_after`` is the Retry-After
    header in seconds.

    ``cause`` is the body's ``error.cause``: ``capacity`` (no model has room: overload) or
    ``deadline`` (the request's own deadline was used up before the server could start on it:
    retrying with the same deadline fails again, and it is not a sign of overload). Servers
    older than the field send none: ``capacity``.
    """

    def __init__(self, message: str, *, retry_after: float, cause: str = "capacity", **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after
        self.cause = cause


class Throttled(Overloaded):
    """Never sent: the client's adaptive throttle refused the request because the service is shedding."""


class ServiceError(RampartClientError):
    """A 5xx, a transport failure (``status`` None) or an unreadable response; ``retry_after`` in
    seconds when the server sent ``Retry-After`` (a draining replica's 503), else None."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ConnectionFailed(ServiceError):
    """No answer came: the connection could not be opened (server down, wrong address) or broke before the answer
    (``status`` None, ``code`` "connection_failed"). Whether the server classified the image is unknown."""

    def __init__(self, message: str, **kwargs) -> None:
        super().__init__(message, code="connection_failed", **kwargs)


class ClientTimeout(ServiceError):
    """No answer within the client's own ``timeout`` (seconds; ``status`` None, ``code`` "client_timeout"). The
    server may still answer it; a ``deadline_ms`` shorter than ``timeout`` gets a timely answer instead."""

    def __init__(self, message: str, **kwargs) -> None:
        super().__init__(message, code="client_timeout", **kwargs)
