"""Fixes for BentoML 1.4.29 defects that Rampart depends on not having.

``bentoml._internal.server.http.traffic.TimeoutMiddleware`` schedules
``loop.call_later(timeout, ...)`` for every request and never cancels it. Each
finished request then stays reachable for ``traffic.timeout`` seconds (70 s for
Rampart): its timer, future and OpenTelemetry context. At 150 requests/s that
is about 10,000 live objects per process, every full garbage collection scans
them, and the event loop stalls for 100-250 ms on a 2-core host: answers leave
after their deadline. ``cancel_request_timers()`` replaces the middleware's
``__call__`` with the same logic plus ``handle.cancel()`` once the request is
done. It is idempotent and applied when ``service.py`` is imported (by the entry
service and by each runner process).

``keep_runner_sockets_until_stopped()``: on SIGTERM the arbiter deletes the
runners' Unix socket files before stopping any process; see the function.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_request_timers", "keep_runner_sockets_until_stopped"]


def cancel_request_timers() -> None:
    """Patch ``TimeoutMiddleware.__call__`` so each request's timer is cancelled when it ends."""
    from starlette.responses import JSONResponse

    from bentoml._internal.server.http import traffic

    middleware = traffic.TimeoutMiddleware
    if getattr(middleware.__call__, "_rampart_fixed", False):
        return

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()
        handle = loop.call_later(self.timeout, self._set_timer_out, waiter)

        async def _send(message) -> None:
            if not waiter.done():
                waiter.set_result(None)
            await send(message)

        fut = asyncio.ensure_future(self.app(scope, receive, _send), loop=loop)
        try:
            await waiter
        except asyncio.TimeoutError:
            if fut.cancel():
                response = JSONResponse({"error": f"Not able to process the request in {self.timeout} seconds"},
                                        status_code=504)
                await response(scope, receive, send)
        else:
            await fut
        finally:
            handle.cancel()

    __call__._rampart_fixed = True
    middleware.__call__ = __call__


def keep_runner_sockets_until_stopped() -> None:
    """Patch BentoML's circus ``Arbiter`` so the runners' Unix socket files outlive their processes.

    ``bentoml._internal.utils.circus.Arbiter.stop`` runs its exit stack first, and
    ``serve_http`` put ``shutil.rmtree(uds_path)`` on it: on SIGTERM the runners'
    socket files are deleted at once, before any process has stopped. Connections
    already open keep working, but every new connection from the entry service to a
    runner fails with ``ConnectError: No such file or directory``, so requests still
    in flight find no model (the graceful drain, ``rampart.lifecycle``, needs them).
    The patch runs that exit stack after the watchers have stopped, where circus
    closes its sockets (``stop_controller_and_close_sockets``). It takes effect in
    the ``bentoml serve`` process, which imports ``service.py`` before it builds the
    arbiter, and is idempotent.
    """
    from circus.arbiter import Arbiter as CircusArbiter

    from bentoml._internal.utils import circus as bentoml_circus

    arbiter = bentoml_circus.Arbiter
    if getattr(arbiter.stop, "_rampart_fixed", False):
        return

    def stop(self):
        return CircusArbiter.stop(self)

    def stop_controller_and_close_sockets(self) -> None:
        try:
            CircusArbiter.stop_controller_and_close_sockets(self)
        finally:
            self.exit_stack.__exit__(None, None, None)

    stop._rampart_fixed = True
    arbiter.stop = stop
    arbiter.stop_controller_and_close_sockets = stop_controller_and_close_sockets
