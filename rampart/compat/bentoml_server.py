"""Patches of BentoML 1.4.29's HTTP server: its per-request middlewares and its IO classes.

``bentoml._internal.server.http.traffic.TimeoutMiddleware`` schedules
``loop.call_later(timeout, ...)`` for every request and never cancels it. Each
finished request then stays reachable for ``traffic.timeout`` seconds (70 s for
Rampart): its timer, future and OpenTelemetry context. At 150 requests/s that
is about 10,000 live objects per process, every full garbage collection scans
them, and the event loop stalls for 100-250 ms on a 2-core host: answers leave
after their deadline. ``cancel_request_timers()`` replaces the middleware's
``__call__`` with the same behaviour (a 504 when no response has started within
``traffic.timeout``) built on ``asyncio.timeout``, whose timer is cancelled when
the request ends. It also runs the request in the caller's task instead of a new
task plus a future per request: measured with ``bench/middleware_bench.py``,
the middleware then costs about a third of the CPU it did (docs/overload.md).

``instruments.RunnerTrafficMetricsMiddleware`` (and its legacy twin
``HTTPTrafficMetricsMiddleware``) label the ``endpoint`` of
``bentoml_service_request_total``, ``_request_duration_seconds`` and
``_request_in_progress`` with the raw request path, 404s included: 300 requests to
random paths added 6,000 lines to ``/metrics``, and any scanner could grow the
series without bound. ``bound_endpoint_labels()`` makes them label the route's
path template instead, and ``other`` for every path no route serves
(``rampart.api.routing.endpoint_label``).

``IOMixin.mime_type`` (``_bentoml_sdk/io_models.py``) builds a pydantic JSON schema
of the API's output type for every response, to learn a media type that never
changes: 630 µs of CPU per runner batch measured on the 2-core host (py-spy found it
in the primary runner at the knee; docs/benchmarks.md, CPU budget). ``cache_io_media_types()`` keeps the
answer per class.

All are idempotent, written for BentoML 1.4.29 (``rampart.compat.PINS``), and applied by
``rampart.compat.apply_all`` when ``service.py`` is imported (by the entry service and by each
runner process). Each patched object's source is hashed in ``rampart.compat.targets``; docs/compat.md.
"""

from __future__ import annotations

import asyncio

__all__ = ["cancel_request_timers", "bound_endpoint_labels", "cache_io_media_types"]


def cache_io_media_types() -> None:
    """Patch ``IOMixin.mime_type`` to compute each IO class's media type once (module doc).

    Fixes: a pydantic JSON schema built per response (630 µs of CPU per runner batch) for a media
    type that never changes. Upstream: no upstream report found. Written for BentoML 1.4.29; target
    ``_bentoml_sdk.io_models.IOMixin.mime_type``.
    """
    from _bentoml_sdk.io_models import IOMixin

    if getattr(IOMixin.mime_type, "_rampart_cached", False):
        return
    compute = IOMixin.mime_type.__func__
    known: dict[type, str] = {}

    def mime_type(cls) -> str:
        if cls not in known:
            known[cls] = compute(cls)
        return known[cls]

    mime_type._rampart_cached = True
    IOMixin.mime_type = classmethod(mime_type)


def cancel_request_timers() -> None:
    """Patch ``TimeoutMiddleware.__call__`` so each request's timer is cancelled when it ends (and costs less).

    Fixes: a ``call_later`` timer per request, never cancelled, that kept every finished request's
    objects alive for ``traffic.timeout`` (module doc). Upstream: no upstream report found (the nearest,
    https://github.com/bentoml/BentoML/issues/5642, is about sync handlers running on after the
    timeout). Written for BentoML 1.4.29; target ``bentoml._internal.server.http.traffic.TimeoutMiddleware``.
    """
    from starlette.responses import JSONResponse

    from bentoml._internal.server.http import traffic

    middleware = traffic.TimeoutMiddleware
    if getattr(middleware.__call__, "_rampart_fixed", False):
        return

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        started = False

        async def _send(message) -> None:
            nonlocal started
            if not started:  # the answer has begun: from now on no timeout, as in BentoML
                started = True
                guard.reschedule(None)
            await send(message)

        try:
            async with asyncio.timeout(self.timeout) as guard:
                await self.app(scope, receive, _send)
        except TimeoutError:
            if not guard.expired() or started:
                raise
            response = JSONResponse({"error": f"Not able to process the request in {self.timeout} seconds"},
                                    status_code=504)
            await response(scope, receive, send)

    __call__._rampart_fixed = True
    middleware.__call__ = __call__


#: Scope key that carries the real path past the metrics middleware, which sees the label in ``path``.
_REAL_PATH = "rampart.real_path"


class _RestoreRealPath:
    """ASGI wrapper: puts the real path back into the scope for the app behind the metrics middleware."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if _REAL_PATH in scope:
            scope = {**scope, "path": scope[_REAL_PATH]}
        await self.app(scope, receive, send)


def bound_endpoint_labels() -> None:
    """Patch BentoML's traffic-metrics middlewares to label ``endpoint`` from a fixed set.

    The middleware reads the label from ``scope["path"]``, so it is called with a
    copy of the scope whose ``path`` is ``endpoint_label(scope)``, and the app
    behind it (wrapped once in ``_RestoreRealPath``) gets the real path back.

    Fixes: an ``endpoint`` label per raw path, 404s included, so any scanner grew the series
    without bound. Upstream: no upstream report found. Written for BentoML 1.4.29; targets
    ``bentoml._internal.server.http.instruments.RunnerTrafficMetricsMiddleware.__call__`` and
    ``HTTPTrafficMetricsMiddleware.__call__``.
    """
    from bentoml._internal.server.http import instruments

    from rampart.api.routing import endpoint_label

    for middleware in (instruments.RunnerTrafficMetricsMiddleware, instruments.HTTPTrafficMetricsMiddleware):
        if getattr(middleware.__call__, "_rampart_fixed", False):
            continue

        async def __call__(self, scope, receive, send, _original=middleware.__call__) -> None:
            if scope["type"] in ("http", "websocket"):
                if not isinstance(self.app, _RestoreRealPath):
                    self.app = _RestoreRealPath(self.app)
                scope = {**scope, "path": endpoint_label(scope), _REAL_PATH: scope["path"]}
            await _original(self, scope, receive, send)

        __call__._rampart_fixed = True
        middleware.__call__ = __call__
