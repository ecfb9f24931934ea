"""Rampart's entry service: the HTTP API in front of the two runners.

``bentoml serve`` starts this service plus one process per runner
(``runners.primary.Primary``, ``runners.fallback.Fallback``), wired in with
``bentoml.depends``. The HTTP routes are a small Starlette app mounted on the
service, so Rampart controls body reading (byte cap while streaming), error
bodies and status codes exactly; BentoML's own ``/readyz``, ``/livez`` and
``/metrics`` stay as they are. The pipeline itself is ``rampart.pipeline``.

Routes:
- ``/classify``, ``/classify_batch``, ``/stats`` and ``/v2/...``: the Starlette app of
  ``rampart.api.app.create_app``, made at import (``@bentoml.asgi_app`` needs it then) and
  given its pipeline and lifecycle by ``Rampart.__init__`` (``rampart.api.app.attach``).
- any other path or method: JSON 404/405 (``rampart.api.routing.JSONRouteErrors``).
- ``GET /metrics`` (BentoML's): answered from renderings shared by the scrapes waiting for them, at most
  one per ``metrics_render_interval_ms`` (``rampart.telemetry.scrapes.CoalescedMetrics``).
- ``POST /bentoml/classify`` and ``POST /bentoml/classify_batch``: ``/classify`` and
  ``/classify_batch`` as BentoML APIs, for ``bentoml.SyncHTTPClient`` and BentoML's OpenAPI
  page (Swagger UI at ``/``, ``/docs.json``; ``/docs`` redirects to it) (``rampart.api.bentoml_api``).

Lifecycle (``rampart.api.lifecycle``): both routes answer 503 ``not_ready`` until both
runners have warmed up, and 503 ``shutting_down`` once SIGTERM has arrived; the
requests admitted before it are answered before the worker exits.
"""

from __future__ import annotations

import os

# OpenMP threads (torch's intra-op pool) sleep between batches instead of spinning, so the
# primary's idle threads leave the cores to the fallback and the API layer and the other way
# round (measured at the knee on the 2-core host: CPU per image fell from 140 ms to 40 ms;
# docs/benchmarks.md, "CPU defaults").
# libgomp reads this once, when torch is first imported, so it must be set before any
# import below pulls torch in; every runner process imports this module first. Set
# OMP_WAIT_POLICY=ACTIVE in the environment to get spinning back.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio  # noqa: E402 - after the wait policy above
import dataclasses
import gc
import logging
import time
from typing import Callable

import bentoml
import psutil
from starlette.requests import Request

from rampart.api import oip
from rampart.api.app import (answer_body_too_slow, attach, classify_batch_endpoint, classify_endpoint, create_app,
                             log_client_gone, refuse_before_admission, refuse_body_over_budget, route_error_answered,
                             state_of)
from rampart.api.arrival import bound_inflight
from rampart.api.http import MULTIPART_OVERHEAD_BYTES
from rampart.api.bentoml_api import (CLASSIFY_API_ROUTE, CLASSIFY_BATCH_API_ROUTE, CLASSIFY_BATCH_DOC, CLASSIFY_DOC,
                                    BatchAnswer, BatchUpload, ClassifyAnswer, ImageUpload, RefusePickleBodies, documented)
from rampart.api.lifecycle import ENTRY_SERVICE_NAME, Lifecycle, all_entry_workers_ready, intercept_exit_signals
from rampart.api.lifecycle import mark_worker_ready
from rampart.api.lifecycle import logger as lifecycle_log
from rampart.api.routing import JSONRouteErrors
from rampart.compat import apply_all
from rampart.compat.bentoml_wire import runner_address
from rampart.config import get_settings
from rampart.cores import place_this_process
from rampart.heap import IdleTrim
from rampart.inputs.buckets import buckets_for_resolution
from rampart.overload.looplag import LoopLagMonitor
from rampart.coalesce import Boarding, Coalescer
from rampart.pipeline import Pipeline, ModelEndpoint, RunnerResult, decode_pool
from rampart.lane import RiderSource
from rampart.runner_client import RunnerClient
from rampart.shadow import ShadowMirror, models_busy
from rampart.telemetry import metrics
from rampart.telemetry.scrapes import CoalescedMetrics
from runners.common import RunnerItem
from runners.fallback import Fallback
from runners.primary import Primary
from runners.shadow import Shadow

logger = logging.getLogger("rampart.service")
settings = get_settings()
# The pinned BentoML, uvicorn and httptools, or a RuntimeError; then every patch of their internals
# (the request timers, arrival stamps, metric labels, head bound, in-flight bound's place, runner
# sockets, media types, batching wait): rampart.compat and docs/compat.md.
apply_all()


