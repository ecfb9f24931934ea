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
- any other path or method: JSON 404/405 (``rampart.routing.JSONRouteErrors``).
- ``/v2/...``: the Open Inference Protocol (KServe v2 / Triton HTTP), ``rampart.oip``.
- ``POST /bentoml/classify``: ``/classify`` as a BentoML API, for ``bentoml.SyncHTTPClient``
  and ``/docs`` (``rampart.bentoml_api``).

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

from rampart import http, metrics, oip
from rampart.accesslog import log_request, server_timing
from rampart.arrival import bound_inflight, stamp_arrivals
from rampart.bentoml_api import CLASSIFY_API_ROUTE, CLASSIFY_DOC, ClassifyAnswer, ImageUpload, documented
from rampart.bentoml_fixes import bound_endpoint_labels, cancel_request_timers, keep_runner_sockets_until_stopped
from rampart.buckets import buckets_for_resolution
from rampart.config import get_settings
from rampart.errors import InternalError, InvalidParameter, Overloaded, RampartError, Unavailable
from rampart.headlimit import limit_request_heads
from rampart.lifecycle import ENTRY_SERVICE_NAME, Lifecycle, intercept_exit_signals
from rampart.lifecycle import logger as lifecycle_log
from rampart.looplag import LoopLagMonitor
from rampart.pipeline import Classifier, ModelEndpoint, RunnerAnswer, decode_pool
from rampart.routing import JSONRouteErrors
from rampart.shadow import ShadowMirror, models_busy
from runners.common import RunnerItem
from runners.fallback import Fallback
from runners.primary import Primary
from runners.shadow import Shadow

logger = logging.getLogger("rampart.service")
settings = get_settings()
cancel_request_timers()  # BentoML 1.4.29 keeps every request alive for traffic.timeout: see the module
stamp_arrivals()  # deadlines count from each request's first byte: see rampart.arrival
bound_endpoint_labels()  # BentoML labels its traffic metrics with the raw path: see the module
limit_request_heads()  # uvicorn's httptools protocol accepts request heads of any size: see the module
keep_runner_sockets_until_stopped()  # BentoML's arbiter deletes the runners' sockets at SIGTERM, before the drain


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
            ((_, data),) = await http.read_multipart(request, "image", 1, settings.max_body_bytes, deadline)
        else:
            data = await http.read_body(request, settings.max_body_bytes, deadline)
        result = await classifier.classify(data, top_k, deadline, high)
    except Exception as exc:
        return failed(request, request_id, high, started, exc)
    result["timings_ms"] = {"before_handler": round(deadline.before_handler_ms(), 3), **result["timings_ms"]}
    response = JSONResponse({"request_id": request_id, **result},
                            headers={"X-Request-Id": request_id, "Server-Timing": server_timing(result["timings_ms"])})
    finished(request, request_id, high, started, 200, "ok", result)
    if service().shadow is not None:  # mirrors after the answer is sent: see rampart.shadow
        response.background = service().shadow.background(request_id, result)
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
        service().classifier.check_capacity(deadline, high)
        files = await http.read_multipart(request, "images", settings.max_batch_images, settings.max_body_bytes,
                                          deadline)
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
    timings = batch_timings_ms(results, (time.perf_counter() - started) * 1000.0)
    warnings = sorted({warning for result in results for warning in result.get("input_warnings", ())})
    finished(request, request_id, high, started, 200, "ok", images=len(results), input_warnings=warnings)
    return JSONResponse({"request_id": request_id, "results": results},
                        headers={"X-Request-Id": request_id, "Server-Timing": server_timing(timings)})


def batch_timings_ms(results: list[dict], total_ms: float) -> dict[str, float]:
    """A batch's stage timings (ms): per stage the longest over its answered images, and the whole request's total.

    The images run concurrently, so the longest of each stage is the one that shaped the answer time.
    """
    answered = [entry["timings_ms"] for entry in results if "timings_ms" in entry]
    stages = {stage: max(t[stage] for t in answered) for stage in ("decode", "queue", "inference")} if answered else {}
    return {**stages, "total": round(total_ms, 1)}


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


def route_error_answered(request: Request, request_id: str, started: float, error: RampartError) -> None:
    """Account and log a 404/405 answered by ``JSONRouteErrors``."""
    finished(request, request_id, False, started, error.status, error.code)


