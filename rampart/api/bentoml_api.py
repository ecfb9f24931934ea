"""What BentoML's own client and ``/docs`` page need to see ``/classify``.

BentoML builds ``bentoml.SyncHTTPClient`` / ``AsyncHTTPClient`` methods and the
OpenAPI page at ``/docs`` from ``@bentoml.api`` methods only, never from mounted
Starlette routes. So the service declares one thin API, ``classify`` at
``CLASSIFY_API_ROUTE``, whose request body stays unread by BentoML (``ImageUpload``
hands the Starlette request straight through) and whose handler is the very
coroutine behind ``POST /classify``: the same streaming byte cap, deadline, error
bodies and status codes. Its schema is a multipart field ``image`` (so the client
sends what ``curl -F image=@cat.jpg`` sends) answered by ``ClassifyAnswer``.

Why a second route and not ``/classify`` itself: BentoML puts API routes before
mounted apps, so an API at ``/classify`` would take that path's 404/405 handling
away from Rampart's Starlette app.

Unlike the rest of ``rampart/``, this module imports BentoML (its IO model base
class); only ``service.py`` imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from _bentoml_sdk.io_models import IODescriptor
from pydantic import BaseModel, Field

from rampart.errors import ERROR_CLASSES

__all__ = ["CLASSIFY_API_ROUTE", "ImageUpload", "ClassifyAnswer", "error_table", "documented"]

#: Where BentoML's client posts for ``client.classify(path)``; answers exactly as ``POST /classify``.
CLASSIFY_API_ROUTE = "/bentoml/classify"


class ImageUpload(IODescriptor):
    """The image to classify, as the multipart field `image`."""

    # ``from_http_request`` does not read the body: it hands the Starlette request itself
    # to the handler as ``image``, and /classify's handler reads it (``rampart.api.http.read_body``).
    # A multipart field rather than a raw body because BentoML 1.4.29's AsyncHTTPClient
    # cannot send a raw file body (it gives httpx.AsyncClient a sync iterator).
    image: Path = Field(description="the image file: JPEG, PNG, GIF, WEBP, BMP or TIFF")

    @classmethod
    async def from_http_request(cls, request: Any, serde: Any) -> "ImageUpload":
        return cls.model_construct(image=request)


class Label(BaseModel):
    index: int = Field(description="ImageNet-1k class index, 0..999")
    label: str = Field(description="class name")
    score: float = Field(description="softmax probability, 0..1")


class ModelRef(BaseModel):
    name: str = Field(description="rampart-primary or rampart-fallback")
    version: str = Field(description="BentoML model store version")


class Timings(BaseModel):
    decode: float = Field(description="decode and resize, ms")
    queue: float = Field(description="admission queue and runner transport, ms")
    inference: float = Field(description="model forward pass, ms")
    total: float = Field(description="the whole answer, ms")


class ClassifyAnswer(BaseModel):
    """A ``200`` answer of ``POST /classify`` (docs/api.md)."""

    request_id: str
    labels: list[Label] = Field(description="top_k classes, best first; [] when no model answered")
    model: Optional[ModelRef] = Field(description="the model that answered; null when none did")
    degraded: bool
    degraded_reason: Optional[str] = Field(
        description="null, primary_overloaded, primary_circuit_open, primary_timeout, primary_error, "
                    "cached_result, no_model_available or deadline_exceeded")
    route: Optional[str] = Field(
        description="how a model answer was reached: primary_first, cascade_confident, cascade_escalated, "
                    "cascade_not_escalated or cascade_fallback_unavailable (primary_only with the experiments' routing "
                    "primary-only); null when no model answered now")
    needs_review: bool
    bucket: Optional[str] = Field(description="the input size bucket the image was fitted to")
    timings_ms: Timings


def error_table() -> str:
    """Markdown table of every error answer (status, code, meaning), from ``rampart.errors.ERROR_CLASSES``."""
    rows = sorted(ERROR_CLASSES, key=lambda cls: (cls.status, cls.code))
    lines = ["| status | code | meaning |", "| --- | --- | --- |"]
    lines += [f"| {cls.status} | `{cls.code}` | {(cls.__doc__ or '').strip().splitlines()[0]} |" for cls in rows]
    return "\n".join(lines)


CLASSIFY_DOC = f"""Classify one image: the same handler as `POST /classify` (multipart field `image`, or a raw body).

Query `top_k` (1..20, default 5); headers `X-Deadline-Ms`, `X-Priority` (`high`/`normal`),
`X-Request-Id`. Errors are JSON `{{"error": {{"code", "message", "request_id"}}}}`:

{error_table()}

`429` carries `Retry-After`. The Open Inference Protocol (KServe v2) is served under `/v2`.
"""


def documented(doc: str) -> Callable[[Callable], Callable]:
    """Set a function's docstring (BentoML takes an API's OpenAPI description from it)."""

    def wrap(func: Callable) -> Callable:
        func.__doc__ = doc
        return func

    return wrap
