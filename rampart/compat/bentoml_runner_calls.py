"""A runner's batch calls answered in front of BentoML 1.4.29's app instead of through it (its wire format unchanged).

Every call from the entry service to a runner's batchable API went through the runner's whole
BentoML app: Starlette's error middleware, BentoML's traffic metrics, OpenTelemetry (which the
runner routes are excluded from), the request timeout, BentoML's context, Starlette's exception
middleware and router, then ``ServiceAppFactory.api_endpoint_wrapper`` and ``api_endpoint``: the
media-type checks, a bound API method built afresh twice per call (``APIMethod.__get__``:
``inspect.signature`` and ``functools.wraps``), the input model, ``batch_infer``, the answer made by
``IOMixin.to_http_response`` (its model dumped twice) and streamed as an ``IterableResponse``, and
the context's background tasks. In process, through BentoML's real runner app with the near-free
model (2026-12-06): 1,813 µs of CPU per call of one image, against 1,340 µs for the same parse,
``batch_infer`` and answer alone.

``lean_batch_routes(app)`` makes, for each batchable API of the runner app ``app``, an ASGI app that
answers a ``POST`` in BentoML's pickle format (``application/vnd.bentoml+pickle``, what BentoML's
dependency proxy and ``rampart.runner_client`` send) with the same steps and the same bytes: the
request parsed by BentoML's ``PickleSerde`` into the API's input model, the call through the
factory's own ``batch_infer`` (BentoML's adaptive-batching dispatcher, the worker thread, the
runner's code), the answer serialised as ``to_http_response`` serialises it, with its media type
and headers (``_add_response_headers``), BentoML's runner traffic metrics written into its
middleware's own series as it writes them (``_RunnerMetrics``), a 504 past the traffic timeout, and errors answered as
``api_endpoint_wrapper`` answers them (400 for a validation error, a ``BentoMLException``'s own
status, 500 otherwise, each logged). Any other request (another method or media type) goes to
``app`` unchanged. ``tests/unit/test_runner_calls.py`` compares each answer, byte for byte, with
BentoML's for the same request.

It applies only where it can answer as BentoML would: a runner service's app (not the entry
service), each API batchable with one input field and no context parameter, and a middleware stack
of exactly BentoML's defaults for a runner without its access log or a concurrency limit, with
OpenTelemetry's middleware only while the runner routes are left out of tracing. Otherwise
``lean_batch_routes`` returns no route and BentoML answers everything. The routes are found after
BentoML's app has answered its first request (its middleware stack is built then).

Used by ``runners.common`` through ``rampart.api.arrival.route_at_front`` when ``RAMPART_RUNNER_ROUTE`` is
``lean`` (the default, ``bentoml``, leaves every call to BentoML's app: docs/serving-cost.md says why). The BentoML objects it relies on are hashed in
``rampart.compat.targets``; docs/compat.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any, Callable

logger = logging.getLogger("rampart.runner_calls")

__all__ = ["PICKLE_MEDIA_TYPE", "lean_batch_routes", "lean_calls"]

#: The media type of BentoML's pickle serde (``_bentoml_impl.serde.PickleSerde.media_type``).
PICKLE_MEDIA_TYPE = "application/vnd.bentoml+pickle"


#: Calls answered by the lean routes in this process, by route (``lean_calls``).
_answered: dict[str, int] = {}


def lean_calls() -> dict[str, int]:
    """Calls the lean routes of this process have answered, by route (``{}`` before the first)."""
    return dict(_answered)


def lean_batch_routes(app: Any, tracing_excluded: bool = True) -> dict[str, Callable] | None:
    """``{route: ASGI app}`` of the lean batch calls of the BentoML runner app ``app`` (module doc), ``{}`` where
    they do not apply, None while BentoML's app has not built its middleware stack yet (ask again later).

    ``app``: what uvicorn serves (BentoML's Starlette app, possibly under uvicorn's proxy-headers middleware).
    ``tracing_excluded``: whether the runner routes are left out of OpenTelemetry (``runner_tracing_config``).
    """
    starlette = _starlette_of(app)
    if starlette is None:
        logger.info("runner batch calls: through BentoML's app (%s is not a Starlette app)", type(app).__name__)
        return {}
    if starlette.middleware_stack is None:
        return None
    stack = _middleware_stack(starlette.middleware_stack)
    found = _known_stack(stack, tracing_excluded)
    if found is None:
        logger.info("runner batch calls: through BentoML's app (middlewares %s)",
                    ", ".join(type(node).__name__ for node in stack))
        return {}
    metrics, timeout_s = found
    routes = {}
    for route in starlette.router.routes:
        target = _batch_api(route)
        if target is not None:
            factory, name = target
            routes[route.path] = _LeanBatchRoute(app, starlette, route.path, factory, name, metrics, timeout_s)
    logger.info("runner batch calls: %s answered in front of BentoML's app", ", ".join(sorted(routes)) or "none")
    return routes


def _starlette_of(app: Any):
    from starlette.applications import Starlette

    for _ in range(4):  # uvicorn's wrappers (proxy headers, message logger) hold the app in ``app``
        if isinstance(app, Starlette):
            return app
        app = getattr(app, "app", None)
    return None


def _middleware_stack(outermost: Any) -> list:
    """The middlewares from ``outermost`` inwards, ending with the router (each holds the next in ``app``)."""
    from starlette.routing import Router

    chain = []
    node = outermost
    while node is not None and len(chain) < 32:
        chain.append(node)
        if isinstance(node, Router):
            break
        node = getattr(node, "app", None)
    return chain


def _known_stack(stack: list, tracing_excluded: bool) -> tuple[Any, float] | None:
    """(BentoML's traffic-metrics middleware, the traffic timeout in s) when ``stack`` is BentoML's default stack of a
    runner (module doc), else None."""
    from starlette.middleware.errors import ServerErrorMiddleware
    from starlette.middleware.exceptions import ExceptionMiddleware
    from starlette.routing import Router

    from _bentoml_impl.server.app import ContextMiddleware
    from bentoml._internal.server.http.instruments import RunnerTrafficMetricsMiddleware
    from bentoml._internal.server.http.traffic import TimeoutMiddleware
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    from rampart.compat.bentoml_server import _RestoreRealPath

    allowed = [ServerErrorMiddleware, RunnerTrafficMetricsMiddleware, _RestoreRealPath, TimeoutMiddleware,
               ContextMiddleware, ExceptionMiddleware, Router]
    if tracing_excluded:
        allowed.append(OpenTelemetryMiddleware)
    metrics = timeout = None
    for node in stack:
        if not isinstance(node, tuple(allowed)):
            return None
        if isinstance(node, RunnerTrafficMetricsMiddleware):
            metrics = node
        elif isinstance(node, TimeoutMiddleware):
            timeout = node.timeout
    if metrics is None or timeout is None or not isinstance(stack[-1], Router):
        return None
    return metrics, float(timeout)


def _batch_api(route: Any) -> tuple[Any, str] | None:
    """(the service app factory, the API's name) of a route of a batchable runner API with one input field and no
    context parameter, else None."""
    endpoint = getattr(route, "endpoint", None)
    if not isinstance(endpoint, functools.partial) or getattr(endpoint.func, "__name__", "") != "api_endpoint_wrapper":
        return None
    factory, name = endpoint.func.__self__, endpoint.args[0]
    method = factory.service.apis.get(name)
    if (factory.is_main or method is None or not method.batchable or method.ctx_param is not None
            or getattr(method.input_spec, "__root_input__", False) or len(method.input_spec.model_fields) != 1):
        return None
    return factory, name


class _RunnerMetrics:
    """BentoML's runner traffic metrics for one route, written as ``RunnerTrafficMetricsMiddleware`` writes them
    for an HTTP call (the last request's time, the call in progress, its count and duration by status), into
    that middleware's own series, with the labelled series looked up once instead of at every call (a lookup by
    keyword labels cost more than the write). The ``endpoint`` label is the route, as
    ``rampart.compat.bentoml_server.bound_endpoint_labels`` makes BentoML label it."""

    def __init__(self, middleware, route: str) -> None:
        from bentoml._internal.context import server_context

        if not middleware._is_setup:
            middleware._setup()
        self.middleware = middleware
        self.route = route
        self.base = {"service_name": server_context.bento_name, "service_version": server_context.bento_version,
                     "runner_name": server_context.service_name}
        self.last_request = middleware.metrics_last_request_timestamp.labels(**self.base)
        self.in_progress = middleware.metrics_request_in_progress.labels(endpoint=route, **self.base)
        self.by_status: dict[int, tuple[Any, Any]] = {}

    @contextlib.contextmanager
    def call(self):
        """Around one call: yields ``record(status)``, to be called once its answer's status is known."""
        from timeit import default_timer

        self.last_request.set_to_current_time()
        started = default_timer()

        def record(status: int) -> None:
            total, duration = self.by_status.get(status) or self._series(status)
            total.inc()
            duration.observe(max(default_timer() - started, 0))

        self.in_progress.inc()
        try:
            yield record
        finally:
            self.in_progress.dec()

    def _series(self, status: int) -> tuple[Any, Any]:
        labels = {"endpoint": self.route, "http_response_code": status, **self.base}
        series = (self.middleware.metrics_request_total.labels(**labels),
                  self.middleware.metrics_request_duration.labels(**labels))
        self.by_status[status] = series
        return series


class _Answer:
    """What ``_add_response_headers`` writes its headers into (it needs only ``headers``)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


class _LeanBatchRoute:
    """The ASGI app of one batchable API's lean calls (module doc); anything else goes to ``app``."""

    def __init__(self, app, starlette, route: str, factory, name: str, metrics, timeout_s: float) -> None:
        from _bentoml_impl.serde import PickleSerde

        self.app, self.starlette, self.route, self.factory, self.name = app, starlette, route, factory, name
        self.method = factory.service.apis[name]
        self.field = next(iter(self.method.input_spec.model_fields))
        self.serde = PickleSerde()
        self.timeout_s = timeout_s
        self.metrics = _RunnerMetrics(metrics, route)

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("method") != "POST" or _media_type(scope) != PICKLE_MEDIA_TYPE:
            return await self.app(scope, receive, send)
        scope["app"] = self.starlette  # as Starlette sets it
        _answered[self.route] = _answered.get(self.route, 0) + 1
        with self.metrics.call() as record:
            await self._answer(scope, receive, send, record)

    async def _answer(self, scope, receive, send, record: Callable[[int], None]) -> None:
        from starlette.requests import Request

        request = Request(scope, receive)
        try:
            async with asyncio.timeout(self.timeout_s):
                status, headers, body = await self._call(request)
        except TimeoutError:
            status, headers, body = self._error(request, 504, {"error": f"Not able to process the request in "
                                                                         f"{self.timeout_s} seconds"}, bentoml=False)
        except Exception as exc:  # noqa: BLE001 - every error is answered, as api_endpoint_wrapper answers it
            status, headers, body = self._error_of(request, exc)
        record(status)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]})
        await send({"type": "http.response.body", "body": body})

    async def _call(self, request) -> tuple[int, dict[str, str], bytes]:
        from _bentoml_impl.serde import Payload

        data = await request.body()
        model = self.serde.deserialize_model(Payload((data,), request.headers), self.method.input_spec)
        output = await self.factory.batch_infer(self.name, (), {self.field: getattr(model, self.field)})
        spec = self.method.output_spec
        payload = self.serde.serialize_model(output if isinstance(output, spec) else spec(output))
        headers = {"content-type": spec.mime_type(), **payload.headers}
        self.factory._add_response_headers(_Answer(headers))
        return 200, headers, b"".join(payload.data)

    def _error_of(self, request, exc: Exception) -> tuple[int, dict[str, str], bytes]:
        from pydantic import ValidationError

        from bentoml.exceptions import BentoMLException

        if isinstance(exc, ValidationError):
            return self._error(request, 400, {"error": f"{exc.error_count()} validation error for {exc.title}",
                                              "detail": exc.errors(include_context=False, include_input=False)})
        if isinstance(exc, BentoMLException):
            status = exc.error_code.value
            if status in (401, 403):
                return self._error(request, status, {"error": "Authorization error"})
            if status >= 500:
                return self._error(request, status, {"error": "An unexpected error has occurred, please check the "
                                                              "server log."})
            return self._error(request, status, ({"error": str(exc)},))
        return self._error(request, 500, {"error": "An unexpected error has occurred, please check the server log."})

    def _error(self, request, status: int, content: Any, bentoml: bool = True) -> tuple[int, dict[str, str], bytes]:
        """A JSON error answer; ``bentoml``: logged and with BentoML's headers, as from ``api_endpoint_wrapper``
        (else as from the timeout middleware, ``rampart.compat.bentoml_server.cancel_request_timers``)."""
        from starlette.responses import JSONResponse

        from bentoml._internal.server.http_app import log_exception

        answer = JSONResponse(content, status_code=status)
        headers = dict(answer.headers.items())
        if bentoml:
            log_exception(request)
            self.factory._add_response_headers(_Answer(headers))
        return status, headers, answer.body


def _media_type(scope) -> str:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-type":
            return value.decode("latin-1").split(";")[0].strip()
    return ""
