"""Rampart's entry service: the HTTP API in front of the two runners.

``bentoml serve`` starts this service plus one process per runner
(``runners.primary.Primary``, ``runners.fallback.Fallback``), wired in with
``bentoml.depends``. The HTTP routes are a small Starlette app mounted on the
service, so Rampart controls body reading (byte cap while streaming), error
bodies and status codes exactly; BentoML's own ``/readyz``, ``/livez`` and
``/metrics`` stay as they are. The pipeline itself is ``rampart.pipeline``.

Routes:
- ``POST /classify``: a raw image body or multipart field ``image``.
- ``POST /classify_batch``: multipart, field ``images`` repeated.

Lifecycle (``rampart.lifecycle``): both routes answer 503 ``not_ready`` until both
runners have warmed up, and 503 ``shutting_down`` once SIGTERM has arrived; the
requests admitted before it are answered before the worker exits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import bentoml
import psutil
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rampart import http, metrics
from rampart.accesslog import log_request, server_timing
from rampart.bentoml_fixes import cancel_request_timers, keep_runner_sockets_until_stopped
from rampart.buckets import buckets_for_resolution
from rampart.config import get_settings
from rampart.errors import InternalError, InvalidParameter, RampartError, Unavailable
from rampart.lifecycle import ENTRY_SERVICE_NAME, Lifecycle, intercept_exit_signals
from rampart.lifecycle import logger as lifecycle_log
from rampart.looplag import LoopLagMonitor
from rampart.pipeline import Classifier, ModelEndpoint, RunnerAnswer
from rampart.pool import BoundedPool
from runners.common import RunnerItem
from runners.fallback import Fallback
from runners.primary import Primary

logger = logging.getLogger("rampart.service")
settings = get_settings()
cancel_request_timers()  # BentoML 1.4.29 keeps every request alive for traffic.timeout: see the module
keep_runner_sockets_until_stopped()  # ... and deletes the runners' sockets at SIGTERM, before the drain


def model_endpoint(tag: str, runner) -> ModelEndpoint:
    """A ``ModelEndpoint`` for the runner dependency ``runner`` serving model ``tag``.

    ``runner`` is a BentoML remote proxy under ``bentoml serve``, or the runner
    instance itself when the service is built in-process.
    """
    stored = bentoml.models.get(tag)
    meta = stored.info.metadata
    remote = getattr(runner, "to_async", None)

    async def call(bucket_name: str, pixels, deadline: float) -> RunnerAnswer:
        items = [RunnerItem(pixels=pixels, deadline=deadline)]
        if remote is not None:
            (result,) = await getattr(remote, bucket_name)(items)
        else:
            (result,) = await asyncio.to_thread(getattr(runner, bucket_name), items)
        return RunnerAnswer(
            probs=None if result.expired else result.probs,
            inference_ms=result.inference_ms,
            batch_size=result.batch_size,
        )

    return ModelEndpoint(
        name=stored.tag.name,
        version=stored.tag.version,
        labels=list(meta["labels"]),
        buckets=buckets_for_resolution(int(meta["resolution"])),
        call=call,
    )


async def classify(request: Request) -> JSONResponse:
    """``POST /classify``: one image, raw body (format sniffed) or multipart field ``image``."""
    started, request_id, high = time.perf_counter(), http.request_id_of(request), False
    try:
        top_k = http.parse_top_k(request)
        deadline = http.parse_deadline(request, settings, service().loop_lag_ms())
        high = http.parse_priority(request)
        classifier = service().classifier
        classifier.check_capacity(deadline, high)  # sheds (429) before the body is read
        if http.is_multipart(request):
            body = await http.read_body(request, settings.max_body_bytes + http.MULTIPART_OVERHEAD_BYTES, deadline)
            files = http.multipart_files(request, body, "image")
            if len(files) > 1:
                raise InvalidParameter("send one part named 'image'; use /classify_batch for several")
            data = files[0][1]
        else:
            data = await http.read_body(request, settings.max_body_bytes, deadline)
        result = await classifier.classify(data, top_k, deadline, high)
    except Exception as exc:
        return failed(request, request_id, high, started, exc)
    response = JSONResponse({"request_id": request_id, **result},
                            headers={"X-Request-Id": request_id, "Server-Timing": server_timing(result["timings_ms"])})
    finished(request, request_id, high, started, 200, "ok", result)
    return response


async def classify_batch(request: Request) -> JSONResponse:
    """``POST /classify_batch``: multipart field ``images`` repeated; one entry per image, in order."""
    started, request_id, high = time.perf_counter(), http.request_id_of(request), False
    try:
        top_k = http.parse_top_k(request)
        deadline = http.parse_deadline(request, settings, service().loop_lag_ms())
        high = http.parse_priority(request)
        if not http.is_multipart(request):
            raise InvalidParameter("send multipart/form-data with one or more parts named 'images'")
        limit = settings.max_batch_images * (settings.max_body_bytes + http.MULTIPART_OVERHEAD_BYTES)
        service().classifier.check_capacity(deadline, high)
        body = await http.read_body(request, limit, deadline)
        files = http.multipart_files(request, body, "images")
        if len(files) > settings.max_batch_images:
            raise InvalidParameter(f"{len(files)} images sent; the limit is {settings.max_batch_images}")
    except Exception as exc:
        return failed(request, request_id, high, started, exc)
    classifier = service().classifier

    async def one(index: int, filename: str, data: bytes) -> dict:
        entry = {"index": index, "filename": filename}
        try:
            return {**entry, **(await classifier.classify(data, top_k, deadline, high))}
        except RampartError as error:
            return {**entry, **error.to_body(request_id)}
        except Exception:
            logger.exception("unexpected failure for image %d of request %s", index, request_id)
            return {**entry, **InternalError("an unexpected error occurred").to_body(request_id)}

    results = await asyncio.gather(*(one(i, name, data) for i, (name, data) in enumerate(files)))
    finished(request, request_id, high, started, 200, "ok", images=len(results))
    return JSONResponse({"request_id": request_id, "results": results}, headers={"X-Request-Id": request_id})


def admitted(endpoint):
    """The route ``endpoint``, refused with 503 before warm-up and during the drain, and counted in
    flight otherwise (``rampart.lifecycle.Lifecycle.admit``): a drain waits for every request it let in."""

    async def route(request: Request):
        try:
            admission = service().lifecycle.admit()
        except Unavailable as exc:
            return failed(request, http.request_id_of(request), False, time.perf_counter(), exc)
        with admission:
            return await endpoint(request)

    route.__name__, route.__doc__ = endpoint.__name__, endpoint.__doc__
    return route


def failed(request: Request, request_id: str, high: bool, started: float, exc: Exception) -> JSONResponse:
    """The error response for ``exc`` (a ``RampartError``, else a logged 500), accounted and logged."""
    if not isinstance(exc, RampartError):
        logger.exception("unexpected failure for request %s", request_id, exc_info=exc)
        exc = InternalError("an unexpected error occurred; see the server log")
    finished(request, request_id, high, started, exc.status, exc.code)
    return http.error_response(exc, request_id)


def finished(request: Request, request_id: str, high: bool, started: float, status: int, code: str,
             result: dict | None = None, **extra: object) -> None:
    """Count the answer (``rampart_responses_total``) and write its access-log line."""
    metrics.RESPONSES.labels(str(status), code).inc()
    metrics.update_process_rss("api")
    log_request(request_id, request.url.path, status, code, high, (time.perf_counter() - started) * 1000.0,
                result, **extra)


async def stats(request: Request) -> JSONResponse:
    """``GET /stats``: admission queues, measured throughput, breaker state, runner counters."""
    rampart = service()
    body = rampart.classifier.state()
    body["lifecycle"] = {"state": rampart.lifecycle.state, "in_flight": rampart.lifecycle.in_flight}
    for role, runner in (("primary", rampart.primary), ("fallback", rampart.fallback)):
        body[role]["runner"] = await runner_stats(runner)
    return JSONResponse(body)


async def runner_stats(runner) -> dict | None:
    """A runner's ``stats`` API (warm-up speed, TTL drops), or None while it cannot answer."""
    try:
        remote = getattr(runner, "to_async", None)
        return await remote.stats() if remote is not None else await runner.stats()
    except Exception as exc:
        logger.info("runner stats unavailable: %s", exc)
        return None


