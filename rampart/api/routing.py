"""Bounded metric labels and JSON 404/405 (Starlette routing, no BentoML).

Under ``bentoml serve`` the outer app is BentoML's Starlette app. Its router tries
BentoML's own routes (``/livez``, ``/readyz``, ``/metrics``, static files, ...) and
Rampart's app, mounted at ``/`` as a ``PassiveMount``. A request no route serves
gets the outer router's plain-text 404/405, so an exception handler on Rampart's
mounted app never runs, and BentoML's static-file mount answers its own plain-text
404. Hence two pieces that work on the whole app:

- ``endpoint_label`` names the route that serves a request by its path template
  (``/classify``, ``/livez``, ``/static_content``), matched against the outer
  app's routes (``scope["app"]``, set by Starlette before its middleware), or
  ``OTHER_ENDPOINT`` for every path no route serves; metric labels then come
  from a fixed set (``rampart.compat.bentoml_server.bound_endpoint_labels``).
- ``JSONRouteErrors``, an ASGI middleware (added with ``add_asgi_middleware``),
  turns every 404 or 405 that is not already JSON into Rampart's JSON error
  shape: 404 ``not_found``, 405 ``method_not_allowed`` (keeping ``Allow``), and a trailing-slash
  redirect (``/classify/``) into a 404 ``not_found``; under ``/v2`` in the
  Open Inference Protocol's form instead (``rampart.api.oip.error_response``: ``{"error": "<string>"}``).
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.routing import BaseRoute, Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rampart.errors import MethodNotAllowed, NotFound, RampartError
from rampart.api import oip
from rampart.api.http import error_response, request_id_of

__all__ = ["OTHER_ENDPOINT", "route_template", "endpoint_label", "JSONRouteErrors"]

#: The one ``endpoint`` label value shared by every path that no route serves.
OTHER_ENDPOINT = "other"


def route_template(scope: Scope) -> str | None:
    """The path template of the route of ``scope["app"]`` that serves ``scope``'s path, else None.

    Matched as the app's router does: the first full match, else the first route
    that serves the path for other methods (a 405); mounts of apps with routes are
    searched inside, and the template includes the mount's prefix.
    """
    routes = getattr(getattr(scope.get("app"), "router", None), "routes", None) or ()
    return _template(routes, scope, "")[0]


def _template(routes: Iterable[BaseRoute], scope: Scope, prefix: str) -> tuple[str | None, bool]:
    """(template, full match) of the first route serving the path, preferring one that serves the method too."""
    path_only = None
    for route in routes:
        match, child_scope = route.matches(scope)
        if match == Match.NONE:
            continue
        template, full = prefix + getattr(route, "path", ""), match == Match.FULL
        inner = route.routes if isinstance(route, Mount) else None  # a mounted app's own routes
        if inner:
            template, full = _template(inner, {**scope, **child_scope}, template)
        if full:
            return template, True
        if path_only is None:
            path_only = template
    return path_only, False


#: ``endpoint_label``'s answers per app, by (method, path): the routes are matched once per path, not per
#: request. Only paths a route serves are kept, at most ``ENDPOINT_LABELS_KEPT`` per app, so random paths
#: cannot grow it; an app's entries go with the app.
_ENDPOINT_LABELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
ENDPOINT_LABELS_KEPT = 1024


def endpoint_label(scope: Scope) -> str:
    """The ``endpoint`` metric label of a request: its route's path template, else ``OTHER_ENDPOINT``.

    Matched once per app, method and path (``_ENDPOINT_LABELS``; a path no route serves is matched
    every time, and labelled ``OTHER_ENDPOINT``)."""
    app = scope.get("app")
    try:
        known = _ENDPOINT_LABELS.get(app)
        if known is None:
            known = _ENDPOINT_LABELS[app] = {}
    except TypeError:  # no app, or one that takes no weak reference: match every time
        return route_template(scope) or OTHER_ENDPOINT
    key = (scope.get("method", ""), scope.get("path", ""))
    label = known.get(key)
    if label is None:
        label = route_template(scope) or OTHER_ENDPOINT
        if label != OTHER_ENDPOINT and len(known) < ENDPOINT_LABELS_KEPT:
            known[key] = label
    return label


#: Called with (request, request_id, started perf_counter, error) for each 404/405 rewritten.
Answered = Callable[[Request, str, float, RampartError], None]


def _slash_redirect(path: str, headers: Headers) -> bool:
    """Whether a 307/308 with ``headers`` is Starlette's trailing-slash redirect of ``path``: its ``Location``
    is ``path`` with a trailing slash added or removed (``Router(redirect_slashes=True)``, BentoML's and
    Rampart's routers alike). Other redirects (``GET /docs``) are not."""
    target = urlsplit(headers.get("location", "")).path
    return target != path and target.rstrip("/") == path.rstrip("/")


class JSONRouteErrors:
    """ASGI middleware: every 404 or 405 response that is not JSON is replaced by Rampart's JSON error.

    The replaced response keeps its status and ``Allow`` header; its plain-text
    body is dropped. A trailing-slash redirect (``POST /classify/``: Starlette's routers
    answer an empty 307 to the path without the slash, which a client does not follow
    with its body) is a 404 ``not_found`` too, naming the slash. JSON 404/405s (Rampart's own, BentoML's task endpoints) pass
    unchanged. Under ``/v2`` the body is the protocol's ``{"error": "<code>: <message>"}``.
    ``answered`` (optional) is called for each replaced response, to
    count and log it.
    """

    def __init__(self, app: ASGIApp, answered: Answered | None = None) -> None:
        self.app = app
        self.answered = answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, replaced = time.perf_counter(), []

        async def send_json_errors(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in (404, 405, 307, 308):
                headers = Headers(raw=message.get("headers", []))
                if message["status"] in (307, 308):
                    if _slash_redirect(scope["path"], headers):
                        replaced.append(self._error(scope, 404, headers))
                        return
                elif not headers.get("content-type", "").startswith("application/json"):
                    replaced.append(self._error(scope, message["status"], headers))
                    return
            if not replaced:
                await send(message)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                request, request_id, error = replaced[0]
                answer = oip.error_response if oip.is_oip_path(scope["path"]) else error_response
                await answer(error, request_id)(scope, receive, send)
                if self.answered is not None:
                    self.answered(request, request_id, started, error)

        await self.app(scope, receive, send_json_errors)

    @staticmethod
    def _error(scope: Scope, status: int, headers: Headers) -> tuple[Request, str, RampartError]:
        request = Request(scope)
        method, path = scope["method"], scope["path"][:200]
        if status == 404:
            hint = " (the routes have no trailing slash)" if path.endswith("/") and path != "/" else ""
            return request, request_id_of(request), NotFound(f"no route serves {method} {path}{hint}")
        allowed = tuple(m.strip() for m in headers.get("allow", "").split(",") if m.strip())
        error = MethodNotAllowed(f"{path} answers {', '.join(allowed) or 'other methods'}, not {method}", allowed)
        return request, request_id_of(request), error
