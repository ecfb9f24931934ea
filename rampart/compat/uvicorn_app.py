"""Patch of uvicorn 0.54.0's ``Config.load``: the app uvicorn serves sits behind Rampart's in-flight bound.

The in-flight bound (``rampart.api.arrival.bound_inflight``, entered through
``rampart.api.arrival.behind_bound``) is plain ASGI. It must run before any of BentoML's
middlewares, and BentoML offers no place outside them, so ``serve_behind_bound()`` wraps the app
uvicorn itself calls. That app is built by ``Config.load`` for every protocol uvicorn runs
(httptools, h11, any ``http=`` choice), so the bound holds whichever protocol serves and needs no
httptools: ``tests/unit/test_compat.py`` proves it on uvicorn's own h11 protocol, with no httptools
patch. Applied by ``rampart.compat.apply_all``; the patched object's source is hashed in
``rampart.compat.targets``; docs/compat.md.
"""

from __future__ import annotations

__all__ = ["serve_behind_bound"]


def serve_behind_bound() -> None:
    """Patch ``uvicorn.Config.load`` so the app uvicorn serves is ``rampart.api.arrival.behind_bound(app)`` (idempotent).

    ``Config.load`` builds ``loaded_app``, the app every protocol (httptools, h11, any
    ``http=`` choice) calls for each request, after uvicorn's own wrappers; the in-flight bound
    then runs before any of BentoML's middlewares, whichever protocol uvicorn runs. Until
    ``bound_inflight`` installs a bound, the wrapper passes every request through.

    Fixes: no place in front of BentoML's middlewares for a bound that must refuse before they
    run (each costs CPU per request, which is what bounds how fast an overloaded worker sheds).
    Upstream: no upstream report found. Written for uvicorn 0.54.0; target ``uvicorn.config.Config.load``.
    """
    from uvicorn import config

    from rampart.api.arrival import behind_bound

    if getattr(config.Config.load, "_rampart_front", False):
        return
    load = config.Config.load

    def load_behind_bound(self) -> None:
        load(self)
        if not getattr(self.loaded_app, "_rampart_front", False):
            self.loaded_app = behind_bound(self.loaded_app)

    load_behind_bound._rampart_front = True
    config.Config.load = load_behind_bound