def service() -> "Rampart":
    """The running ``Rampart`` instance of this worker."""
    return bentoml.get_current_service()


http_app = Starlette(
    routes=[
        Route("/classify", admitted(classify), methods=["POST"]),
        Route("/classify_batch", admitted(classify_batch), methods=["POST"]),
        Route("/stats", stats, methods=["GET"]),
    ]
)


@bentoml.service(name=ENTRY_SERVICE_NAME, workers=1, traffic={"timeout": settings.max_deadline_ms / 1000 + 10})
@bentoml.asgi_app(http_app, path="/")
class Rampart:
    """Image classification that degrades honestly under overload; see README."""

    primary = bentoml.depends(Primary)
    fallback = bentoml.depends(Fallback)

    def __init__(self) -> None:
        self.classifier = Classifier(
            settings,
            model_endpoint(settings.primary_model, self.primary),
            model_endpoint(settings.fallback_model, self.fallback),
            BoundedPool(settings.decode_workers, settings.decode_queue, nice=settings.decode_nice),
        )
        self.loop_lag = LoopLagMonitor()
        metrics.init_api_series()
        self.lifecycle = Lifecycle()
        self._runners_watch: asyncio.Task | None = None
        # Move everything built at start-up out of the garbage collector's reach, so
        # collections under load scan only request-time objects (Python gc.freeze docs).
        gc.collect()
        gc.freeze()

    def loop_lag_ms(self) -> float:
        """The event loop's recent lag (ms), kept back from each new deadline; starts the monitor."""
        self.loop_lag.ensure_started()
        lag_ms = self.loop_lag.recent_ms
        metrics.LOOP_LAG.set(lag_ms / 1000.0)
        return lag_ms

    async def __is_ready__(self) -> bool:
        """``/readyz``: 200 once both runners have warmed up, 503 again from SIGTERM on (the drain)."""
        return self.lifecycle.ready and not self.lifecycle.draining

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
        for role, lane, runner in (("primary", self.classifier.primary, self.primary),
                                   ("fallback", self.classifier.fallback, self.fallback)):
            counters = await runner_stats(runner)
            if counters:
                lane.gate.meter.seed(counters["warmup_ms_per_image"])
                warmup[role] = counters.get("warmup_s", 0.0)
        self.lifecycle.mark_ready()
        since_start_s = time.time() - psutil.Process().create_time()
        lifecycle_log.info("Rampart ready: both runners warm %.1f s after this worker started (warm-up: %s)",
                    since_start_s, ", ".join(f"{role} {s:.1f} s" for role, s in warmup.items()) or "in-process")

    async def drain(self, signum: int) -> None:
        """On SIGTERM: refuse new requests (503) and wait for the admitted ones, at most ``max_deadline_ms``."""
        self.lifecycle.begin_drain()
        started = time.monotonic()
        lifecycle_log.info("signal %d: draining %d request(s) in flight, refusing new ones (at most %d ms)",
                    signum, self.lifecycle.in_flight, settings.max_deadline_ms)
        if await self.lifecycle.drained(settings.max_deadline_ms / 1000):
            lifecycle_log.info("drained in %.1f s; stopping", time.monotonic() - started)
        else:
            lifecycle_log.warning("%d request(s) still in flight after %d ms; stopping anyway",
                           self.lifecycle.in_flight, settings.max_deadline_ms)
