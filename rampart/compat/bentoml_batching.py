"""Patch of BentoML 1.4.29's adaptive batching (``CorkDispatcher``'s optimizer): no learned wait.

``dispatch_when_free()``; see the function. Applied when ``runners.common`` is imported (every
runner process) and by ``rampart.compat.apply_all``; the patched object's source is hashed in
``rampart.compat.targets``; docs/compat.md.
"""

from __future__ import annotations

import time

__all__ = ["dispatch_when_free", "wake_on_release"]


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

    The optimizer's training holds requests back too. Its last two training calls
    (``train_optimizer(5, 1, 2)`` and ``(3, 1, 3)``, run by each dispatcher, one per bucket
    route) wait for a batch of 2 and then 3 requests, until the first one has waited
    ``(n + 1) × a`` (3a, then 4a). With requests one at a time that is a lone request held:
    Rampart measured six of the first 70 sequential answers of a fresh server (two per
    bucket) with 75-116 ms in the queue against 44-73 ms of inference. So a training
    call here never asks for more than one request: it sends whatever is queued when the
    model is free, as serving does. The fit still gets whatever batch sizes form, and
    Rampart uses it only for the ``max_latency_ms`` cancellation.

    Fixes: a learned batching wait that fed itself after an overload, and training calls
    that held a fresh server's lone requests (above). Upstream: no upstream report found
    (BentoML's https://github.com/bentoml/BentoML/pull/3664 set the wait to 0 only while the
    optimizer trains). Written for BentoML 1.4.29; targets
    ``bentoml._internal.marshal.dispatcher.Optimizer.trigger_refresh`` and
    ``CorkDispatcher.train_optimizer``.
    """
    from bentoml._internal.marshal import dispatcher

    optimizer, cork = dispatcher.Optimizer, dispatcher.CorkDispatcher
    if not getattr(optimizer.trigger_refresh, "_rampart_fixed", False):
        refresh = optimizer.trigger_refresh

        def trigger_refresh(self) -> None:
            refresh(self)
            self.wait = 0.0

        trigger_refresh._rampart_fixed = True
        optimizer.trigger_refresh = trigger_refresh
    if not getattr(cork.train_optimizer, "_rampart_fixed", False):
        train = cork.train_optimizer

        async def train_optimizer(self, num_required_reqs: int, num_reqs_to_train: int,
                                  training_batch_size: int) -> None:
            await train(self, num_required_reqs, num_reqs_to_train, 1)

        train_optimizer._rampart_fixed = True
        cork.train_optimizer = train_optimizer



class _ReleaseSignal:
    """BentoML's ``NonBlockSema`` (a counter of free batch slots) that also sets ``freed`` on every release."""

    def __init__(self, count: int) -> None:
        import asyncio

        self.sema = count
        self.freed = asyncio.Event()

    def acquire(self) -> bool:
        if self.sema < 1:
            return False
        self.sema -= 1
        return True

    def is_locked(self) -> bool:
        return self.sema < 1

    def release(self) -> None:
        self.sema += 1
        self.freed.set()


def wake_on_release() -> None:
    """Make BentoML's batch dispatcher wait for a free batch slot instead of polling for one every 1 ms.

    BentoML 1.4.29's ``CorkDispatcher.controller`` (``bentoml/_internal/marshal/dispatcher.py``),
    once its optimizer is trained, loops while requests are queued: when its one batch slot
    is taken (a batch computing) it sleeps ``TICKET_INTERVAL`` (1 ms) and looks again, so a
    runner whose model computes a 60 ms batch runs its controller about 60 times per batch,
    on the core the model needs (py-spy showed 36% of a near-free runner's busy samples in
    the event loop itself). This replaces the controller with the same steps in the same
    order (the training calls, the cancellation of requests past ``max_latency``, the cork
    check, the dispatch), except that with the slot taken it waits on the slot's release
    (``_ReleaseSignal.freed``), for at most the time left until the oldest request would
    pass ``max_latency`` (so the cancellation happens when it did). The dispatcher's
    semaphore is swapped for a ``_ReleaseSignal`` of the same count when the controller
    starts (before any batch has taken the slot). Idempotent.

    Fixes: the 1 ms poll while a batch computes. Upstream: no upstream report found. Written
    for BentoML 1.4.29; target ``bentoml._internal.marshal.dispatcher.CorkDispatcher``
    (``controller``, ``train_optimizer``, ``outbound_call``'s ``release``, ``NonBlockSema``).
    """
    import asyncio

    from bentoml._internal.marshal import dispatcher

    cork = dispatcher.CorkDispatcher
    if getattr(cork.controller, "_rampart_fixed", False):
        return
    logger = dispatcher.logger

    async def controller(self) -> None:
        if not isinstance(self._sema, _ReleaseSignal):
            self._sema = _ReleaseSignal(self._sema.sema)
        try:  # BentoML's training steps, unchanged
            await self.train_optimizer(self.optimizer.N_SKIPPED_SAMPLE, self.optimizer.N_SKIPPED_SAMPLE + 6, 1)
            await self.train_optimizer(6, 1, 1)
            self.optimizer.trigger_refresh()
            await self.train_optimizer(5, 1, 2)
            self.optimizer.trigger_refresh()
            await self.train_optimizer(3, 1, 3)
            self.optimizer.trigger_refresh()
            if self.optimizer.o_a + self.optimizer.o_b >= self.max_latency:
                logger.warning("BentoML has detected that a service has a max latency that is likely too low for "
                               "serving. If many 503 errors are encountered, try raising the 'runner.max_latency' "
                               "in your BentoML configuration YAML file.")
        except Exception:  # pylint: disable=broad-except
            logger.exception("Error training optimizer")
        while True:
            try:
                async with self._wake_event:  # block until there's any request in queue
                    await self._wake_event.wait_for(self._queue.__len__)
                n = len(self._queue)
                dt = self.TICKET_INTERVAL
                decay = 0.95
                now = time.time()
                w0 = now - self._queue[0].enqueue_time
                wn = now - self._queue[-1].enqueue_time
                a = self.optimizer.o_a
                b = self.optimizer.o_b
                latency_0 = w0 + a * n + b
                if n > 1 and latency_0 >= self.max_latency:
                    self._queue.popleft().future.cancel()
                    continue
                if self._sema.is_locked():
                    if n == 1 and w0 >= self.max_latency:
                        self._queue.popleft().future.cancel()
                        continue
                    # upstream sleeps TICKET_INTERVAL here; wait for the release, or until a cancellation is due
                    left = self.max_latency - (w0 if n == 1 else latency_0)
                    self._sema.freed.clear()
                    if self._sema.is_locked():
                        try:
                            await asyncio.wait_for(self._sema.freed.wait(), timeout=max(left, dt))
                        except asyncio.TimeoutError:
                            pass
                    continue
                if n < self.max_batch_size and n * (wn + dt + (a or 0)) <= self.optimizer.wait * decay:
                    await asyncio.sleep(self.TICKET_INTERVAL)
                    continue
                self._sema.acquire()
                inputs_info = tuple(self._get_inputs())
                self._loop.create_task(self.outbound_call(inputs_info))
            except Exception:  # pylint: disable=broad-except
                logger.exception("Error processing batch requests")

    controller._rampart_fixed = True
    cork.controller = controller
