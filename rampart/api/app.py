"""Rampart's HTTP layer: the Starlette app, built by ``create_app``.

The app is plain Starlette and runs without a server (in-process tests); its one
BentoML import is ``bentoml.server_context`` inside ``api_worker``, for the
worker's index under ``bentoml serve``.

Routes:

- ``POST /classify``: a raw image body or multipart field ``image``.
- ``POST /classify_batch``: multipart, field ``images`` repeated.
- ``GET /stats``: admission queues, throughput, breaker state, runner counters (a copy at most
  ``stats_runner_refresh_ms`` old: ``rampart.telemetry.scrapes.Refreshed``).
- ``GET /docs``: a redirect to BentoML's OpenAPI page (Swagger UI at ``/``, ``/docs.json``).
- ``/v2/...``: the Open Inference Protocol (KServe v2 / Triton HTTP), ``rampart.api.oip``.

Routes read their state (pipeline, lifecycle, loop lag, runner counters) from
the ``AppState`` the app carries (``state_of(app)``), never from globals. Under
``bentoml serve`` the app must exist when ``service.py`` is imported
(``@bentoml.asgi_app``), before the service instance that owns the pipeline, so
``service.Rampart.__init__`` hands its parts over with ``attach``; an in-process
test passes them to ``create_app`` directly. Until a lifecycle is attached and
marked ready, every classify route answers 503 ``not_ready``.

Every answer is counted (``rampart_responses_total``) and logged (one JSON line,
``rampart.telemetry.accesslog``) by ``finished``. 404/405 for paths no route serves come from
``rampart.api.routing.JSONRouteErrors`` around the whole server; ``route_error_answered``
accounts for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from rampart.api import http, oip
from rampart.api.http import JsonResponse
from rampart.api.lifecycle import Lifecycle
from rampart.config import Settings
from rampart.cores import usable_cores
from rampart.errors import InternalError, InvalidParameter, Overloaded, RampartError, RequestTimeout, Unavailable
from rampart.overload.deadline import Deadline
from rampart.pipeline import Pipeline
from rampart.shadow import ShadowMirror
from rampart.telemetry import metrics
from rampart.telemetry.accesslog import log_request, server_timing
from rampart.telemetry.scrapes import Refreshed

__all__ = [
    "answer_body_too_slow",
    "AppState",
    "Call",
    "create_app",
    "attach",
    "state_of",
    "classify_endpoint",
    "classify_batch_endpoint",
    "docs",
    "read_images",
    "classify",
    "classify_batch",
    "stats",
    "refuse_before_admission",
    "refuse_body_over_budget",
    "route_error_answered",
    "finished",
    "failed",
    "batch_timings_ms",
]

logger = logging.getLogger("rampart.service")

#: ``runner_stats(role)``: the runner's counters (``runners.common`` ``stats`` API) for ``primary`` or
#: ``fallback``, or None while it cannot answer.
RunnerStats = Callable[[str], Awaitable["dict | None"]]


async def _no_runner_stats(role: str) -> dict | None:
    return None


@dataclass
class AppState:
    """What the routes need: ``settings``, and from ``attach`` the ``pipeline``, the ``lifecycle``,
    ``loop_lag_ms()`` (the event loop's recent lag, ms, kept back from each deadline),
    ``runner_stats`` (for ``GET /stats``) and ``shadow`` (the shadow-traffic mirror, or None).

    ``runner_figures`` keeps what ``runner_stats`` last gave per role, asked again at most every
    ``settings.telemetry.stats_runner_refresh_ms`` with one call in flight per role (``Refreshed``): ``GET /stats``
    reads it, so however often it is scraped the runners get at most one call each per interval."""

    settings: Settings
    pipeline: Pipeline | None = None
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # not ready until attached and marked ready
    loop_lag_ms: Callable[[], float] = lambda: 0.0
    runner_stats: RunnerStats = _no_runner_stats
    shadow: ShadowMirror | None = None  # shadow traffic (``rampart.shadow``), off when None
    runner_figures: Refreshed = field(init=False)

    def __post_init__(self) -> None:
        self.runner_figures = Refreshed(self._ask_runner, self.settings.telemetry.stats_runner_refresh_ms / 1000.0)

    async def _ask_runner(self, role: str) -> dict | None:
        """``runner_stats(role)``, or None (logged) when it raises: a failing runner leaves ``/stats`` answering."""
        try:
            return await self.runner_stats(role)
        except Exception as exc:
            logger.info("%s runner stats unavailable: %s", role, exc)
            return None

    def ready(self) -> bool:
        """Whether requests are admitted: warmed up (``Lifecycle.mark_ready``) and not draining (``/readyz``)."""
        return self.lifecycle.ready and not self.lifecycle.draining


@dataclass
class Call:
    """One classify request as its handler sees it; ``top_k``, ``deadline`` and ``priority`` are set by
    ``read_images`` (``priority`` stays ``normal`` when the request fails before ``X-Priority`` is read)."""

    request: Request
    request_id: str
    started: float  # time.perf_counter() at the handler's start
    priority: str = "normal"
    top_k: int = 0
    deadline: Deadline | None = None


Handler = Callable[[Request, AppState], Awaitable[Response]]


def state_of(app: Starlette) -> AppState:
    """The ``AppState`` of an app made by ``create_app``."""
    return app.state.rampart


def create_app(settings: Settings, *, pipeline: Pipeline | None = None, lifecycle: Lifecycle | None = None,
               loop_lag_ms: Callable[[], float] | None = None, runner_stats: RunnerStats | None = None) -> Starlette:
    """The Starlette app of Rampart's routes (module doc) for ``settings``.

    The other arguments are those of ``attach``; left out, they can be attached later.
    """
    state = AppState(settings)
    classify_route = _bind(_admitted(classify), state)
    batch_route = _bind(_admitted(classify_batch), state)
    app = Starlette(routes=[
        Route("/classify", classify_route, methods=["POST"]),
        Route("/classify_batch", batch_route, methods=["POST"]),
        Route("/stats", _bind(stats, state), methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
        *oip.routes(settings, state, finished),
    ])
    app.state.rampart = state
    app.state.classify = classify_route
    app.state.classify_batch = batch_route
    attach(app, pipeline=pipeline, lifecycle=lifecycle, loop_lag_ms=loop_lag_ms, runner_stats=runner_stats)
    return app


def attach(app: Starlette, *, pipeline: Pipeline | None = None, lifecycle: Lifecycle | None = None,
           loop_lag_ms: Callable[[], float] | None = None, runner_stats: RunnerStats | None = None,
           shadow: ShadowMirror | None = None) -> AppState:
    """Give ``app``'s routes what they serve with; each argument left as None keeps what the app has.

    ``pipeline``: the request pipeline (``rampart.pipeline.Pipeline``); ``lifecycle``: start-up and
    drain state (requests are refused 503 until it is ready); ``loop_lag_ms()``: the event loop's
    recent lag in ms (default 0); ``runner_stats(role)``: a runner's counters for ``GET /stats``
    (default None); ``shadow``: the shadow-traffic mirror (default off). Returns the state.
    """
    state = state_of(app)
    given = {"pipeline": pipeline, "lifecycle": lifecycle, "loop_lag_ms": loop_lag_ms,
             "runner_stats": runner_stats, "shadow": shadow}
    for name, value in given.items():
        if value is not None:
            setattr(state, name, value)
    if runner_stats is not None:
        state.runner_figures.clear()  # the figures of the runner_stats before are not these runners'
    return state


def classify_endpoint(app: Starlette) -> Callable[[Request], Awaitable[Response]]:
    """The coroutine behind ``POST /classify`` (admission included), for another route to call with its request."""
    return app.state.classify


def classify_batch_endpoint(app: Starlette) -> Callable[[Request], Awaitable[Response]]:
    """The coroutine behind ``POST /classify_batch`` (admission included), for another route to call with its request."""
    return app.state.classify_batch


async def docs(request: Request) -> Response:
    """``GET /docs``: a redirect to BentoML's OpenAPI page, its Swagger UI at ``/`` (the document is ``/docs.json``)."""
    return RedirectResponse("/", status_code=307)


def _bind(handler: Handler, state: AppState) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint calling ``handler(request, state)``."""

    async def endpoint(request: Request) -> Response:
        return await handler(request, state)

    endpoint.__name__, endpoint.__doc__ = handler.__name__, handler.__doc__
    return endpoint


def _admitted(handler: Handler) -> Handler:
    """``handler``, refused with 503 before warm-up and during the drain, and counted in flight otherwise
    (``rampart.api.lifecycle.Lifecycle.admit``): a drain waits for every request it let in."""

    async def route(request: Request, state: AppState) -> Response:
        try:
            admission = state.lifecycle.admit()
        except Unavailable as exc:
            return failed(request, http.request_id_of(request), False, time.perf_counter(), exc)
        with admission:
            return await handler(request, state)

    route.__name__, route.__doc__ = handler.__name__, handler.__doc__
    return route


async def read_images(call: Call, state: AppState, field: str, max_files: int,
                      raw_body: bool) -> list[tuple[str, bytes]]:
    """The prologue both classify routes share: parameters, shedding, then the body.

    Reads ``top_k``, ``X-Deadline-Ms`` and ``X-Priority`` into ``call`` (``InvalidParameter``),
    refuses a non-multipart body unless ``raw_body`` (``InvalidParameter``), sheds with
    ``Overloaded`` (429) before the body is read (``Pipeline.check_capacity``), then reads
    ``(filename, bytes)`` of 1..``max_files`` parts named ``field``, or the raw body as one
    image named ``""`` (errors: ``rampart.api.http.read_multipart`` / ``read_body``). A
    multipart body may carry ``top_k`` as a field instead of the query (BentoML's client sends
    it so); both at once is ``InvalidParameter``.
    """
    request, settings = call.request, state.settings
    call.top_k = http.parse_top_k(request)
    call.deadline = http.parse_deadline(request, settings, state.loop_lag_ms())
    call.priority = http.parse_priority(request)
    multipart = http.is_multipart(request)
    if not multipart and not raw_body:
        raise InvalidParameter(f"send multipart/form-data with one or more parts named {field!r}")
    state.pipeline.check_capacity(call.deadline, call.priority)  # sheds (429) before the body is read
    if multipart:
        texts: dict[str, str | None] = {"top_k": None}
        files = await http.read_multipart(request, field, max_files, settings.inputs.max_body_bytes, call.deadline, texts)
        if texts["top_k"] is not None:
            if "top_k" in request.query_params:
                raise InvalidParameter("top_k is given both as a query parameter and as a multipart field")
            call.top_k = http.top_k_of(texts["top_k"])
        return files
    return [("", await http.read_body(request, settings.inputs.max_body_bytes, call.deadline))]


async def classify(request: Request, state: AppState) -> Response:
    """``POST /classify``: one image, raw body (format sniffed) or multipart field ``image``."""
    call = Call(request, http.request_id_of(request), time.perf_counter())
    try:
        ((_, data),) = await read_images(call, state, "image", 1, raw_body=True)
        result = await state.pipeline.classify(data, call.top_k, call.deadline, call.priority)
    except Exception as exc:
        if isinstance(exc, Overloaded) and state.shadow is not None:
            state.shadow.note_overload()  # mirrors pause while real traffic is shed
        return failed(request, call.request_id, call.priority, call.started, exc)
    result["timings_ms"] = {"before_handler": round(call.deadline.before_handler_ms(), 3), **result["timings_ms"]}
    response = JsonResponse({"request_id": call.request_id, **result},
                            headers={"X-Request-Id": call.request_id,
                                     "Server-Timing": server_timing(result["timings_ms"])})
    finished(request, call.request_id, call.priority, call.started, 200, "ok", result)
    if state.shadow is not None:  # mirrored after the answer is sent: see rampart.shadow
        response.background = state.shadow.background(call.request_id, result)
    return response


async def classify_batch(request: Request, state: AppState) -> Response:
    """``POST /classify_batch``: multipart field ``images`` repeated; one entry per image, in order.

    An image refused on its own gets an entry with its HTTP ``status`` and error body instead of a result.
    """
    call = Call(request, http.request_id_of(request), time.perf_counter())
    try:
        files = await read_images(call, state, "images", state.settings.inputs.max_batch_images, raw_body=False)
    except Exception as exc:
        return failed(request, call.request_id, call.priority, call.started, exc)
    results = await asyncio.gather(*(_batch_entry(state.pipeline, call, i, name, data)
                                     for i, (name, data) in enumerate(files)))
    timings = batch_timings_ms(results, (time.perf_counter() - call.started) * 1000.0)
    warnings = sorted({warning for result in results for warning in result.get("input_warnings", ())})
    finished(request, call.request_id, call.priority, call.started, 200, "ok", images=len(results), input_warnings=warnings)
    return JsonResponse({"request_id": call.request_id, "results": results},
                        headers={"X-Request-Id": call.request_id, "Server-Timing": server_timing(timings)})


async def _batch_entry(pipeline: Pipeline, call: Call, index: int, filename: str, data: bytes) -> dict:
    """One ``/classify_batch`` entry: ``index``, ``filename`` and the result, or ``status`` and ``error``."""
    entry = {"index": index, "filename": filename}
    try:
        return {**entry, **(await pipeline.classify(data, call.top_k, call.deadline, call.priority))}
    except RampartError as exc:
        error = exc
    except Exception:
        logger.exception("unexpected failure for image %d of request %s", index, call.request_id)
        error = InternalError("an unexpected error occurred")
    return {**entry, "status": error.status, **error.to_body(call.request_id)}


def batch_timings_ms(results: list[dict], total_ms: float) -> dict[str, float]:
    """A batch's stage timings (ms): per stage the longest over its answered images, and the whole request's total.

    The images run concurrently, so the longest of each stage is the one that shaped the answer time.
    """
    answered = [entry["timings_ms"] for entry in results if "timings_ms" in entry]
    stages = {stage: max(t[stage] for t in answered) for stage in ("decode", "queue", "inference")} if answered else {}
    return {**stages, "total": round(total_ms, 1)}


def api_worker(settings: Settings) -> dict:
    """Which API worker answers: ``index`` (BentoML's worker id, 1..``of``; None outside ``bentoml serve``),
    ``pid``, ``of`` (``api_workers``) and ``cores``, the CPU ids it may run on (``rampart.cores``). With
    several workers, ``/stats`` is that worker's own state."""
    from bentoml import server_context  # BentoML sets worker_index in each worker

    return {"index": server_context.worker_index, "pid": os.getpid(), "of": settings.api_workers,
            "cores": usable_cores()}


async def stats(request: Request, state: AppState) -> Response:
    """``GET /stats``: admission queues, measured throughput, breaker state, runner counters.

    One API worker's view (``api_worker``): its gates, breaker, cache, decoders and
    requests in flight; the runners' counters are the runners' own, shared by all
    workers. Rampart's Prometheus metrics on ``/metrics`` add up every worker.

    Everything but the runners' counters is this worker's own state, read without I/O
    (the windows it summarises are bounded: ``rampart.pipeline.CONFIDENCE_WINDOW``,
    ``rampart.shadow.LATENCY_WINDOW``). Each runner's ``runner`` counters come from
    ``state.runner_figures``, at most ``stats_runner_refresh_ms`` old when the last ask began
    that long ago or less, else asked anew (None while the runner cannot answer);
    ``runner_age_ms`` is how long ago the ask that gave them began.
    """
    figures = await asyncio.gather(*(state.runner_figures.get(role) for role in ("primary", "fallback")))
    body = state.pipeline.state()
    body["api_worker"] = api_worker(state.pipeline.settings)
    body["lifecycle"] = {"state": state.lifecycle.state, "in_flight": state.lifecycle.in_flight}
    for role, (counters, age_s) in zip(("primary", "fallback"), figures):
        body[role]["runner"] = counters
        body[role]["runner_age_ms"] = round(age_s * 1000.0, 1)
    body["shadow"] = None if state.shadow is None else state.shadow.state()
    return JsonResponse(body)


def failed(request: Request, request_id: str, priority: str, started: float, exc: Exception) -> JsonResponse:
    """The error response for ``exc`` (a ``RampartError``, else a logged 500), accounted and logged."""
    if not isinstance(exc, RampartError):
        logger.exception("unexpected failure for request %s", request_id, exc_info=exc)
        exc = InternalError("an unexpected error occurred; see the server log")
    finished(request, request_id, priority, started, exc.status, exc.code)
    return http.error_response(exc, request_id)


def route_error_answered(request: Request, request_id: str, started: float, error: RampartError) -> None:
    """Account and log a 404/405 answered by ``rampart.api.routing.JSONRouteErrors``, or a pickle body refused by
    ``rampart.api.bentoml_api.RefusePickleBodies``."""
    finished(request, request_id, "normal", started, error.status, error.code)


def finished(request: Request, request_id: str, priority: str, started: float, status: int, code: str,
             result: dict | None = None, **extra: object) -> None:
    """Count the answer (``rampart_responses_total``) and write its access-log line."""
    metrics.RESPONSES.labels(str(status), code).inc()
    metrics.update_process_rss("api")
    log_request(request_id, request.url.path, status, code, priority, (time.perf_counter() - started) * 1000.0,
                result, **extra)


def log_client_gone(scope: dict, stage: str, elapsed_s: float) -> None:
    """The access line of a request whose client hung up at ``stage`` (``rampart.hangup``; told by the in-flight
    bound, ``rampart.api.arrival.InflightBound``, ``elapsed_s`` seconds after it was let in), as nginx logs 499:
    status 499, code ``client_disconnected``, its id, class and ``stage``. None once its answer had started
    (``stage`` ``answer``): its handler has written its line."""
    if stage == "answer":
        return
    request = Request(scope)
    try:
        priority = http.parse_priority(request)
    except InvalidParameter:  # its handler answered 422, or would have
        priority = "normal"
    log_request(http.request_id_of(request), request.url.path, 499, "client_disconnected", priority,
                elapsed_s * 1000.0, stage=stage)


async def _answer_at_the_front(scope: dict, receive, send, error: RampartError, close: bool) -> None:
    """Answer ``error`` to the request with ASGI ``scope`` before any middleware: counted and logged as every answer,
    in the protocol's error form under ``/v2``; with ``close`` the connection closes after it (the rest of the body
    is not read)."""
    request = Request(scope, receive)
    request_id = http.request_id_of(request)
    response = failed(request, request_id, False, time.perf_counter(), error)
    if oip.is_oip_path(scope["path"]):
        response = oip.error_response(error, request_id)
    if close:
        response.headers["connection"] = "close"
    await response(scope, receive, send)


def refuse_before_admission(app: Starlette) -> ASGIApp:
    """The ASGI app answering 429 ``overloaded`` to a request over the in-flight bound (``rampart.api.arrival``),
    before any middleware, with ``app``'s pipeline's ``Retry-After``."""
    state = state_of(app)

    async def refuse(scope, receive, send) -> None:
        error = Overloaded("too many requests in flight; retry later", state.pipeline.retry_after_s())
        if state.shadow is not None:
            state.shadow.note_overload()  # mirrors pause while real traffic is shed
        await _answer_at_the_front(scope, receive, send, error, close=False)

    return refuse


def answer_body_too_slow(app: Starlette) -> ASGIApp:
    """The ASGI app answering 408 ``request_timeout`` (and closing the connection) to a request whose body
    arrives slower than ``MIN_BODY_BYTES_PER_S`` after ``BODY_GRACE_MS`` (``rampart.api.arrival``), before
    any middleware; the protocol's error form under ``/v2``."""
    state = state_of(app)

    async def too_slow(scope, receive, send) -> None:
        settings = state.settings
        error = RequestTimeout(f"the body arrived slower than {settings.connections.min_body_bytes_per_s} bytes/s "
                               f"after the first {settings.connections.body_grace_ms} ms")
        await _answer_at_the_front(scope, receive, send, error, close=True)

    return too_slow


def refuse_body_over_budget(app: Starlette) -> ASGIApp:
    """The ASGI app answering 429 ``overloaded`` (and closing the connection) to a request whose next body chunk
    would take the bytes this worker's bodies hold past ``MAX_HELD_BODY_BYTES`` (``rampart.api.arrival``,
    ``InflightBound``), with ``app``'s pipeline's ``Retry-After``."""
    state = state_of(app)

    async def over_budget(scope, receive, send) -> None:
        error = http.bodies_over_budget(state.settings, state.pipeline.retry_after_s())
        await _answer_at_the_front(scope, receive, send, error, close=True)

    return over_budget
