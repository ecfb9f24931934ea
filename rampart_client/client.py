"""Rampart's Python client: ``Client`` (sync, httpx) and ``AsyncClient`` (asyncio, aiohttp by default).

>>> from rampart_client import Client
>>> with Client("http://127.0.0.1:3000") as client:
...     prediction = client.classify("cat.jpg", top_k=3, deadline_ms=800)
...     print(prediction.top.label, prediction.degraded)

Both share the request building and response parsing below; only the
transport differs. ``AsyncClient`` sends over aiohttp because it was measured
(``python -m bench.client_bench``, docs/api.md, "Python client"): an
``httpx.AsyncClient`` spent 1.2-4.3 ms of CPU per call at 1-256 concurrent calls,
whatever its pool size, aiohttp 0.15-0.5 ms, and an SDK that burns milliseconds
per call competes with the server on a small host. ``AsyncClient(...,
transport="httpx")`` (or any httpx keyword argument) keeps httpx.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import sys
from pathlib import Path
from typing import Union

import httpx
from pydantic import ValidationError

from .backoff import Backoff, BackoffPolicy
from .errors import ClientTimeout, ConnectionFailed, ImageRejected, Overloaded, RampartClientError, ServiceError
from .models import Prediction

__all__ = ["Client", "AsyncClient", "ImageInput", "PRIORITIES"]

#: The server's priority classes, sent as ``X-Priority`` (``priority=`` of every classify call; None: the
#: server's default, ``normal``). ``low`` is bulk work that only fills capacity the others leave idle: it is
#: answered by the primary model or refused with 429, and has a long default deadline (server setting
#: ``low_priority_deadline_ms``). Send it from its own client: its 429s say nothing about room for normal
#: requests, and a client's back-off history is its own. Other strings are sent as given (the server: 422).
PRIORITIES = ("high", "normal", "low")

#: A path, raw encoded bytes, or a ``PIL.Image.Image`` (sent as PNG).
ImageInput = Union[str, os.PathLike, bytes, "PIL.Image.Image"]  # noqa: F821

DEFAULT_TIMEOUT_S = 30.0
#: Connections ``AsyncClient`` keeps open at most: as many calls as the load tests run at once (256).
#: aiohttp reuses them (keep-alive) and opens them on demand, so a smaller load opens fewer.
DEFAULT_MAX_CONNECTIONS = 256


#: PIL modes Pillow writes to a PNG as they are; any other (CMYK, YCbCr, LAB, HSV, F, I, ...) is converted to RGB first
#: (F and I through L: their values are clipped to 0..255).
PNG_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "I;16"})


def image_bytes(image: ImageInput) -> bytes:
    """The encoded bytes of ``image``; a PIL image is encoded losslessly as PNG (in RGB when PNG cannot hold its
    mode: a CMYK JPEG opened with Pillow). A PNG of a photo is several times its JPEG: for a photo read from a
    file, pass its path or bytes (a 16 MP phone JPEG of 5 MB makes a PNG of about 27 MB, over the server's
    20 MB cap: 413)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        return Path(image).read_bytes()
    if hasattr(image, "save"):
        if getattr(image, "mode", "RGB") not in PNG_MODES:
            image = (image.convert("L") if image.mode in ("F", "I") else image).convert("RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    raise TypeError(f"expected a path, bytes or a PIL image, got {type(image).__name__}")


def _headers(deadline_ms: float | None, request_id: str | None, priority: str | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/octet-stream"}
    if deadline_ms is not None:
        headers["X-Deadline-Ms"] = str(deadline_ms)
    if priority is not None:
        headers["X-Priority"] = priority
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return headers


def _batch_files(images: list[ImageInput]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("images", (f"image{i}", image_bytes(img), "application/octet-stream")) for i, img in enumerate(images)]


def _retry_after_s(headers: httpx.Headers | dict | None, default: float | None) -> float | None:
    """The ``Retry-After`` header in seconds (Rampart sends whole seconds); ``default`` if absent, a date, or not a
    finite number of seconds ≥ 0 (a server's ``nan`` or ``-1`` reached ``time.sleep``: a ``ValueError``, and an
    ``AsyncClient`` call that never returned)."""
    try:
        seconds = float((headers or {}).get("retry-after", ""))
    except ValueError:
        return default
    return seconds if math.isfinite(seconds) and seconds >= 0 else default


def error_from_body(status: int | None, body: dict | str, headers: httpx.Headers | None = None) -> RampartClientError:
    """The client error for an error body ``{"error": {"code", "message", "request_id"}}`` (a 429's
    also carries ``cause``: ``Overloaded.cause``). A body of another shape (a gateway's or a CDN's page, text or
    JSON) is mapped on the status alone: 429 ``Overloaded`` and 502/503/504 ``ServiceError``, each with the
    ``Retry-After`` header's delay, so that the back-off treats a rate limit in front of Rampart as what it is."""
    if isinstance(status, bool) or not isinstance(status, int):
        status = None  # a batch entry's status that is not a number: nothing to map it on
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        message = f"HTTP {status}: {str(body)[:200]}"
        if status == 429:
            return Overloaded(message, retry_after=_retry_after_s(headers, 1.0), status=status)
        return ServiceError(message, retry_after=_retry_after_s(headers, None), status=status)
    fields = {"status": status, "code": str(error.get("code", "")), "request_id": str(error.get("request_id", ""))}
    message = str(error.get("message", ""))
    if status == 429:
        cause = str(error.get("cause") or "capacity")
        return Overloaded(message, retry_after=_retry_after_s(headers, 1.0), cause=cause, **fields)
    if status is not None and 400 <= status < 500:
        return ImageRejected(message, **fields)
    return ServiceError(message, retry_after=_retry_after_s(headers, None), **fields)  # a draining replica's 503


def _json(response: httpx.Response) -> dict:
    """The response's JSON body; for an error status whose body is not JSON (a proxy's page), the error
    ``error_from_body`` maps on the status; ``ServiceError`` for a 200 that is not JSON."""
    try:
        return response.json()
    except (ValueError, RecursionError):  # RecursionError: a hostile server's deeply nested JSON
        text = f"not JSON: {response.text[:200]!r}"
        if response.status_code != 200:
            raise error_from_body(response.status_code, text, response.headers) from None
        raise ServiceError(f"HTTP {response.status_code}: {text}", status=response.status_code) from None


def parse_prediction(response: httpx.Response) -> Prediction:
    """A ``Prediction`` from a ``/classify`` response; raises a ``RampartClientError`` otherwise."""
    body = _json(response)
    if response.status_code != 200:
        raise error_from_body(response.status_code, body, response.headers)
    try:
        return Prediction.model_validate(body)
    except ValidationError as exc:
        raise ServiceError(f"unexpected response body: {exc}", status=200) from exc


def parse_batch(response: httpx.Response) -> list[Prediction | RampartClientError]:
    """One ``Prediction`` or error per image of a ``/classify_batch`` response, in order.

    A refused image's entry carries its HTTP ``status``, mapped as ``error_from_body`` maps a whole
    response's: 429 ``Overloaded``, other 4xx ``ImageRejected``, anything else ``ServiceError``.
    """
    body = _json(response)
    if response.status_code != 200:
        raise error_from_body(response.status_code, body, response.headers)
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list) or not all(isinstance(entry, dict) for entry in results):
        raise ServiceError(f"unexpected response body: no list of results: {str(body)[:200]}", status=200)
    request_id = body.get("request_id", "")
    out: list[Prediction | RampartClientError] = []
    for entry in results:
        if "error" in entry:  # mapped on the image's own HTTP status, like a /classify answer
            out.append(error_from_body(entry.get("status"), entry))
            continue
        try:
            out.append(Prediction.model_validate({"request_id": request_id, **entry}))
        except ValidationError as exc:
            raise ServiceError(f"unexpected response body: {exc}", status=200) from exc
    return out


def _transport_error(exc: Exception) -> ServiceError:
    """The error for a transport failure with no answer (httpx's or aiohttp's): ``ClientTimeout`` for the client's own timeout,
    ``ConnectionFailed`` for a connection that could not be made or broke, ``ServiceError`` for anything else."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):  # aiohttp's total timeout is asyncio's
        return ClientTimeout(message)
    aiohttp = sys.modules.get("aiohttp")  # AsyncClient's default transport, imported only where used
    if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError, ConnectionError)) or (
            aiohttp is not None and isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                                                     aiohttp.ClientResponseError))):
        return ConnectionFailed(message)  # aiohttp: a body cut short (payload), a garbled status line (response)
    return ServiceError(message)


def server_url(url: str) -> str:
    """``url`` checked as the address of a Rampart server: ``http`` or ``https``, a host, an optional port and path
    prefix, no query or fragment (``http://h:3000?x=1`` sent every call to ``/``: a 405). Raises ``ValueError``."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"not a URL: {url!r} ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"the server's URL must be http(s)://host[:port][/prefix], got {url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"the server's URL must have no query or fragment, got {url!r}")
    return url


class Client:
    """A synchronous client for a Rampart server at ``url``; use as a context manager or ``close()``.

    ``backoff`` sets the adaptive throttling and retries (``rampart_client.backoff``; None: the
    defaults; ``BackoffPolicy.disabled()``: one attempt, no local rejection); ``backoff_stats()``
    counts them. A client's history is its own: share one client rather than making one per request.
    """

    def __init__(self, url: str = "http://127.0.0.1:3000", timeout: float = DEFAULT_TIMEOUT_S,
                 backoff: BackoffPolicy | None = None, **httpx_kwargs) -> None:
        self._http = httpx.Client(base_url=server_url(url), timeout=timeout, **httpx_kwargs)
        self.backoff = Backoff(backoff)

    def backoff_stats(self) -> dict:
        """The client's back-off counters (``Backoff.stats``)."""
        return self.backoff.stats()

    def classify(
        self, image: ImageInput, top_k: int = 5, deadline_ms: float | None = None, request_id: str | None = None,
        priority: str | None = None,
    ) -> Prediction:
        """Classify one image (``priority``: one of ``PRIORITIES``). Raises ``ImageRejected``, ``Overloaded``
        (``Throttled``) or ``ServiceError``."""
        content = image_bytes(image)

        def send(deadline: float | None) -> Prediction:
            try:
                response = self._http.post(
                    "/classify", content=content, params={"top_k": top_k}, headers=_headers(deadline, request_id, priority)
                )
            except httpx.HTTPError as exc:
                raise _transport_error(exc) from exc
            return parse_prediction(response)

        return self.backoff.call_sync(send, deadline_ms)

    def classify_batch(
        self, images: list[ImageInput], top_k: int = 5, deadline_ms: float | None = None, priority: str | None = None
    ) -> list[Prediction | RampartClientError]:
        """Classify several images in one request; a refused image yields its error in place."""
        files = _batch_files(images)

        def send(deadline: float | None) -> list[Prediction | RampartClientError]:
            headers = _headers(deadline, None, priority)
            headers.pop("Content-Type")
            try:
                response = self._http.post("/classify_batch", files=files, params={"top_k": top_k}, headers=headers)
            except httpx.HTTPError as exc:
                raise _transport_error(exc) from exc
            return parse_batch(response)

        return self.backoff.call_sync(send, deadline_ms)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _AiohttpTransport:
    """``post(path, ...) -> httpx.Response`` over one aiohttp session (created on first use, in the running loop)."""

    def __init__(self, url: str, timeout: float, max_connections: int) -> None:
        import aiohttp

        self.errors = (aiohttp.ClientError, asyncio.TimeoutError)
        self._aiohttp = aiohttp
        self._url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._max_connections = max_connections
        self._session = None

    async def post(self, path: str, *, params: dict, headers: dict[str, str], content: bytes | None = None,
                   files: list | None = None) -> httpx.Response:
        aiohttp = self._aiohttp
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=300),
                timeout=self._timeout)
        if files is not None:
            data = aiohttp.FormData()
            for field, (filename, body, content_type) in files:
                data.add_field(field, body, filename=filename, content_type=content_type)
        else:
            data = content
        async with self._session.post(self._url + path, data=data, params={k: str(v) for k, v in params.items()},
                                      headers=headers) as response:
            body = await response.read()
            # aiohttp has inflated a gzipped answer already (a proxy's ``gzip on``): httpx must not inflate it again
            headers = [(name, value) for name, value in response.headers.items()
                       if name.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
            return httpx.Response(response.status, headers=headers, content=body)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _HttpxTransport:
    """``post(path, ...) -> httpx.Response`` over an ``httpx.AsyncClient``."""

    errors = (httpx.HTTPError,)

    def __init__(self, url: str, timeout: float, **httpx_kwargs) -> None:
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout, **httpx_kwargs)

    async def post(self, path: str, **kwargs) -> httpx.Response:
        return await self._http.post(path, **kwargs)

    async def aclose(self) -> None:
        await self._http.aclose()


