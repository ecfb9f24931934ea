"""What BentoML's own client and its OpenAPI page need to see ``/classify`` and ``/classify_batch``.

BentoML builds ``bentoml.SyncHTTPClient`` / ``AsyncHTTPClient`` methods (from
``/schema.json``) and its OpenAPI page (Swagger UI at ``/``, the document at
``/docs.json``; ``/docs`` redirects there) from ``@bentoml.api`` methods only, never
from mounted Starlette routes. So the service declares two thin APIs, ``classify`` at
``CLASSIFY_API_ROUTE`` and ``classify_batch`` at ``CLASSIFY_BATCH_API_ROUTE``, whose
request bodies stay unread by BentoML (``ImageUpload`` / ``BatchUpload`` hand the
Starlette request straight through) and whose handlers are the very coroutines behind
``POST /classify`` and ``POST /classify_batch``: the same streaming byte cap, deadline,
error bodies and status codes. Their schemas are multipart fields ``image`` (or
``images``, repeated) and ``top_k`` (so the client sends what ``curl -F image=@cat.jpg
-F top_k=2`` sends), answered by ``ClassifyAnswer`` / ``BatchAnswer``.

What BentoML 1.4.29's client sends for a file field (``HTTPClient._get_file`` in
``_bentoml_impl/client/http.py``): a path (``str`` or ``pathlib.Path``) or a PIL image
(its encoded file, as opened). Raw ``bytes`` and open files stop inside the client at
``assert isinstance(value, t.BinaryIO)``, before any request: ``typing.BinaryIO`` is a
plain class that no real file object or ``bytes`` is an instance of, and every other
schema makes the client JSON-encode the value (``TypeError`` for bytes, files, paths and
images alike). No input declaration gets bytes through that client; wrap them,
``PIL.Image.open(io.BytesIO(data))``, or use Rampart's SDK (docs/clients.md).

Why a second route and not ``/classify`` itself: BentoML puts API routes before
mounted apps, so an API at ``/classify`` would take that path's 404/405 handling
away from Rampart's Starlette app.

**BentoML's pickle body.** BentoML's API handler refuses a body of media type
``application/vnd.bentoml+pickle`` (runner-to-runner serialisation) on the entry service
before the route's handler runs: a 415 whose body is BentoML's ``[{"error": ...}]`` and an
ERROR log line with a traceback. ``RefusePickleBodies``, an ASGI middleware around the
whole app, answers such a request on either API route first, with Rampart's JSON 415
``unsupported_format``, counted and logged like every answer. It is the one error
BentoML 1.4.29's ``ServiceAppFactory.api_endpoint`` raises before the handler runs.

Unlike the rest of ``rampart/``, this module imports BentoML (its IO model base
class); only ``service.py`` imports it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from bentoml import IODescriptor
from pydantic import BaseModel, Field

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from rampart.api.http import error_response, request_id_of
from rampart.errors import ERROR_CLASSES, RampartError, UnsupportedFormat
from rampart.results import MAX_TOP_K

__all__ = ["CLASSIFY_API_ROUTE", "CLASSIFY_BATCH_API_ROUTE", "ImageUpload", "BatchUpload", "ClassifyAnswer",
           "BatchAnswer", "error_table", "documented", "CLASSIFY_DOC", "CLASSIFY_BATCH_DOC", "PICKLE_MEDIA_TYPE",
           "RefusePickleBodies"]

#: Where BentoML's client posts for ``client.classify(path)``; answers exactly as ``POST /classify``.
CLASSIFY_API_ROUTE = "/bentoml/classify"
#: Where BentoML's client posts for ``client.classify_batch([path, ...])``; answers as ``POST /classify_batch``.
CLASSIFY_BATCH_API_ROUTE = "/bentoml/classify_batch"

TOP_K_DESCRIPTION = f"labels per image, 1..{MAX_TOP_K} (a multipart field, or the query parameter)"


class ImageUpload(IODescriptor):
    """The image to classify, as the multipart field `image`, and `top_k`."""

    # ``from_http_request`` does not read the body: it hands the Starlette request itself
    # to the handler as ``image``, and /classify's handler reads it (``rampart.api.http.read_body``).
    # A multipart field rather than a raw body because BentoML 1.4.29's AsyncHTTPClient
    # cannot send a raw file body (it gives httpx.AsyncClient a sync iterator).
    image: Path = Field(description="the image file: JPEG, PNG, GIF, WEBP, BMP or TIFF")
    top_k: int = Field(5, ge=1, le=MAX_TOP_K, description=TOP_K_DESCRIPTION)

    @classmethod
    async def from_http_request(cls, request: Any, serde: Any) -> "ImageUpload":
        return cls.model_construct(image=request)


class BatchUpload(IODescriptor):
    """The images to classify, each a multipart field `images`, and `top_k`."""

    # Like ``ImageUpload``: the Starlette request goes to /classify_batch's handler unread.
    images: list[Path] = Field(description="1..max_batch_images image files, answered in order")
    top_k: int = Field(5, ge=1, le=MAX_TOP_K, description=TOP_K_DESCRIPTION)

    @classmethod
    async def from_http_request(cls, request: Any, serde: Any) -> "BatchUpload":
        return cls.model_construct(images=request)


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
                    "cascade_not_escalated or cascade_fallback_unavailable; null when no model answered now")
    needs_review: bool
    bucket: Optional[str] = Field(description="the input size bucket the image was fitted to")
    timings_ms: Timings


class ErrorBody(BaseModel):
    code: str
    message: str
    request_id: str


class BatchEntry(BaseModel):
    """One image of a ``/classify_batch`` answer: ``ClassifyAnswer``'s fields, or ``status`` and ``error``."""

    index: int = Field(description="the image's place in the request, from 0")
    filename: str = Field(description="the part's filename, as sent")
    status: Optional[int] = Field(None, description="this image's HTTP status when it was refused on its own")
    error: Optional[ErrorBody] = Field(None, description="why it was refused (the error body of /classify)")
    labels: Optional[list[Label]] = None
    model: Optional[ModelRef] = None
    degraded: Optional[bool] = None
    degraded_reason: Optional[str] = None
    route: Optional[str] = None
    needs_review: Optional[bool] = None
    bucket: Optional[str] = None
    timings_ms: Optional[Timings] = None


