"""The request pipeline: decode → primary → fallback → cache → static answer, within one deadline.

``Pipeline.classify`` is plain asyncio. It talks to the models through
``ModelEndpoint.call`` coroutines, so the same code runs against BentoML runner
proxies in the service and against stand-ins in unit tests. Each model is a
``rampart.lane.ModelLane`` (endpoint, admission gate, breaker). A request is
checked against both lanes before its body is read (``check_capacity``: 429
when neither has room, no place taken) and takes its place once the body is in
(``classify`` → ``admit``). The deadline (``X-Deadline-Ms``, a
``rampart.overload.deadline.Deadline`` that carries its slices) covers everything:

- decoding and resizing run on a ``BoundedPool`` of worker processes
  (``rampart.inputs.decode_job.prepare``: bytes in, the base model's bucket array out;
  the other model's input is made from it only when that model is called): 429
  when it is full or no decoder frees up before the deadline, 422
  ``decode_timeout`` when one decode runs past ``decode_timeout_ms`` (its worker
  is killed and replaced, so the slot is free at once);
- the primary is skipped while its circuit breaker is open (``primary_circuit_open``)
  or when its admission gate sheds the request (``primary_overloaded``); otherwise
  it gets its share (``Share.PRIMARY``: the deadline minus ``fallback_reserve_ms``
  and the answer margin), and an error, a timeout or a runner TTL drop hands the
  request on (``primary_error`` / ``primary_timeout``);
- the fallback gets what is left of the deadline, behind its own gate;
- if the fallback cannot answer either, an earlier answer for the same bytes is
  used (``cached_result``), else the static default: no labels,
  ``no_model_available`` and ``needs_review`` true. If both gates shed the request
  and nothing is cached, the answer is 429 ``overloaded`` with ``Retry-After``.

With ``routing="cascade"`` (docs/overload.md, "Cascade") the order turns round: the fallback
is asked first (admission too: a fallback ticket, else a primary one), and its
answer is kept when its confidence (``cascade_confidence``, ``rampart.results.confidences``)
is at least ``cascade_threshold`` (route ``cascade_confident``). Otherwise the same
decoded image goes to the primary, with the same admission rules as the primary-first
chain and within its ``Share.PRIMARY`` of the same deadline (``cascade_escalated``);
when the primary cannot answer (gate sheds, breaker open, timeout, error) the
fallback's answer is returned, degraded with the primary's reason
(``cascade_not_escalated``). When the fallback cannot answer, the primary is asked
as the first choice (``cascade_fallback_unavailable``: a full answer); if neither
answers, the cache and static answer follow as above. The fallback asked first may
use the whole ``Share.ALL``, so a fallback that hangs leaves the primary no time.

With ``routing.mode="primary-only"`` (an experiment's setting, only with ``RAMPART_EXPERIMENTS=true``: the
ablation, docs/configuration.md, "Experiments") the fallback is never asked: the primary alone, with the whole
deadline (``Share.ALL``, no fallback reserve), then the cache and the static answer; 429 when
the primary shed the request. ``Settings.admission_mode`` (the gates' ``mode``; ``off``
also unbounds the decode queue and the in-flight bound) and ``Settings.honour_deadlines``
(``rampart.overload.deadline.Deadline.sliced``) are the ablation's other switches.

Requests of the ``low`` priority class (``X-Priority: low``, bulk work: the module doc
of ``rampart.overload.admission``, docs/planning.md) are answered by the primary only, with route
``low_priority``: they never take a place with the fallback, in any routing. When the
primary does not answer one (shed, evicted, late, breaker open, error), an earlier
answer for the same bytes is returned (``cached_result``: it costs no model time),
else 429 ``overloaded`` with the primary's own ``Retry-After``; never the static answer.

Every answer body is built by ``Pipeline._body``; model answers carry their
``route`` (``ROUTES``), answers no model gave now carry ``route: null``.
"""

from __future__ import annotations

import asyncio
import collections
import io
import logging
import sys
import time
from dataclasses import dataclass

import numpy as np
from PIL import Image

