"""Patch of BentoML 1.4.29's circus arbiter (``bentoml serve``'s process manager) at SIGTERM.

``keep_runner_sockets_until_stopped()``: on SIGTERM the arbiter deletes the runners' Unix socket
files before stopping any process; see the function. Applied by ``rampart.compat.apply_all``;
the patched objects' sources are hashed in ``rampart.compat.targets``; docs/compat.md.
"""

from __future__ import annotations

__all__ = ["keep_runner_sockets_until_stopped"]


def keep_runner_sockets_until_stopped() -> None:
    """Patch BentoML's circus ``Arbiter`` so the runners' Unix socket files outlive their processes.

    ``bentoml._internal.utils.circus.Arbiter.stop`` runs its exit stack first, and
    ``serve_http`` put ``shutil.rmtree(uds_path)`` on it: on SIGTERM the runners'
    socket files are deleted at once, before any process has stopped. Connections
    already open keep working, but every new connection from the entry service to a
    runner fails with ``ConnectError: No such file or directory``, so requests still
    in flight find no model (the graceful drain, ``rampart.api.lifecycle``, needs them).
    The patch runs that exit stack after the watchers have stopped, where circus
    closes its sockets (``stop_controller_and_close_sockets``). It takes effect in
    the ``bentoml serve`` process, which imports ``service.py`` before it builds the
    arbiter, and is idempotent.

    Fixes: the runners' socket files deleted at SIGTERM, so requests admitted before it found no
    model during the drain. Upstream: no upstream report found. Written for BentoML 1.4.29 with
    kantoku (circus) 0.18.3; targets
    ``bentoml._internal.utils.circus.Arbiter.stop`` (``_bentoml_impl.server.serving.serve_http``
    registers the ``rmtree``) and circus's ``Arbiter.stop`` and ``stop_controller_and_close_sockets``.
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