def model_endpoint(tag: str, runner, max_items: int = 1,
                   item_cost_s: Callable[[], float | None] = lambda: None) -> ModelEndpoint:
    """A ``ModelEndpoint`` for the runner dependency ``runner`` serving model ``tag``.

    ``runner`` is a BentoML remote proxy under ``bentoml serve``, or the runner
    instance itself when the service is built in-process. With ``runner_coalescing``
    (the default) images bound for one bucket share a runner call
    (``rampart.coalesce.Coalescer``: at most ``runner_calls_in_flight`` calls out per
    bucket, at most ``max_items`` images each, the runner's ``max_batch_size``, and no more than
    fit before the earliest deadline at ``item_cost_s()``, the model's measured seconds per image).
    With ``runner_low_priority_riders`` as well, the lane tops calls up with waiting low-priority images
    (``accept_riders``; ``rampart.overload.admission.AdmissionGate.carry``).
    """
    stored = bentoml.models.get(tag)
    meta = stored.info.metadata
    remote = getattr(runner, "to_async", None)
    address = runner_address(remote) if remote is not None and settings.runners.transport == "lean" else None
    lean = RunnerClient(remote, address) if address is not None else None

    async def send(bucket_name: str, items: list[RunnerItem]) -> list:
        if lean is not None:
            return await lean.call(bucket_name, items)
        if remote is not None:
            return await getattr(remote, bucket_name)(items)
        return await asyncio.to_thread(getattr(runner, bucket_name), items)

    coalescer = Coalescer(send, lambda item: item.deadline_epoch_s, max_items=max(max_items, 1),
                          in_flight=settings.runners.calls_in_flight, item_cost_s=item_cost_s)

    async def call(bucket_name: str, pixels, deadline_epoch_s: float) -> RunnerResult:
        item = RunnerItem(pixels=pixels, deadline_epoch_s=deadline_epoch_s)
        if settings.runners.coalescing:
            result = await coalescer.call(bucket_name, item)
        else:
            (result,) = await send(bucket_name, [item])
        return RunnerResult.from_wire(result)

    def accept_riders(source: RiderSource, fill_to: Callable[[], int]) -> None:
        def top_up(boarding: Boarding) -> list:
            return [(RunnerItem(pixels=pixels, deadline_epoch_s=deadline_epoch_s), future)
                    for pixels, deadline_epoch_s, future in source(boarding)]
        coalescer.top_up, coalescer.fill_to = top_up, fill_to

    return ModelEndpoint(
        name=stored.tag.name,
        version=stored.tag.version,
        labels=list(meta["labels"]),
        buckets=buckets_for_resolution(int(meta["resolution"])),
        call=call,
        call_stats=lambda: {"coalescing": settings.runners.coalescing, "transport": "lean" if lean else "proxy",
                            "connections_opened": lean.pool.opened if lean else None,
                            **dataclasses.asdict(coalescer.stats),
                            "items_per_call": coalescer.stats.items_per_call},
        accept_riders=accept_riders if settings.runners.coalescing and settings.runners.low_priority_riders else None,
    )


async def runner_stats(runner) -> dict | None:
    """A runner's ``stats`` API (warm-up speed, TTL drops), or None while it cannot answer."""
    try:
        remote = getattr(runner, "to_async", None)
        return await remote.stats() if remote is not None else await runner.stats()
    except Exception as exc:
        logger.info("runner stats unavailable: %s", exc)
        return None


http_app = create_app(settings)


#: Routes whose requests go through admission (``rampart.api.arrival.bound_inflight``, tracing off by default).
ADMITTED_ROUTES = ("/classify", "/classify_batch", *oip.INFER_PATHS, CLASSIFY_API_ROUTE, CLASSIFY_BATCH_API_ROUTE)
#: Monitoring routes, never traced unless ``trace_requests``: a scrape's span cost about 220 µs of event-loop CPU,
#: two thirds of the whole middleware stack's 330 µs (``bench.middleware_bench`` stack around a GET, 2026-12-01), and
#: was thrown away as every span is without an exporter; a storm of scrapes paid it per scrape.
MONITORING_ROUTES = ("/stats", "/metrics")


def accept_backlog() -> int:
    """The listening socket's backlog: connections the kernel holds before Rampart accepts them.

    Twice the places both admission gates have with their smallest queues (one
    batch each): ``2 × Σ ((concurrent_batches + 2) × max_batch_size)``, 288 with the
    defaults, and more than 64, the least BentoML's configuration accepts
    (``ensure_larger_than(64)``). A connection waiting there is invisible to every
    deadline clock; any more than this could only be shed once accepted, so the
    kernel refuses them instead of BentoML's default 2048 waiting.
    """
    places = sum((batches + 2) * size for batches, size in (
        (settings.primary.concurrent_batches, settings.primary.max_batch_size),
        (settings.fallback.concurrent_batches, settings.fallback.max_batch_size)))
    return max(65, 2 * places)