from rampart.telemetry import metrics
from rampart.overload.admission import HIGH, LOW, AdmissionGate, ThroughputMeter, Ticket, priority_name, priority_rank
from rampart.overload.breaker import CircuitBreaker
from rampart.inputs.buckets import Bucket
from rampart.cache import CachedAnswer, ResultCache
from rampart.config import Settings
from rampart.overload.deadline import Deadline, Share
from rampart.inputs.decode_job import DecodePlan, Prepared, model_input, prepare
from rampart.inputs.decoding import DecodeLimits
from rampart.errors import CorruptImage, DecodeTimeout, ImageError, Overloaded, RequestTimeout
from rampart.lane import Attempt, ModelEndpoint, ModelLane, RunnerResult
from rampart.inputs.pool import BoundedPool, JobTimeout, WorkerDied
from rampart.heap import keep_freed_heap
from rampart.results import MAX_TOP_K, confidences, label_entries, top_classes
from rampart.shadow import AnsweredBody

#: ``RunnerResult`` and ``ModelEndpoint`` live in ``rampart.lane``; they are importable from here too.
__all__ = ["RunnerResult", "ModelEndpoint", "Admission", "Pipeline", "decode_limits", "decode_plan", "decode_pool",
           "ROUTES"]

logger = logging.getLogger("rampart.pipeline")

#: The ``route`` of a model answer: ``primary_first`` (routing ``primary-first``, whichever model answered),
#: else one of the cascade's routes (``rampart.telemetry.metrics.CASCADE_ROUTES``, see the module doc).
ROUTE_PRIMARY_FIRST = "primary_first"
#: The ``route`` of every model answer with routing ``primary-only`` (experiments only).
ROUTE_PRIMARY_ONLY = "primary_only"
#: The ``route`` of every answer to a low-priority request: the primary's, in any routing.
ROUTE_LOW_PRIORITY = "low_priority"
ROUTES = (ROUTE_PRIMARY_FIRST, ROUTE_PRIMARY_ONLY, ROUTE_LOW_PRIORITY, *metrics.CASCADE_ROUTES)
#: Fallback confidences kept for the quantiles in ``/stats`` (``cascade``).
CONFIDENCE_WINDOW = 1000
#: Decode order within a priority (``BoundedPool.run``'s ``rank``): requests holding a place with the
#: routing's first model first, then those admitted by the second one (``Pipeline._prepare``).
DECODE_RANK = {"first": 0, "second": 1}
#: Added to a low-priority request's decode rank: it decodes after every normal one waiting.
LOW_DECODE_RANK = 10
#: A second decode for the fallback after the primary failed (``Pipeline._redecode``) is tried only with
#: at least this much of the deadline left (s: a phone photo decodes in about 8 ms on the 2-core host),
#: and may take this share of what is left; the rest is the fallback's.
REDECODE_MIN_LEFT_S = 0.04
REDECODE_SHARE_OF_LEFT = 0.5


def decode_limits(settings: Settings, buckets: list[Bucket]) -> DecodeLimits:
    """Decode limits from settings. ``min_decoded_side`` (2× the largest bucket side) only serves callers
    of ``decode_image`` without a shrink rule; the pipeline's decode shrinks by ``DecodePlan``'s rule."""
    return DecodeLimits(
        max_body_bytes=settings.inputs.max_body_bytes,
        max_pixels=settings.inputs.max_pixels,
        min_side_px=settings.inputs.min_side_px,
        max_aspect_ratio=settings.inputs.max_aspect_ratio,
        max_frames=settings.inputs.max_frames,
        min_decoded_side=2 * max(max(b.height, b.width) for b in buckets),
        alpha_background=settings.inputs.alpha_background,
        max_jpeg_scans=settings.inputs.max_jpeg_scans,
        max_chunks=settings.inputs.max_chunks,
        png_decoder=settings.decoding.png_decoder,
    )


def decode_plan(settings: Settings, buckets: dict[str, dict[str, Bucket]]) -> DecodePlan:
    """The ``DecodePlan`` the service decodes with, for models whose buckets by role are ``buckets``:
    ``decode_limits`` over all of them, ``crop_margin``, ``decode_oversample`` and the decode-hang fault."""
    every = [bucket for role in buckets.values() for bucket in role.values()]
    return DecodePlan(decode_limits(settings, every), buckets, settings.inputs.crop_margin, settings.faults.decode_hang,
                      settings.faults.file, settings.decoding.oversample)