def finished(request: Request, request_id: str, high: bool, started: float, status: int, code: str,
             result: dict | None = None, **extra: object) -> None:
    """Count the answer (``rampart_responses_total``) and write its access-log line."""
    metrics.RESPONSES.labels(str(status), code).inc()
    if status == 429 and service().shadow is not None:  # overload pauses shadow traffic: see rampart.shadow
        service().shadow.note_overload()
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
    body["shadow"] = None if rampart.shadow is None else rampart.shadow.state()
    return JSONResponse(body)


async def runner_stats(runner) -> dict | None:
    """A runner's ``stats`` API (warm-up speed, TTL drops), or None while it cannot answer."""
    try:
        remote = getattr(runner, "to_async", None)
        return await remote.stats() if remote is not None else await runner.stats()
    except Exception as exc:
        logger.info("runner stats unavailable: %s", exc)
        return None


async def refuse_before_admission(scope, receive, send) -> None:
    """429 ``overloaded`` for a request over the in-flight bound (see ``rampart.arrival``), before any middleware."""
    request = Request(scope, receive)
    request_id = http.request_id_of(request)
    error = Overloaded("too many requests in flight; retry later", service().classifier.retry_after_s())
    response = failed(request, request_id, False, time.perf_counter(), error)
    await response(scope, receive, send)


def service() -> "Rampart":
    """The running ``Rampart`` instance of this worker."""
    return bentoml.get_current_service()


classify_route = admitted(classify)

http_app = Starlette(
    routes=[
        Route("/classify", classify_route, methods=["POST"]),
        Route("/classify_batch", admitted(classify_batch), methods=["POST"]),
        Route("/stats", stats, methods=["GET"]),
        *oip.routes(settings, service, finished),
    ]
)


#: Routes whose requests go through admission (``rampart.arrival.bound_inflight``, tracing off by default).
ADMITTED_ROUTES = ("/classify", "/classify_batch", f"/v2/models/{oip.MODEL_NAME}/infer", CLASSIFY_API_ROUTE)


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
        (settings.primary_concurrent_batches, settings.primary_max_batch_size),
        (settings.fallback_concurrent_batches, settings.fallback_max_batch_size)))
    return max(65, 2 * places)


def middleware_config() -> dict:
    """BentoML service configuration for its per-request middlewares (reasons: README, "Overload control").

    BentoML's access log is off (Rampart writes its own JSON line per request);
    tracing skips the admitted routes unless ``trace_requests``.
    """
    config: dict = {"logging": {"access": {"enabled": False}}}
    if not settings.trace_requests:
        config["tracing"] = {"excluded_urls": list(ADMITTED_ROUTES)}
    return config


@bentoml.service(name=ENTRY_SERVICE_NAME, workers=1, traffic={"timeout": settings.max_deadline_ms / 1000 + 10},
                 backlog=accept_backlog(), **middleware_config())
@bentoml.asgi_app(http_app, path="/")
class Rampart:
    """Image classification that degrades honestly under overload; see README."""

    primary = bentoml.depends(Primary)
    fallback = bentoml.depends(Fallback)
    if settings.shadow_model:  # a third runner only when shadow traffic is on (README, "Shadow traffic")
        shadow_runner = bentoml.depends(Shadow)

    def __init__(self) -> None:
        self.classifier = Classifier(
            settings,
            model_endpoint(settings.primary_model, self.primary),
            model_endpoint(settings.fallback_model, self.fallback),
            decode_pool(settings),
        )
        self.shadow = None if not settings.shadow_model else ShadowMirror(
            model_endpoint(settings.shadow_model, self.shadow_runner), settings.shadow_rate,
            settings.shadow_deadline_ms, settings.shadow_max_inflight,
            models_busy(self.classifier.primary, self.classifier.fallback),
            getattr(self.shadow_runner, "is_ready", None))
        self.loop_lag = LoopLagMonitor()
        bound_inflight(self.classifier.inflight_limit, refuse_before_admission, ADMITTED_ROUTES)
        metrics.init_api_series()
        self.lifecycle = Lifecycle()
        self._runners_watch: asyncio.Task | None = None
        # Move everything built at start-up out of the garbage collector's reach, so
        # collections under load scan only request-time objects (Python gc.freeze docs).
        gc.collect()
        gc.freeze()

    @bentoml.api(route=CLASSIFY_API_ROUTE, input_spec=ImageUpload)
    @documented(CLASSIFY_DOC)
    async def classify(self, image: Request) -> ClassifyAnswer:
        # ``image`` is the whole Starlette request (``ImageUpload``); /classify's own route reads it.
        return await classify_route(image)

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
        await self.classifier.warm_up_decoders()
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


Rampart.add_asgi_middleware(JSONRouteErrors, answered=route_error_answered)  # JSON 404/405: see rampart.routing