def middleware_config() -> dict:
    """BentoML service configuration for its per-request middlewares (reasons: docs/overload.md).

    BentoML's access log is off (Rampart writes its own JSON line per request);
    tracing skips the admitted and the monitoring routes unless ``trace_requests``
    (``excluded_urls`` are regular expressions searched in the URL, so ``/stats`` also
    leaves out the Open Inference Protocol's ``/v2/models/rampart/stats``).
    """
    config: dict = {"logging": {"access": {"enabled": False}}}
    if not settings.telemetry.trace_requests:
        config["tracing"] = {"excluded_urls": [*ADMITTED_ROUTES, *MONITORING_ROUTES]}
    return config


@bentoml.service(name=ENTRY_SERVICE_NAME, workers=settings.api_workers, traffic={"timeout": settings.deadlines.max_deadline_ms / 1000 + 10},
                 backlog=accept_backlog(), **middleware_config())
@bentoml.asgi_app(http_app, path="/")
class Rampart:
    """Image classification that degrades honestly under overload; see README.md and docs/."""

    primary = bentoml.depends(Primary)
    fallback = bentoml.depends(Fallback)
    if settings.shadow.model:  # a third runner only when shadow traffic is on (rampart.shadow)
        shadow_runner = bentoml.depends(Shadow)

    def __init__(self) -> None:
        place_this_process("api", settings)  # before the decode pool, whose workers inherit the cores
        self.pipeline = Pipeline(
            settings,
            model_endpoint(settings.primary.model, self.primary, settings.primary.max_batch_size,
                           lambda: self.seconds_per_image("primary")),
            model_endpoint(settings.fallback.model, self.fallback, settings.fallback.max_batch_size,
                           lambda: self.seconds_per_image("fallback")),
            decode_pool(settings),
        )
        self.loop_lag = LoopLagMonitor()
        self.heap_trim = IdleTrim(settings.inputs.held_body_heap_trim_idle_s)  # the heap large bodies leave
        bound_inflight(self.pipeline.inflight_limit, refuse_before_admission(http_app), ADMITTED_ROUTES,
                       watch_hang_ups=settings.connections.cancel_on_hang_up, too_slow=answer_body_too_slow(http_app),
                       min_body_bytes_per_s=settings.connections.min_body_bytes_per_s,
                       body_grace_s=settings.connections.body_grace_ms / 1000,
                       over_budget=refuse_body_over_budget(http_app),
                       max_held_bytes=settings.inputs.max_held_body_bytes,
                       small_body_bytes=settings.inputs.max_body_bytes + MULTIPART_OVERHEAD_BYTES,
                       gone=log_client_gone, heap_trim=self.heap_trim)
        self.heap_trim.start()
        metrics.init_api_series()
        self.lifecycle = Lifecycle()
        self.shadow = None if not settings.shadow.model else ShadowMirror(
            model_endpoint(settings.shadow.model, self.shadow_runner), settings.shadow.rate,
            settings.shadow.deadline_ms, settings.shadow.max_inflight,
            models_busy(self.pipeline.primary, self.pipeline.fallback),
            getattr(self.shadow_runner, "is_ready", None))
        attach(http_app, pipeline=self.pipeline, lifecycle=self.lifecycle, loop_lag_ms=self.loop_lag_ms,
               runner_stats=self.stats_of_runner, shadow=self.shadow)
        self._runners_watch: asyncio.Task | None = None
        # Move everything built at start-up out of the garbage collector's reach, so
        # collections under load scan only request-time objects (Python gc.freeze docs).
        gc.collect()
        gc.freeze()

    @bentoml.api(route=CLASSIFY_API_ROUTE, input_spec=ImageUpload)
    @documented(CLASSIFY_DOC)
    async def classify(self, image: Request, top_k: int = 5) -> ClassifyAnswer:
        # ``image`` is the whole Starlette request (``ImageUpload``); /classify's own route reads it,
        # ``top_k`` included (a multipart field or the query): the default BentoML passes here is unused.
        return await classify_endpoint(http_app)(image)

    @bentoml.api(route=CLASSIFY_BATCH_API_ROUTE, input_spec=BatchUpload)
    @documented(CLASSIFY_BATCH_DOC)
    async def classify_batch(self, images: Request, top_k: int = 5) -> BatchAnswer:
        # ``images`` is the whole Starlette request (``BatchUpload``); /classify_batch's own route reads it,
        # ``top_k`` included, as for ``classify``.
        return await classify_batch_endpoint(http_app)(images)

    def seconds_per_image(self, role: str) -> float | None:
        """The ``primary`` or ``fallback`` model's measured compute per image for this worker, s
        (``AdmissionGate.compute_s_per_image``); None before any measurement."""
        return getattr(self.pipeline, role).gate.compute_s_per_image or None

    def loop_lag_ms(self) -> float:
        """The event loop's recent lag (ms), kept back from each new deadline; starts the monitor. Also
        puts the collector's pauses since the last call in ``rampart_gc_pause_seconds``."""
        self.loop_lag.ensure_started()
        lag_ms = self.loop_lag.recent_ms
        metrics.LOOP_LAG.set(lag_ms / 1000.0)
        for generation, pause_s in self.loop_lag.take_pauses():
            metrics.GC_PAUSE.labels(str(generation)).observe(pause_s)
        return lag_ms

    async def stats_of_runner(self, role: str) -> dict | None:
        """The ``primary`` or ``fallback`` runner's counters (``runner_stats``), for ``GET /stats``."""
        return await runner_stats(self.primary if role == "primary" else self.fallback)

    async def __is_ready__(self) -> bool:
        """``/readyz``: 200 once both runners have warmed up and every API worker is ready, 503 again from
        SIGTERM on (the drain)."""
        return state_of(http_app).ready() and all_entry_workers_ready(settings.api_workers)

    @bentoml.on_startup
    async def start_lifecycle(self) -> None:
        """Watch the runners until both are warm, and take over SIGTERM for a graceful drain."""
        intercept_exit_signals(self.drain)
        self._runners_watch = asyncio.create_task(self.wait_for_runners())

    async def wait_for_runners(self, poll_s: float = 0.25) -> None:
        """Poll both runners' ``/readyz`` until both are warm; then seed the throughput meters with their
        warm-up speed, admit requests, and log how long start-up took."""
        checks = [getattr(runner, "is_ready", None) for runner in (self.primary, self.fallback)]
        while True:
            try:
                # Our own timeout, shorter than httpx's, so a runner still warming up logs no warning.
                ready = [await asyncio.wait_for(check(5), 1.0) if check else True for check in checks]
            except Exception:  # a runner still starting refuses or holds the connection
                ready = [False]
            if all(ready):
                break
            await asyncio.sleep(poll_s)
        warmup = {}
        for role, lane, runner in (("primary", self.pipeline.primary, self.primary),
                                   ("fallback", self.pipeline.fallback, self.fallback)):
            counters = await runner_stats(runner)
            if counters:
                lane.seed(counters)
                warmup[role] = counters.get("warmup_s", 0.0)
        await self.pipeline.warm_up_decoders()
        self.lifecycle.mark_ready()
        mark_worker_ready()  # for the other API workers' /readyz (all_entry_workers_ready)
        since_start_s = time.time() - psutil.Process().create_time()
        lifecycle_log.info("Rampart ready: both runners warm %.1f s after this worker started (warm-up: %s)",
                    since_start_s, ", ".join(f"{role} {s:.1f} s" for role, s in warmup.items()) or "in-process")

    async def drain(self, signum: int) -> None:
        """On SIGTERM: refuse new requests (503) and wait for the admitted ones, at most ``max_deadline_ms``."""
        self.lifecycle.begin_drain()
        mark_worker_ready(False)
        started = time.monotonic()
        lifecycle_log.info("signal %d: draining %d request(s) in flight, refusing new ones (at most %d ms)",
                    signum, self.lifecycle.in_flight, settings.deadlines.max_deadline_ms)
        if await self.lifecycle.drained(settings.deadlines.max_deadline_ms / 1000):
            lifecycle_log.info("drained in %.1f s; stopping", time.monotonic() - started)
        else:
            lifecycle_log.warning("%d request(s) still in flight after %d ms; stopping anyway",
                           self.lifecycle.in_flight, settings.deadlines.max_deadline_ms)


# A storm of /metrics scrapes costs one merge of the metric files per interval (rampart.telemetry.scrapes); inside
# BentoML's own middlewares, so every scrape is still counted and traced as before.
Rampart.add_asgi_middleware(CoalescedMetrics, interval_s=settings.telemetry.metrics_render_interval_ms / 1000)
Rampart.add_asgi_middleware(JSONRouteErrors, answered=route_error_answered)  # JSON 404/405: see rampart.api.routing
Rampart.add_asgi_middleware(RefusePickleBodies, answered=route_error_answered)  # see rampart.api.bentoml_api