def decode_pool(settings: Settings) -> BoundedPool:
    """This API worker's decode pool: ``decode_mode`` processes (forkserver preloaded with the decode
    code) or threads, ``Settings.decode_workers_per_api_worker`` of them at ``decode_nice``, each process
    keeping ``decode_heap_keep_mib`` of freed heap (``rampart.heap.keep_freed_heap``), and a wait
    queue of ``decode_queue`` uploads (unbounded with ``admission`` ``off``, an experiment's setting)."""
    queue = sys.maxsize if settings.admission_mode == "off" else settings.decoding.queue
    return BoundedPool(settings.decode_workers_per_api_worker, queue, nice=settings.decoding.nice,
                       processes=settings.decoding.mode == "processes", preload=("rampart.inputs.decode_job",),
                       process_setup=(keep_freed_heap, (settings.decoding.heap_keep_mib << 20,)))


@dataclass(frozen=True)
class Upload:
    """A request's upload as the pipeline keeps it after the decode: the ``data`` (bytes) and how long
    its first decode took, ``decode_s`` (wall seconds, queue wait included)."""

    data: bytes
    decode_s: float


@dataclass
class Admission:
    """The place a request took once its body was in (``Pipeline.admit``): a ticket with the routing's
    first model (``primary``, or ``fallback`` in cascade mode), or else one with the other model plus the
    first model's refusal ``refused``. A ticket reserved later, for the second model, is kept here too."""

    primary: Ticket | None = None
    fallback: Ticket | None = None
    refused: Attempt | None = None