class AsyncClient:
    """The asyncio twin of ``Client``: same methods, awaited; use ``async with`` or ``aclose()``.

    ``transport`` is ``"aiohttp"`` (default, at most ``max_connections`` keep-alive
    connections) or ``"httpx"``; passing any httpx keyword argument selects httpx.
    """

    def __init__(self, url: str = "http://127.0.0.1:3000", timeout: float = DEFAULT_TIMEOUT_S,
                 transport: str = "aiohttp", max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 backoff: BackoffPolicy | None = None, **httpx_kwargs) -> None:
        self.backoff = Backoff(backoff)
        url = server_url(url)
        if transport not in ("aiohttp", "httpx"):
            raise ValueError(f"transport must be 'aiohttp' or 'httpx', got {transport!r}")
        if transport == "httpx" or httpx_kwargs:
            httpx_kwargs.setdefault("limits", httpx.Limits(max_connections=max_connections,
                                                           max_keepalive_connections=max_connections))
            self._http = _HttpxTransport(url, timeout, **httpx_kwargs)
        else:
            self._http = _AiohttpTransport(url, timeout, max_connections)

    def backoff_stats(self) -> dict:
        """The client's back-off counters (``Backoff.stats``)."""
        return self.backoff.stats()

    async def classify(
        self, image: ImageInput, top_k: int = 5, deadline_ms: float | None = None, request_id: str | None = None,
        priority: str | None = None,
    ) -> Prediction:
        """Classify one image (``priority``: one of ``PRIORITIES``). Raises ``ImageRejected``, ``Overloaded``
        (``Throttled``) or ``ServiceError``."""
        content = image_bytes(image)

        async def send(deadline: float | None) -> Prediction:
            try:
                response = await self._http.post(
                    "/classify", content=content, params={"top_k": top_k}, headers=_headers(deadline, request_id, priority)
                )
            except self._http.errors as exc:
                raise _transport_error(exc) from exc
            return parse_prediction(response)

        return await self.backoff.call_async(send, deadline_ms)

    async def classify_batch(
        self, images: list[ImageInput], top_k: int = 5, deadline_ms: float | None = None, priority: str | None = None
    ) -> list[Prediction | RampartClientError]:
        """Classify several images in one request; a refused image yields its error in place."""
        files = _batch_files(images)

        async def send(deadline: float | None) -> list[Prediction | RampartClientError]:
            headers = _headers(deadline, None, priority)
            headers.pop("Content-Type")
            try:
                response = await self._http.post("/classify_batch", files=files, params={"top_k": top_k}, headers=headers)
            except self._http.errors as exc:
                raise _transport_error(exc) from exc
            return parse_batch(response)

        return await self.backoff.call_async(send, deadline_ms)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