class BatchAnswer(BaseModel):
    """A ``200`` answer of ``POST /classify_batch``: one entry per image, in order."""

    request_id: str
    results: list[BatchEntry]


def error_table() -> str:
    """Markdown table of every error answer (status, code, meaning), from ``rampart.errors.ERROR_CLASSES``."""
    rows = sorted(ERROR_CLASSES, key=lambda cls: (cls.status, cls.code))
    lines = ["| status | code | meaning |", "| --- | --- | --- |"]
    lines += [f"| {cls.status} | `{cls.code}` | {(cls.__doc__ or '').strip().splitlines()[0]} |" for cls in rows]
    return "\n".join(lines)


CLASSIFY_DOC = f"""Classify one image: the same handler as `POST /classify` (multipart field `image`, or a raw body).

Query `top_k` (1..20, default 5); headers `X-Deadline-Ms`, `X-Priority` (`high`/`normal`/`low`),
`X-Request-Id`. Errors are JSON `{{"error": {{"code", "message", "request_id"}}}}`:

{error_table()}

`429` carries `Retry-After`. The Open Inference Protocol (KServe v2) is served under `/v2`.
"""

CLASSIFY_BATCH_DOC = """Classify several images in one request: the same handler as `POST /classify_batch`
(multipart fields `images`, repeated, at most `max_batch_images`; `top_k` as a field or in the query).

Each entry of `results` is one image's answer, or its `status` and `error` when that image alone was
refused; a refusal of the whole request (a bad `X-Deadline-Ms`, overload) is an error answer as for
`classify`.
"""


def documented(doc: str) -> Callable[[Callable], Callable]:
    """Set a function's docstring (BentoML takes an API's OpenAPI description from it)."""

    def wrap(func: Callable) -> Callable:
        func.__doc__ = doc
        return func

    return wrap


#: The media type of BentoML's runner-to-runner bodies, which its API handler refuses on an entry service.
PICKLE_MEDIA_TYPE = "application/vnd.bentoml+pickle"


class RefusePickleBodies:
    """ASGI middleware: a request to ``CLASSIFY_API_ROUTE`` or ``CLASSIFY_BATCH_API_ROUTE`` whose
    ``Content-Type`` is ``PICKLE_MEDIA_TYPE`` gets Rampart's JSON 415 ``unsupported_format`` (module doc);
    everything else passes. ``answered(request, request_id, started, error)`` (``time.perf_counter()``
    seconds) counts and logs each refusal."""

    def __init__(self, app: ASGIApp, answered: Callable[[Request, str, float, RampartError], None]) -> None:
        self.app = app
        self.answered = answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in (CLASSIFY_API_ROUTE, CLASSIFY_BATCH_API_ROUTE):
            request = Request(scope)
            media_type = request.headers.get("content-type", "").split(";")[0].strip()
            if media_type == PICKLE_MEDIA_TYPE:
                started, request_id = time.perf_counter(), request_id_of(request)
                error = UnsupportedFormat(f"{PICKLE_MEDIA_TYPE} bodies are not accepted; send the image bytes or "
                                          "multipart/form-data with the field image")
                await error_response(error, request_id)(scope, receive, send)
                self.answered(request, request_id, started, error)
                return
        await self.app(scope, receive, send)