class Pipeline:
    """The request pipeline (decode, admission, primary, fallback, cache): classifies one upload
    within its deadline, degrading honestly; see the module doc.

    The deadline's slices come with each ``Deadline`` (``rampart.api.http.parse_deadline``
    cuts them from the settings with ``Deadline.sliced``); the pipeline cuts none:
    the primary's lane spends ``Share.PRIMARY``, the fallback's and decoding ``Share.ALL``.
    """

    def __init__(self, settings: Settings, primary: ModelEndpoint, fallback: ModelEndpoint, pool: BoundedPool) -> None:
        self.settings = settings
        self.pool = pool
        tau_s = settings.admission.throughput_tau_ms / 1000
        workers = settings.api_workers  # each API worker's gates get 1/workers of each runner (admission module doc)
        self.primary = ModelLane("primary", primary, AdmissionGate(
            primary.name, settings.primary.max_batch_size, settings.primary.concurrent_batches,
            settings.primary.queue_delay_ms, ThroughputMeter(settings.primary.throughput_ips, tau_s, share=1 / workers),
            workers=workers, mode=settings.admission_mode, prediction=settings.admission.prediction,
            riders_ahead=settings.runners.low_priority_riders_ahead, low_arrival=settings.admission.low_priority_arrival,
        ), CircuitBreaker(
            window_s=settings.breaker.window_ms / 1000, min_calls=settings.breaker.min_calls,
            failure_rate=settings.breaker.failure_rate, open_s=settings.breaker.open_ms / 1000,
            probes=settings.breaker.probes,
        ), Share.ALL if settings.routing.mode == "primary-only" else Share.PRIMARY)
        self.fallback = ModelLane("fallback", fallback, AdmissionGate(
            fallback.name, settings.fallback.max_batch_size, settings.fallback.concurrent_batches,
            settings.fallback.queue_delay_ms, ThroughputMeter(settings.fallback.throughput_ips, tau_s, share=1 / workers),
            workers=workers, mode=settings.admission_mode, prediction=settings.admission.prediction,
        ), None, Share.ALL)
        self.cascade = settings.routing.mode == "cascade"
        #: The lanes in the order the routing asks them (admission takes a place with the first that has room).
        self.order = ((self.fallback, self.primary) if self.cascade else
                      (self.primary,) if settings.routing.mode == "primary-only" else (self.primary, self.fallback))
        self.routes = dict.fromkeys(ROUTES, 0)  # model answers by route
        self.recent_confidences: collections.deque[float] = collections.deque(maxlen=CONFIDENCE_WINDOW)
        if self.cascade:
            metrics.init_cascade_series()
        self.cache = ResultCache(settings.cache_size)
        self.plan = pool.share(decode_plan(settings, {"primary": primary.buckets, "fallback": fallback.buckets}))
        self.limits = self.plan.limits
        #: Per priority class: its answers by who gave them (``primary``, ``fallback``, ``cache``, ``none``) and
        #: 429s (``shed``), for ``/stats`` (``rampart_priority_outcomes_total`` counts the same).
        self.by_priority = {name: dict.fromkeys(metrics.PRIORITY_OUTCOMES, 0) for name in metrics.PRIORITIES}

    def lanes_for(self, priority: str | bool) -> tuple[ModelLane, ...]:
        """The lanes a request of class ``priority`` may take a place with, in order: the routing's ``order``,
        or the primary alone for ``low``."""
        return (self.primary,) if priority_rank(priority) == LOW else self.order

    def retry_after_s(self, priority: str | bool = "normal") -> float:
        """``Retry-After`` for a 429: when the first of the models ``priority``'s class may use (``lanes_for``:
        the primary alone for ``low``) will have drained its queue.

        Whole seconds, at least 1 and at most that gate's ``retry_after_cap_s`` (see
        ``AdmissionGate.retry_after_s``): a retry is admitted as soon as either
        model has room.
        """
        return min(lane.gate.retry_after_s() for lane in self.lanes_for(priority))

    def inflight_limit(self) -> int:
        """Most ``/classify`` requests one API worker lets in at once (``rampart.api.arrival.bound_inflight``).

        Twice the places the routing's gates have (dispatch window + queue limit of each):
        up to one request per place holds it, and as many again may be reading
        their body (no place held yet) or be on their way out. Any more could only
        be shed by admission, so they are refused before BentoML's middlewares.
        Unbounded (``sys.maxsize``) with ``admission`` ``off``.
        """
        if self.settings.admission_mode == "off":
            return sys.maxsize
        return 2 * sum(lane.gate.window + lane.gate.queue_limit for lane in self.order)

    def check_capacity(self, deadline: Deadline, priority: str | bool) -> None:
        """Raise ``Overloaded`` (429) when neither model would take a request now; takes no place.

        Called before the body is read, so shedding costs next to nothing and a slow
        upload holds no place in any queue; ``admit`` takes the place once the body is
        in (``ModelLane.has_room`` and ``reserve`` decide alike). A deadline already
        used up (by the wait before the handler or the loop lag kept back with the
        margin) is refused the same way, with ``cause`` ``deadline``; but one used up by the client itself,
        whose head alone took longer to arrive than the deadline's usable part (``Arrival.head_ms``), is
        ``RequestTimeout`` (408), as a slow body is.
        """
        if any(lane.has_room(priority, deadline) for lane in self.lanes_for(priority)):
            return
        raise self._refusal(deadline, priority)

    def admit(self, deadline: Deadline, priority: str | bool) -> Admission:
        """Take a place for a request whose body is in: a ticket for the routing's first model (``order``:
        the primary, or the fallback in cascade mode), else one for the other (none with ``primary-only``).

        Raises what ``check_capacity`` raises when no model of the routing can take it (``check_capacity``
        let it in, but the gates filled or the deadline ran out while its body arrived; or, as on the OIP
        route, the body asked for a shorter deadline than the headers).
        """
        refused = None
        for lane in self.lanes_for(priority):
            taken = lane.reserve(priority, deadline)
            if isinstance(taken, Ticket):
                return Admission(**{lane.role: taken}, refused=refused)
            refused = refused or taken
        raise self._refusal(deadline, priority)

    def _refusal(self, deadline: Deadline, priority: str | bool) -> RequestTimeout | Overloaded:
        """Why no model takes a request with ``deadline`` of class ``priority``: ``RequestTimeout`` (408) when the
        deadline is used up and its head alone took that long to arrive (``Arrival.head_ms``: the client's
        sending time), ``Overloaded`` with ``cause`` ``deadline`` when it is used up otherwise (waiting in the
        server), else ``Overloaded`` at capacity (``_at_capacity``)."""
        if deadline.remaining_s() > 0:
            return self._at_capacity(priority)
        head_ms = deadline.arrival.head_ms if deadline.arrival is not None else 0.0
        if head_ms >= deadline.share_ms():
            return RequestTimeout(f"the request head took {head_ms:.0f} ms to arrive, longer than the deadline "
                                  f"({deadline.share_ms():.0f} ms after margins); send the head at once")
        return Overloaded(f"the deadline ({deadline.share_ms():.0f} ms after margins) was used up before work on "
                          "the request could start", self.retry_after_s(priority), cause="deadline")

    def _at_capacity(self, priority: str | bool = "normal") -> Overloaded:
        if priority_rank(priority) == LOW:
            return Overloaded("the primary has no idle capacity for low-priority work; retry later",
                              self.retry_after_s(priority))
        return Overloaded("both models are at capacity; retry later", self.retry_after_s())

    def release(self, admission: Admission) -> None:
        """Give back whatever tickets of ``admission`` were not used."""
        for lane, ticket in ((self.primary, admission.primary), (self.fallback, admission.fallback)):
            if ticket is not None:
                lane.release(ticket)

    async def _prepare(self, data: bytes, deadline: Deadline, priority: str | bool, admission: Admission) -> Prepared:
        """Decode ``data`` on the pool into the base model's input (``rampart.inputs.decode_job.prepare``).

        Within a priority, a request that holds a place with the routing's first model
        decodes before one the first model refused (``DECODE_RANK``): under overload the
        decoders are the shared stage, and the first model, the primary, must not wait
        idle behind uploads that are bound for the fallback anyway. Low-priority
        requests decode after every normal one (``LOW_DECODE_RANK``).

        A decoder killed from outside (SIGKILL: the OOM killer under the pod's memory limit, an operator)
        while it decoded says nothing certain about the upload, so it is decoded once more on another
        worker; killed again, or crashed (a signal such as SIGSEGV, an exit), the upload is taken as
        the cause.

        Raises ``DecodeTimeout`` past ``decode_timeout_ms``, ``JobTimeout`` when the
        deadline ran out first, ``Overloaded`` when no decoder is free in time,
        ``CorruptImage`` when the decoder process died on the input, and the
        decoder's own ``ImageError``.
        """
        first_holds = getattr(admission, self.order[0].role) is not None
        rank = DECODE_RANK["first" if first_holds else "second"]
        klass = priority_rank(priority)
        rank += LOW_DECODE_RANK if klass == LOW else 0
        for attempt in (1, 2):
            try:
                prepared = await self.pool.run(prepare, data, self.plan, self._decode_role(admission),
                                               high=klass == HIGH, rank=rank, budget_s=deadline.remaining_s(),
                                               run_limit_s=self.settings.decoding.timeout_ms / 1000)
                break
            except JobTimeout as exc:
                if exc.by_run_limit:
                    raise DecodeTimeout(f"decoding took longer than {self.settings.decoding.timeout_ms} ms") from None
                raise
            except WorkerDied as exc:  # a decoder crash on this input: the input's fault
                if exc.killed and attempt == 1:
                    logger.warning("a decode worker was killed from outside while it decoded; decoding again")
                    continue
                raise CorruptImage(f"the image could not be decoded: {exc}") from None
        metrics.INPUT_MEGAPIXELS.observe(prepared.declared_size[0] * prepared.declared_size[1] / 1e6)
        return prepared

    def _decode_role(self, admission: Admission) -> str | None:
        """The model whose bucket the decode worker fits (``prepare``'s ``role``).

        The fallback when the request holds a place only with it, having lost its place with
        the primary-first routing's first model: the fallback is then the only model that can
        answer, and its input is made from the decoded frame rather than by resizing the
        primary's array (which changed the fallback's top-1 on a few percent of the
        evaluation images, ``bench.decode_agreement``). Else None, the plan's base role (the
        primary), from whose array ``model_input`` makes the fallback's input if the primary
        then fails. In cascade mode always the base role: the primary may be asked after the
        fallback.
        """
        if self.cascade or len(self.order) < 2 or getattr(admission, self.order[0].role) is not None:
            return None
        second = self.order[1].role
        return second if getattr(admission, second) is not None else None

    async def warm_up_decoders(self) -> None:
        """Decode one generated 640×480 JPEG on every decode worker at once, before the service reports ready.

        A worker's first decode pays one-off costs (codec set-up, lazy imports): about
        0.6 s measured on the 2-core host, which a client's first request would
        otherwise pay inside its deadline. Failures are logged, never raised.
        """
        ramp = np.linspace(0, 255, 640, dtype=np.uint8)
        pixels = np.stack([np.tile(ramp, (480, 1)), np.tile(ramp[::-1], (480, 1)), np.full((480, 640), 128, np.uint8)], -1)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        data = buffer.getvalue()
        jobs = [self.pool.run(prepare, data, self.plan) for _ in range(self.pool.workers)]
        for outcome in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(outcome, BaseException):
                logger.warning("decoder warm-up failed: %s: %s", type(outcome).__name__, outcome)

    async def classify(self, data: bytes, top_k: int, deadline: Deadline, priority: str | bool = "normal") -> dict:
        """The response body for one image (see docs/api.md).

        Takes the request's place (``admit``) now that its body is in. Raises
        ``rampart.errors.ImageError`` for a bad upload (``DecodeTimeout`` when decoding
        runs past ``decode_timeout_ms``) and ``Overloaded`` when no model has room,
        decoding capacity is exhausted, or both models shed the request and nothing is
        cached; model failures never raise. ``priority`` is the request's class
        (``rampart.overload.admission.PRIORITIES``; a bool: True high, False normal).
        """
        name = priority_name(priority)
        try:
            admission = self.admit(deadline, name)
            try:
                result = await self._classify(data, top_k, deadline, name, admission)
            finally:
                self.release(admission)
        except Overloaded:
            self._count(name, "shed")
            raise
        self._observe(result)
        self._count(name, self._answered_by(result))
        return result

    def _count(self, priority: str, outcome: str) -> None:
        self.by_priority[priority][outcome] += 1
        metrics.PRIORITY_OUTCOMES_TOTAL.labels(priority, outcome).inc()

    def _answered_by(self, result: dict) -> str:
        """Who gave ``result``: ``primary``, ``fallback``, ``cache`` or ``none`` (the static answer)."""
        if result["degraded_reason"] == "cached_result":
            return "cache"
        name = (result["model"] or {}).get("name")
        return {self.primary.endpoint.name: "primary", self.fallback.endpoint.name: "fallback"}.get(name, "none")

    def _observe(self, result: dict) -> None:
        """Metrics of one answer: stage durations, degraded reason, route, top-1 class and confidence, input warnings."""
        route = result["route"]
        if route is not None:
            self.routes[route] += 1
            if route in metrics.CASCADE_ROUTES:
                metrics.CASCADE_ROUTES_TOTAL.labels(route).inc()
        role = self._answered_by(result)
        for stage, ms in result["timings_ms"].items():
            metrics.STAGE_SECONDS.labels(role, stage).observe(ms / 1000.0)
        if result["degraded"]:
            metrics.DEGRADED.labels(result["degraded_reason"]).inc()
        for warning in result["input_warnings"]:
            metrics.INPUT_WARNINGS.labels(warning).inc()
        if result["labels"] and role in ("primary", "fallback"):
            metrics.TOP1_CONFIDENCE.labels(role).observe(result["labels"][0]["score"])
            metrics.TOP1_CLASS.labels(role, result["labels"][0]["label"]).inc()

    async def _classify(self, data: bytes, top_k: int, deadline: Deadline, priority: str, admission: Admission) -> dict:
        start = time.perf_counter()
        try:
            prepared = await self._prepare(data, deadline, priority, admission)
        except JobTimeout:
            return self._body("deadline_exceeded", start, _ms_since(start))
        decode_ms = _ms_since(start)

        def answer(lane: ModelLane, attempt: Attempt, reason: str | None, route: str) -> dict:
            return self._model_answer(lane, attempt.answer, prepared, top_k, decode_ms, start, reason, route)

        if priority == "low":  # the primary alone; then only the primary's cached answer, which costs no model time
            first = await self._attempt(self.primary, admission, prepared, deadline, priority)
            if first.answer is not None:
                return answer(self.primary, first, None, ROUTE_LOW_PRIORITY)
            cached = self.cache.get(prepared.key)
            if cached is not None and cached.role == self.primary.role:  # never an answer of the fallback's
                return self._body("cached_result", start, decode_ms, prepared.warnings, cached, top_k)
            if first.reason == f"{self.primary.role}_timeout":  # the deadline ran out, not the room
                raise Overloaded(f"the primary did not answer within the deadline ({deadline.share_ms():.0f} ms after "
                                 "margins), and low-priority work never goes to the fallback; a longer X-Deadline-Ms "
                                 "may be answered", self.retry_after_s(priority), cause="deadline")
            raise self._at_capacity(priority)
        first = await self._attempt(self.order[0], admission, prepared, deadline, priority)
        if self.cascade:
            if first.answer is not None:
                confidence = self.confidence(first.answer.probs)
                if confidence >= self.settings.routing.threshold:
                    return answer(self.fallback, first, None, "cascade_confident")
            second = await self._attempt(self.primary, admission, prepared, deadline, priority)
            if second.answer is not None:
                route = "cascade_fallback_unavailable" if first.answer is None else "cascade_escalated"
                return answer(self.primary, second, None, route)
            if first.answer is not None:
                metrics.FALLBACK.labels(second.reason).inc()
                return answer(self.fallback, first, second.reason, "cascade_not_escalated")
        elif len(self.order) == 1:  # primary-only: no fallback
            if first.answer is not None:
                return answer(self.primary, first, None, ROUTE_PRIMARY_ONLY)
            second = Attempt(None, "fallback_off", shed=True)
        else:
            if first.answer is not None:
                return answer(self.primary, first, None, ROUTE_PRIMARY_FIRST)
            second = await self._attempt(self.fallback, admission, prepared, deadline, priority,
                                         Upload(data, decode_ms / 1000))
            metrics.FALLBACK.labels(first.reason).inc()
            if second.answer is not None:
                return answer(self.fallback, second, first.reason, ROUTE_PRIMARY_FIRST)

        logger.warning("no model answered: %s, then %s", first.reason, second.reason)
        cached = self.cache.get(prepared.key)
        if cached is not None:
            return self._body("cached_result", start, decode_ms, prepared.warnings, cached, top_k)
        if first.shed and second.shed:
            raise self._at_capacity()
        return self._body("no_model_available", start, decode_ms, prepared.warnings)

    async def _attempt(self, lane: ModelLane, admission: Admission, prepared: Prepared, deadline: Deadline,
                       priority: str, upload: Upload | None = None) -> Attempt:
        """``lane``'s try on the decoded request: with the ticket ``admission`` holds for it; else, for the
        routing's second model, with a ticket reserved now (kept in ``admission`` until released); else
        (the first model refused at admission) that refusal. Never raises: failures are ``Attempt``s.

        ``upload``, given for the primary-first routing's fallback after the primary failed: its
        input is then decoded again for it when a decoder is idle (``_redecode``)."""
        ticket = getattr(admission, lane.role)
        if ticket is None:
            if lane is self.order[0]:
                return admission.refused
            reserved = lane.reserve(priority, deadline)
            if isinstance(reserved, Attempt):
                return reserved
            ticket = reserved
            setattr(admission, lane.role, ticket)
        if upload is not None and lane.role not in prepared.inputs:
            await self._redecode(upload, prepared, lane.role, deadline, priority)
        return await lane.attempt(ticket, model_input(prepared, lane.role, lane.endpoint.buckets), deadline)

    async def _redecode(self, upload: Upload, prepared: Prepared, role: str, deadline: Deadline, priority: str) -> None:
        """Decode ``upload`` again for ``role``'s bucket into ``prepared.inputs`` when a decoder is idle now and
        half of what is left of the deadline (at least ``REDECODE_MIN_LEFT_S``) covers twice the first
        decode; else leave it to ``model_input``'s resize of the base array.

        The fallback's input resized from the primary's array changed the fallback's top-1 on 6.5% of
        the evaluation images against 0.3% when decoded for it (``bench.decode_agreement``,
        docs/decoding.md), so after the primary failed the frame is decoded again, but only from an
        idle decoder (never queued behind other uploads under overload) and within half of what is
        left of the deadline. Any failure of that decode (no decoder in time, a slow decode) keeps
        the resize; it never fails the request.
        """
        left_s = deadline.remaining_s()
        budget_s = left_s * REDECODE_SHARE_OF_LEFT
        if self.pool.pending >= self.pool.workers or left_s < REDECODE_MIN_LEFT_S or budget_s < 2 * upload.decode_s:
            return
        try:
            again = await self.pool.run(prepare, upload.data, self.plan, role, high=priority_rank(priority) == HIGH,
                                        rank=DECODE_RANK["second"], budget_s=budget_s)
        except (Overloaded, JobTimeout, WorkerDied, ImageError) as exc:
            logger.debug("no second decode for %s: %s: %s", role, type(exc).__name__, exc)
            return
        prepared.inputs.setdefault(role, again.inputs[role])

    def confidence(self, probs: np.ndarray) -> float:
        """The fallback's confidence in its top-1 class (``cascade_confidence`` of ``rampart.results.confidences``)
        for one float32 (C,) probability vector, in [0, 1]; observed in ``rampart_cascade_confidence`` and ``/stats``."""
        value = float(confidences(probs[np.newaxis, :])[self.settings.routing.confidence][0])
        metrics.CASCADE_CONFIDENCE.observe(value)
        self.recent_confidences.append(value)
        return value

    def _model_answer(self, lane: ModelLane, answer: RunnerResult, prepared: Prepared, top_k: int, decode_ms: float,
                      start: float, reason: str | None, route: str) -> dict:
        """The body for ``lane``'s ``answer``, reached by ``route`` (``ROUTES``); its top classes are cached first.

        An ``AnsweredBody``: a plain ``dict`` to every reader, which also carries the
        decoded inputs and top classes, so shadow traffic can mirror the request.
        """
        indices, scores = top_classes(answer.probs, MAX_TOP_K)
        ranked = CachedAnswer(indices, scores, lane.role, prepared.inputs[lane.role][0].name)
        self.cache.put(prepared.key, ranked)
        body = self._body(reason, start, decode_ms, prepared.warnings, ranked, top_k, answer.inference_ms, route)
        return AnsweredBody(body, lane.role, prepared.inputs, lane.endpoint.labels, indices)  # for rampart.shadow

    def _body(self, reason: str | None, start: float, decode_ms: float, warnings: tuple[str, ...] = (),
              ranked: CachedAnswer | None = None, top_k: int = 0, inference_ms: float | None = None,
              route: str | None = None) -> dict:
        """The response body for one image (docs/api.md): the one place an answer is built.

        ``reason`` is the ``degraded_reason`` (None: a full answer); ``route`` how a model
        answer was reached (``ROUTES``; None: no model answered now). ``ranked`` holds
        the top classes and the role and bucket of the model that gave them (None:
        the static answer, no labels, ``needs_review``); ``top_k`` of them are listed.
        ``inference_ms`` is the model call's inference time (None: no model was
        called now, so queue and inference are 0). Times in ms: ``start`` is the
        ``time.perf_counter()`` at which the pipeline began, ``decode_ms`` the decode.
        """
        total_ms = _ms_since(start)
        queue_ms = 0.0 if inference_ms is None else max(total_ms - decode_ms - inference_ms, 0.0)
        endpoint = None if ranked is None else (self.primary if ranked.role == "primary" else self.fallback).endpoint
        return {
            "labels": [] if ranked is None else label_entries(ranked.indices[:top_k], ranked.scores[:top_k],
                                                               endpoint.labels),
            "model": None if endpoint is None else endpoint.identity,
            "degraded": reason is not None,
            "degraded_reason": reason,
            "route": route,
            "needs_review": ranked is None,
            "bucket": None if ranked is None else ranked.bucket,
            "timings_ms": _timings(decode_ms, queue_ms, inference_ms or 0.0, total_ms),
            "input_warnings": list(warnings),
        }

    def state(self) -> dict:
        """Admission, throughput and breaker state of both models and the routing, for ``GET /stats``."""
        return {
            "primary": self.primary.state(),
            "fallback": self.fallback.state(),
            "cascade": self.cascade_state(),
            "cache_entries": len(self.cache),
            "inflight_limit": self.inflight_limit(),
            "decode_pending": self.pool.pending,
            "decode_workers": self.pool.stats(),
            "priority": {name: dict(outcomes) for name, outcomes in self.by_priority.items()},
        }

    def cascade_state(self) -> dict:
        """The routing for ``/stats``: ``routing``, and in cascade mode its ``confidence`` kind, ``threshold``,
        model answers by ``routes``, ``escalation_rate`` (share of the fallback's answers below the threshold,
        escalated or not; None before any), ``escalated_rate`` (share of those the primary answered) and quantiles
        (p10, p50, p90) of the last ``CONFIDENCE_WINDOW`` fallback confidences."""
        if not self.cascade:
            return {"routing": self.settings.routing.mode}
        routes = {route: self.routes[route] for route in metrics.CASCADE_ROUTES}
        asked = routes["cascade_confident"] + routes["cascade_escalated"] + routes["cascade_not_escalated"]
        unsure = routes["cascade_escalated"] + routes["cascade_not_escalated"]
        recent = np.asarray(self.recent_confidences, dtype=np.float32)
        return {
            "routing": self.settings.routing.mode,
            "confidence": self.settings.routing.confidence,
            "threshold": self.settings.routing.threshold,
            "routes": routes,
            "escalation_rate": round(unsure / asked, 4) if asked else None,
            "escalated_rate": round(routes["cascade_escalated"] / unsure, 4) if unsure else None,
            "confidence_quantiles": None if recent.size == 0 else {
                f"p{q}": round(float(np.quantile(recent, q / 100)), 4) for q in (10, 50, 90)},
        }


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _timings(decode_ms: float, queue_ms: float, inference_ms: float, total_ms: float) -> dict:
    return {"decode": round(decode_ms, 3), "queue": round(queue_ms, 3), "inference": round(inference_ms, 3),
            "total": round(total_ms, 3)}
