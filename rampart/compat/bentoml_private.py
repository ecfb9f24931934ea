"""Private BentoML 1.4.29 names Rampart uses as they are (nothing here is patched).

Each is reached through a function, so importing this module imports no BentoML internals; a
BentoML upgrade that moves one breaks here, in one place (docs/compat.md).
"""

from __future__ import annotations

__all__ = ["debug_mode", "service_app_factory", "pickle_serde", "model_store_dir"]


def debug_mode() -> bool:
    """Whether BentoML runs in debug mode (``bentoml serve --debug`` or ``BENTOML_DEBUG=true``):
    ``bentoml._internal.configuration.get_debug_mode()``; BentoML has no public accessor."""
    from bentoml._internal.configuration import get_debug_mode

    return get_debug_mode()


def service_app_factory() -> type:
    """BentoML's ``_bentoml_impl.server.app.ServiceAppFactory``, the class that builds a service's ASGI app and
    its middleware stack (``bench/middleware_bench.py`` measures each middleware with it)."""
    from _bentoml_impl.server.app import ServiceAppFactory

    return ServiceAppFactory


def pickle_serde():
    """A new ``_bentoml_impl.serde.PickleSerde``: BentoML's pickle serde, the runner calls' wire format
    (``bench.runner_call_bench`` builds its calls with it, as BentoML's client does)."""
    from _bentoml_impl.serde import PickleSerde

    return PickleSerde()


def model_store_dir() -> str:
    """The local BentoML model store's directory (``$BENTOML_HOME/models``, ``~/bentoml/models`` by default):
    ``BentoMLContainer.model_store_dir``; BentoML has no public accessor."""
    from bentoml._internal.configuration.containers import BentoMLContainer

    return str(BentoMLContainer.model_store_dir.get())
