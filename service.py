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
- ``/v2/...``: the Open Inference Protocol (KServe v2 / Triton HTTP), ``rampart.oip``.
- ``POST /bentoml/classify``: ``/classify`` as a BentoML API, for ``bentoml.SyncHTTPClient``
  and ``/docs`` (``rampart.bentoml_api``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import bentoml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rampart import http, metrics, oip
from rampart.accesslog import log_request, server_timing
from rampart.bentoml_api import CLASSIFY_API_ROUTE, CLASSIFY_DOC, ClassifyAnswer, ImageUpload, documented
from rampart.bentoml_fixes import cancel_request_timers
from rampart.buckets import buckets_for_resolution
from rampart.config import get_settings
from rampart.errors import InternalError, InvalidParameter, RampartError
from rampart.looplag import LoopLagMonitor
from rampart.pipeline import Classifier, ModelEndpoint, RunnerAnswer
from rampart.pool import BoundedPool
from runners.common import RunnerItem
from runners.fallback import Fallback
from runners.primary import Primary

logger = logging.getLogger("rampart.service")
settings = get_settings()
cancel_request_timers()  # BentoML 1.4.29 keeps every request alive for traffic.timeout: see the module


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
        Route("/classify", classify, methods=["POST"]),
        Route("/classify_batch", classify_batch, methods=["POST"]),
        Route("/stats", stats, methods=["GET"]),
        *oip.routes(settings, service, finished),
    ]
)


@bentoml.service(name="rampart", workers=1, traffic={"timeout": settings.max_deadline_ms / 1000 + 10})
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
        self._ready = False
        # Move everything built at start-up out of the garbage collector's reach, so
        # collections under load scan only request-time objects (Python gc.freeze docs).
        gc.collect()
        gc.freeze()

    @bentoml.api(route=CLASSIFY_API_ROUTE, input_spec=ImageUpload)
    @documented(CLASSIFY_DOC)
    async def classify(self, image: Request) -> ClassifyAnswer:
        # ``image`` is the whole Starlette request (``ImageUpload``); the module-level /classify handler reads it.
        return await classify(image)

    def loop_lag_ms(self) -> float:
        """The event loop's recent lag (ms), kept back from each new deadline; starts the monitor."""
        self.loop_lag.ensure_started()
        lag_ms = self.loop_lag.recent_ms
        metrics.LOOP_LAG.set(lag_ms / 1000.0)
        return lag_ms

    async def __is_ready__(self) -> bool:
        """Ready once both runners have finished warm-up; their warm-up speed seeds the throughput meters."""
        if not self._ready:
            checks = [getattr(runner, "is_ready", None) for runner in (self.primary, self.fallback)]
            try:
                self._ready = all([await check() if check else True for check in checks])
            except Exception as exc:  # a runner still starting refuses connections
                logger.info("runners not ready yet: %s", exc)
            if self._ready:
                for lane, runner in ((self.classifier.primary, self.primary), (self.classifier.fallback, self.fallback)):
                    counters = await runner_stats(runner)
                    if counters:
                        lane.gate.meter.seed(counters["warmup_ms_per_image"])
        return self._ready
