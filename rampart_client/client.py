"""Rampart's Python client: ``Client`` (sync) and ``AsyncClient`` (asyncio), over httpx.

>>> from rampart_client import Client
>>> with Client("http://127.0.0.1:3000") as client:
...     prediction = client.classify("cat.jpg", top_k=3, deadline_ms=800)
...     print(prediction.top.label, prediction.degraded)

Both share the request building and response parsing below; only the
transport differs.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Union

import httpx
from pydantic import ValidationError

from .backoff import Backoff, BackoffPolicy
from .errors import ImageRejected, Overloaded, RampartClientError, ServiceError
from .models import Prediction

__all__ = ["Client", "AsyncClient", "ImageInput"]

#: A path, raw encoded bytes, or a ``PIL.Image.Image`` (sent as PNG).
ImageInput = Union[str, os.PathLike, bytes, "PIL.Image.Image"]  # noqa: F821

DEFAULT_TIMEOUT_S = 30.0


def image_bytes(image: ImageInput) -> bytes:
    """The encoded bytes of ``image``; a PIL image is encoded losslessly as PNG."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        return Path(image).read_bytes()
    if hasattr(image, "save"):
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
    """The ``Retry-After`` header in seconds (Rampart sends whole seconds); ``default`` if absent or a date."""
    try:
        return float((headers or {}).get("retry-after", ""))
    except ValueError:
        return default


def error_from_body(status: int | None, body: dict, headers: httpx.Headers | None = None) -> RampartClientError:
    """The client error for an error body ``{"error": {"code", "message", "request_id"}}``."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return ServiceError(f"HTTP {status}: {str(body)[:200]}", status=status)
    fields = {"status": status, "code": str(error.get("code", "")), "request_id": str(error.get("request_id", ""))}
    message = str(error.get("message", ""))
    if status == 429:
        return Overloaded(message, retry_after=_retry_after_s(headers, 1.0), **fields)
    if status is not None and 400 <= status < 500:
        return ImageRejected(message, **fields)
    return ServiceError(message, retry_after=_retry_after_s(headers, None), **fields)  # a draining replica's 503


def _json(response: httpx.Response) -> dict:
    try:
        return response.json()
    except ValueError:
        raise ServiceError(f"HTTP {response.status_code}: not JSON: {response.text[:200]!r}", status=response.status_code) from None


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
    """One ``Prediction`` or error per image of a ``/classify_batch`` response, in order."""
    body = _json(response)
    if response.status_code != 200:
        raise error_from_body(response.status_code, body, response.headers)
    request_id = body.get("request_id", "")
    out: list[Prediction | RampartClientError] = []
    for entry in body.get("results", []):
        if "error" in entry:
            status = 429 if entry["error"].get("code") == "overloaded" else 400
            out.append(error_from_body(status, entry))
        else:
            out.append(Prediction.model_validate({"request_id": request_id, **entry}))
    return out


def _transport_error(exc: httpx.HTTPError) -> ServiceError:
    return ServiceError(f"{type(exc).__name__}: {exc}")


class Client:
    """A synchronous client for a Rampart server at ``url``; use as a context manager or ``close()``.

    ``backoff`` sets the adaptive throttling and retries (``rampart_client.backoff``; None: the
    defaults; ``BackoffPolicy.disabled()``: one attempt, no local rejection); ``backoff_stats()``
    counts them. A client's history is its own: share one client rather than making one per request.
    """

    def __init__(self, url: str = "http://127.0.0.1:3000", timeout: float = DEFAULT_TIMEOUT_S,
                 backoff: BackoffPolicy | None = None, **httpx_kwargs) -> None:
        self._http = httpx.Client(base_url=url, timeout=timeout, **httpx_kwargs)
        self.backoff = Backoff(backoff)

    def backoff_stats(self) -> dict:
        """The client's back-off counters (``Backoff.stats``)."""
        return self.backoff.stats()

    def classify(
        self, image: ImageInput, top_k: int = 5, deadline_ms: float | None = None, request_id: str | None = None,
        priority: str | None = None,
    ) -> Prediction:
        """Classify one image. Raises ``ImageRejected``, ``Overloaded`` (``Throttled``) or ``ServiceError``."""
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


class AsyncClient:
    """The asyncio twin of ``Client``: same methods, awaited; use ``async with`` or ``aclose()``."""

    def __init__(self, url: str = "http://127.0.0.1:3000", timeout: float = DEFAULT_TIMEOUT_S,
                 backoff: BackoffPolicy | None = None, **httpx_kwargs) -> None:
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout, **httpx_kwargs)
        self.backoff = Backoff(backoff)

    def backoff_stats(self) -> dict:
        """The client's back-off counters (``Backoff.stats``)."""
        return self.backoff.stats()

    async def classify(
        self, image: ImageInput, top_k: int = 5, deadline_ms: float | None = None, request_id: str | None = None,
        priority: str | None = None,
    ) -> Prediction:
        """Classify one image. Raises ``ImageRejected``, ``Overloaded`` (``Throttled``) or ``ServiceError``."""
        content = image_bytes(image)

        async def send(deadline: float | None) -> Prediction:
            try:
                response = await self._http.post(
                    "/classify", content=content, params={"top_k": top_k}, headers=_headers(deadline, request_id, priority)
                )
            except httpx.HTTPError as exc:
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
            except httpx.HTTPError as exc:
                raise _transport_error(exc) from exc
            return parse_batch(response)

        return await self.backoff.call_async(send, deadline_ms)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
