"""A client that has gone gets nothing more: its request stops where it waits, and its places are given back.

``serve_until_hang_up(app, scope, receive, send)`` runs one request's ASGI ``app``. Once the request's
body is in, it listens for the connection closing (the server's ``http.disconnect`` message, which
uvicorn sends when the connection is lost before the response is complete) and, when the client
goes before any of the response was sent, cancels the request's task where it waits:

- waiting for a decoder or decoding (``rampart.inputs.pool.BoundedPool.run``: a job not started is
  taken out of the queue; one running is left to finish, its worker is not killed, since
  ``hung_up()`` says the request was cancelled because its client went, not for its deadline);
- waiting for its turn in a model's admission queue (the ticket leaves the queue: ``Ticket.turn``);
- dispatched but not yet sent to the runner (``rampart.lane.ModelLane.attempt`` then cancels the
  runner call too, so the coalescer takes the image back: ``rampart.coalesce``; an image already sent
  is computed, and its answer dropped);
- and every place it held (the in-flight bound, its admission tickets) is released as the
  cancellation unwinds, so the capacity is back as soon as the event loop runs the cancellation.

The request is counted in ``rampart_client_gone_total{stage}``, ``stage`` being where it was
(``STAGES``: ``decode`` from the end of its body until it waits for a model, which includes the
handler's own parsing, then ``queue``, ``model`` and ``answer``), kept by
``set_stage`` in a per-request ``Request`` found through a context variable (tasks the request
starts see the same one). No response is sent (there is nobody to read it); uvicorn then logs
nothing, since the connection is marked disconnected. A connection that closes while the answer is
written (``rampart.compat.uvicorn_cycle.connection_closed``: the write is refused before uvicorn has
marked it disconnected) is counted the same way, at ``answer``, instead of failing the request.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

from rampart.compat.uvicorn_cycle import connection_closed

__all__ = ["STAGES", "Request", "serve_until_hang_up", "set_stage", "hung_up"]

#: Where a request can be when its client goes (after its body is in: before, the server's own body read sees it).
STAGES = ("decode", "queue", "model", "answer")


@dataclass
class Request:
    """One request's hang-up state: ``stage`` (one of ``STAGES``) and ``gone`` (its client has gone)."""

    stage: str = "decode"
    gone: bool = False


_CURRENT: ContextVar[Request | None] = ContextVar("rampart_request", default=None)


def set_stage(stage: str) -> None:
    """Note that the current request (if it is watched) is now at ``stage`` (one of ``STAGES``)."""
    request = _CURRENT.get()
    if request is not None:
        request.stage = stage


def hung_up() -> bool:
    """Whether the current request's client has gone (then its task is being cancelled for that)."""
    request = _CURRENT.get()
    return request is not None and request.gone


async def serve_until_hang_up(app: Callable, scope: dict, receive: Callable, send: Callable,
                              on_gone: Callable[[str], None] = lambda stage: None) -> None:
    """Run ``app(scope, receive, send)``; cancel it when the client goes after its body and before any response.

    Returns normally then, after ``on_gone(stage)`` (the cancellation is absorbed; the service counts
    it in ``rampart_client_gone_total``); any other cancellation or error propagates unchanged.
    """
    task = asyncio.current_task()
    request = Request()
    token = _CURRENT.set(request)
    started = False
    watcher: asyncio.Task | None = None

    async def watch() -> None:
        message = await receive()
        if message.get("type") == "http.disconnect" and not started and task is not None:
            request.gone = True
            task.cancel()

    async def receive_body() -> dict:
        nonlocal watcher
        message = await receive()
        if (message.get("type") == "http.request" and not message.get("more_body", False) and watcher is None
                and not started):
            watcher = asyncio.get_running_loop().create_task(watch())
        return message

    async def send_marking(message: dict) -> None:
        nonlocal started
        if message.get("type") == "http.response.start":
            started = True
            request.stage = "answer"
        if request.gone:
            return  # the connection closed under an earlier part of the answer: nothing more is written
        try:
            await send(message)
        except RuntimeError:
            if not connection_closed(send):
                raise
            request.gone = True  # the client went while its answer was written: counted, not an error
            on_gone(request.stage)

    try:
        await app(scope, receive_body, send_marking)
    except asyncio.CancelledError:
        if not request.gone or task is None:
            raise
        task.uncancel()
        on_gone(request.stage)
    finally:
        if watcher is not None and not watcher.done():
            watcher.cancel()
        # The watcher's context holds the request (BentoML's request variable), whose receive chain holds
        # receive_body and so this cell: emptied, the request is freed without the cycle collector.
        watcher = None
        _CURRENT.reset(token)
