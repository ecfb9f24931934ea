"""Reading uvicorn 0.54.0's request cycle, patched nowhere: whether a request's connection has closed.

``connection_closed(send)`` lets ``rampart.hangup`` tell a write refused because the client's connection
closed (its answer has nobody to read it: counted as a client gone) from any other error of the app.
It imports nothing from uvicorn, so it holds for the h11 protocol as for httptools. Its targets are
hashed in ``rampart.compat.targets``; docs/compat.md.
"""

from __future__ import annotations

__all__ = ["connection_closed"]


def connection_closed(send) -> bool:
    """Whether ``send`` (the ASGI send a uvicorn protocol gave a request: a ``RequestResponseCycle``'s bound
    ``send``, httptools or h11) writes to a transport that is already closed or closing.

    uvicorn's ``send`` returns quietly once the cycle is marked disconnected, which ``connection_lost``
    does. Between a failed write closing the transport (a client that pipelined requests and hung up:
    reading is paused, so its FIN is not read) and ``connection_lost`` running, the event loop's transport
    refuses the write (uvloop: ``RuntimeError: unable to perform operation on <TCPTransport closed=True>``),
    which uvicorn logged as an error of the application. Duck-typed (``send.__self__.transport``): False for
    any other callable. Written for uvicorn 0.54.0; targets ``RequestResponseCycle.__init__`` (``transport``)
    and ``RequestResponseCycle.send`` of both protocols.
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    is_closing = getattr(transport, "is_closing", None)
    return bool(is_closing is not None and is_closing())

