"""Everything Rampart does to third-party internals, in one package: the only code that imports a private module.

Rampart runs on BentoML 1.4.29, the uvicorn and httptools versions pinned with it, and the
circus (``kantoku``) BentoML brings. Where their public API does not reach, Rampart patches or
imports their internals, and only here (``tests/unit/test_compat.py`` walks the repository and
fails on a private import anywhere else):

- ``bentoml_server``: BentoML's HTTP server middlewares and IO classes
  (``cancel_request_timers``, ``bound_endpoint_labels``, ``cache_io_media_types``).
- ``bentoml_batching``: BentoML's adaptive batching (``dispatch_when_free``, ``wake_on_release``).
- ``circus_arbiter``: BentoML's circus arbiter at SIGTERM (``keep_runner_sockets_until_stopped``).
- ``uvicorn_httptools``: uvicorn's httptools protocol (``limit_request_heads`` with
  ``HeadLimitedProtocol``, ``stamp_arrivals``).
- ``uvicorn_app``: the app uvicorn serves, whatever its protocol (``serve_behind_bound``: the
  in-flight bound, which needs no httptools).
- ``uvicorn_cycle``: uvicorn's request cycle read as it is, patched nowhere (``connection_closed``: a
  write refused because the client's connection closed, under ``rampart.hangup``).
- ``bentoml_private``: private BentoML names used as they are, patched nowhere (``debug_mode``,
  ``service_app_factory``, ``pickle_serde``).
- ``bentoml_runner_calls``: a runner's batch calls answered in front of BentoML's app with BentoML's own
  parse, dispatch and answer, patching nothing (``lean_batch_routes``; ``runners.common`` installs it).
- ``bentoml_wire``: BentoML's runner-call wire format built and read with BentoML's own objects,
  patched nowhere (``RunnerWire``, ``runner_address``), under ``rampart.runner_client``.
- ``forkserver``: CPython's multiprocessing forkserver, which starts the decode workers, made to ignore SIGTERM
  (``ignore_stop_signals_in_forkserver``; standard library, so checked by behaviour, not by a hash).
- ``targets``: each patched upstream object with the SHA-256 of its source at the pinned version.

Each patch is idempotent and marks what it replaced. ``apply_all()`` checks the versions
(``check_versions``) and applies every patch; ``service.py`` calls it when imported, which
``bentoml serve`` does in every process (entry service and runners); ``runners.common`` checks the
versions and applies ``dispatch_when_free`` itself when imported, and ``wake_on_release`` (the one
patch ``apply_all`` leaves out: it runs only in runners, and ``RUNNER_DISPATCH_WAKE=poll`` turns it
off for the A/B). docs/compat.md lists the patches
and what to do when upgrading BentoML.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable

__all__ = ["PINS", "check_versions", "apply_all"]

#: The distributions the patches were written for, at the versions pinned in requirements.txt and
#: constraints.txt (``tests/unit/test_compat.py`` checks that the three agree).
PINS: dict[str, str] = {"bentoml": "1.4.29", "uvicorn": "0.54.0", "httptools": "0.9.0"}


def check_versions(version_of: Callable[[str], str] = importlib.metadata.version) -> None:
    """Refuse to run on another BentoML, uvicorn or httptools than ``PINS``.

    ``version_of(distribution)`` gives the installed version (default: ``importlib.metadata.version``,
    which raises ``PackageNotFoundError`` for one not installed). Raises ``RuntimeError`` naming each
    distribution whose installed version differs from its pin (or that is missing), with the expected
    and found versions; returns None when all match.
    """
    wrong = []
    for name, pinned in PINS.items():
        try:
            found = version_of(name)
        except importlib.metadata.PackageNotFoundError:
            found = "not installed"
        if found != pinned:
            wrong.append(f"{name} {found} (expected {pinned})")
    if wrong:
        raise RuntimeError(
            "Rampart patches internals of these exact versions and refuses to start on others: found "
            + ", ".join(wrong) + ". Install the versions pinned in requirements.txt and constraints.txt, "
            "or see docs/compat.md for how to upgrade.")


def apply_all() -> None:
    """Check the versions (``check_versions``, ``RuntimeError`` on a mismatch), then apply every patch
    (idempotent)."""
    check_versions()  # first: the patch modules import the internals they patch

    from rampart.compat.bentoml_batching import dispatch_when_free
    from rampart.compat.bentoml_server import bound_endpoint_labels, cache_io_media_types, cancel_request_timers
    from rampart.compat.circus_arbiter import keep_runner_sockets_until_stopped
    from rampart.compat.uvicorn_app import serve_behind_bound
    from rampart.compat.uvicorn_httptools import limit_request_heads, stamp_arrivals

    cancel_request_timers()  # BentoML 1.4.29 keeps every request alive for traffic.timeout
    stamp_arrivals()  # deadlines count from each request's first byte (rampart.api.arrival)
    bound_endpoint_labels()  # BentoML labels its traffic metrics with the raw path
    limit_request_heads()  # uvicorn's httptools protocol accepts request heads of any size
    serve_behind_bound()  # the in-flight bound, before every middleware, whichever protocol uvicorn runs
    keep_runner_sockets_until_stopped()  # BentoML's arbiter deletes the runners' sockets at SIGTERM, before the drain
    cache_io_media_types()  # BentoML rebuilds a JSON schema for every response's media type
    dispatch_when_free()  # BentoML's batcher learns to hold a lone request back after an overload
