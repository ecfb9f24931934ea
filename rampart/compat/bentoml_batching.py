"""Patch of BentoML 1.4.29's adaptive batching (``CorkDispatcher``'s optimizer): no learned wait.

``dispatch_when_free()``; see the function. Applied when ``runners.common`` is imported (every
runner process) and by ``rampart.compat.apply_all``; the patched object's source is hashed in
``rampart.compat.targets``; docs/compat.md.
"""

from __future__ import annotations

__all__ = ["dispatch_when_free"]


def dispatch_when_free() -> None:
    """Make BentoML's adaptive batching send a batch as soon as the model is free, never later.

    BentoML 1.4.29's ``CorkDispatcher`` (``bentoml/_internal/marshal/dispatcher.py``)
    holds a batch back while ``n × (age of the newest request + 1 ms + a) ≤ 0.95 ×
    wait``, where ``wait`` is the *average time the last 50 batches waited* before
    they were sent, refreshed every 5 s. Under overload batches wait hundreds of ms
    for the busy model, so ``wait`` grows; afterwards a lone request is held back for
    almost ``wait``, and its batch logs that wait again, so the learned value feeds
    itself (fixed point about 20 × (a + 1 ms), a ≈ 10 ms per image here: ~200 ms).
    Rampart measured this as single-connection latency of 158-229 ms instead of
    32-45 ms for as long as it looked, after a closed-loop overload.

    Rampart needs no cork: its admission gate keeps at most one batch computing and
    one forming per model, so batches fill by themselves while the model is busy,
    and an idle model should start at once (Triton's default, ``max_queue_delay``
    0). This keeps the dispatcher's fitted batch-cost model (used only for its
    ``max_latency_ms`` cancellation, which Rampart sets out of reach) and pins the
    learned wait to 0. Idempotent; applied when ``runners.common`` is imported, which
    every runner process does (and by ``rampart.compat.apply_all``).

    Fixes: a learned batching wait that fed itself after an overload (above). Upstream: no
    upstream report found (BentoML's https://github.com/bentoml/BentoML/pull/3664 set the wait to
    0 only while the optimizer trains). Written for BentoML 1.4.29; target
    ``bentoml._internal.marshal.dispatcher.Optimizer.trigger_refresh``.
    """
    from bentoml._internal.marshal import dispatcher

    optimizer = dispatcher.Optimizer
    if getattr(optimizer.trigger_refresh, "_rampart_fixed", False):
        return
    refresh = optimizer.trigger_refresh

    def trigger_refresh(self) -> None:
        refresh(self)
        self.wait = 0.0

    trigger_refresh._rampart_fixed = True
    optimizer.trigger_refresh = trigger_refresh

