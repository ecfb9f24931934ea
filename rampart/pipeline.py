"""The request pipeline: decode → primary → fallback → cache → static answer, within one deadline.

``Classifier.classify`` is plain asyncio. It talks to the models through
``ModelEndpoint.call`` coroutines, so the same code runs against BentoML runner
proxies in the service and against stand-ins in unit tests. The deadline
(``X-Deadline-Ms``) covers everything:

- decoding and resizing run on a ``BoundedPool`` of worker processes
  (``rampart.decode_job.prepare``: bytes in, both models' bucket arrays out): 429
  when it is full or no decoder frees up before the deadline, 422
  ``decode_timeout`` when one decode runs past ``decode_timeout_ms`` (its worker
  is killed and replaced, so the slot is free at once);
- the primary is skipped while its circuit breaker is open (``primary_circuit_open``)
  or when its admission gate sheds the request (``primary_overloaded``); otherwise
  it gets the deadline minus ``fallback_reserve_ms``, and an error, a timeout or a
  runner TTL drop hands the request on (``primary_error`` / ``primary_timeout``);
- the fallback gets what is left of the deadline, behind its own gate;
- if the fallback cannot answer either, an earlier answer for the same bytes is
  used (``cached_result``), else the static default: no labels,
  ``no_model_available`` and ``needs_review`` true. If both gates shed the request
  and nothing is cached, the answer is 429 ``overloaded`` with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np
from PIL import Image

from .admission import AdmissionGate, Shed, ThroughputMeter, Ticket
from . import metrics
from .breaker import OPEN, STATE_VALUES, CircuitBreaker
from .buckets import Bucket
from .cache import CachedAnswer, ResultCache
from .config import Settings
from .deadline import Deadline, run_within
from .decode_job import DecodePlan, Prepared, prepare
from .decoding import DecodeLimits
from .errors import CorruptImage, DecodeTimeout, Overloaded
from .pool import BoundedPool, JobTimeout, WorkerDied
from .results import MAX_TOP_K, label_entries, top_classes
from .shadow import AnsweredBody

__all__ = ["RunnerAnswer", "ModelEndpoint", "Admission", "Classifier", "decode_limits", "decode_pool"]

logger = logging.getLogger("rampart.pipeline")


@dataclass(frozen=True)
class RunnerAnswer:
    """What a runner sent back for one image: float32 ``probs`` (C,) or ``expired``."""

    probs: np.ndarray | None
    inference_ms: float
    batch_size: int

    @property
    def expired(self) -> bool:
        return self.probs is None


#: ``call(bucket_name, pixels uint8 H×W×3, deadline as time.time() seconds)``.
RunnerCall = Callable[[str, np.ndarray, float], Awaitable[RunnerAnswer]]


@dataclass(frozen=True)
class ModelEndpoint:
    """A model as the pipeline sees it: identity, labels, buckets and a call."""

    name: str
    version: str
    labels: list[str]
    buckets: dict[str, Bucket]
    call: RunnerCall


def decode_limits(settings: Settings, buckets: list[Bucket]) -> DecodeLimits:
    """Decode limits from settings; JPEG draft keeps ≥ 2× the largest bucket side."""
    return DecodeLimits(
        max_body_bytes=settings.max_body_bytes,
        max_pixels=settings.max_pixels,
        min_side_px=settings.min_side_px,
        max_aspect_ratio=settings.max_aspect_ratio,
        max_frames=settings.max_frames,
        min_decoded_side=2 * max(max(b.height, b.width) for b in buckets),
        alpha_background=settings.alpha_background,
        max_jpeg_scans=settings.max_jpeg_scans,
        max_chunks=settings.max_chunks,
    )


def decode_pool(settings: Settings) -> BoundedPool:
    """The decode pool the settings ask for: ``decode_mode`` processes (forkserver preloaded
    with the decode code) or threads, ``decode_workers`` of them at ``decode_nice``."""
    return BoundedPool(settings.decode_workers, settings.decode_queue, nice=settings.decode_nice,
                       processes=settings.decode_mode == "processes", preload=("rampart.decode_job",))


@dataclass(frozen=True)
class Attempt:
    """One model's try: its ``answer``, or why not (``reason``) and whether it was ``shed`` before reaching the model."""

    answer: RunnerAnswer | None
    reason: str | None = None
    shed: bool = False


class ModelLane:
    """One model as the pipeline drives it: endpoint, admission gate, optional circuit breaker.

    For the breaker, a timed-out call is a failure only when the runner has been
    silent (no response of any kind, see ``_responded``) since the call was
    dispatched *and* for longer than ``STALL_BATCHES`` full batches at the
    throughput measured when it last responded (``stall_after_s``): long enough
    that a busy runner, even one starved of CPU by an overloaded host (whose
    measured throughput is then low), would have answered something. The
    throughput is taken as of the last response because the meter itself falls
    while a hung model completes nothing, which would push the limit away.
    """

    #: Silence, in full batches at the measured speed, after which a timeout means "hung", not "busy".
    #: A busy runner answers about once per batch time, and the measured speed already includes CPU
    #: starvation on a saturated host (issue 9: with the call's own wait as the only limit, 256
    #: connections opened the breaker). Twice that, so a hung model is still caught within about a
    #: second (tests/test_fallback.py's drill: two rounds of 8 requests).
    STALL_BATCHES = 2

    def __init__(self, role: str, endpoint: ModelEndpoint, gate: AdmissionGate, breaker: CircuitBreaker | None) -> None:
        self.role = role
        self.endpoint = endpoint
        self.gate = gate
        self.breaker = breaker
        self.responses = 0  # runner responses ever (answers, late answers, TTL drops): the model's progress
        self.last_response = time.monotonic()
        self._ms_per_image_at_response: float | None = None
        self.failures = {"error": 0, "stalled": 0}  # what the breaker was told, by kind
        gate.on_change = self._publish_queue

    def _publish_queue(self, gate: AdmissionGate) -> None:
        for bucket, count in gate.queued_by_bucket.items():
            metrics.QUEUE_DEPTH.labels(self.role, bucket).set(count)

    def reserve(self, high: bool, budget_s: float) -> Ticket | Attempt:
        """A ticket in the gate, or the refusal (``<role>_circuit_open`` / ``_overloaded`` / ``_timeout``)."""
        if budget_s <= 0:
            return self._refused("timeout", Attempt(None, f"{self.role}_timeout", shed=True))
        if self.breaker is not None and not self.breaker.allow():
            return self._refused("circuit_open", Attempt(None, f"{self.role}_circuit_open", shed=True))
        try:
            ticket = self.gate.reserve(high, budget_s)
        except Shed as shed:
            self._record(None)
            logger.debug("%s shed: %s", self.role, shed)
            return self._refused(shed.reason, Attempt(None, f"{self.role}_overloaded", shed=True))
        metrics.ADMITTED.labels(self.role).inc()
        return ticket

    def _refused(self, reason: str, attempt: Attempt) -> Attempt:
        metrics.REJECTED.labels(self.role, reason).inc()
        return attempt

    def has_room(self, high: bool, budget_s: float) -> bool:
        """Whether ``reserve`` would give a ticket now (breaker and gate), without taking one."""
        if budget_s <= 0 or (self.breaker is not None and self.breaker.state == OPEN):
            return False
        return self.gate.has_room(high, budget_s)

    def release(self, ticket: Ticket) -> None:
        """Give back a ticket that will not be used (the upload was bad, or never got this far)."""
        if ticket.queued:
            ticket.cancel()
            self._record(None)

    async def attempt(self, ticket: Ticket, inputs: tuple[Bucket, np.ndarray], deadline: Deadline,
                      reserve_ms: float) -> Attempt:
        """Call the model with ``ticket`` within the deadline minus ``reserve_ms``."""
        bucket, pixels = inputs
        budget_s = deadline.remaining_s(reserve_ms)
        dispatched = False
        progress_at_dispatch = self.responses

        async def admitted_call() -> RunnerAnswer:
            nonlocal dispatched, progress_at_dispatch
            async with ticket.turn(lambda: deadline.remaining_s(reserve_ms), bucket.name):
                dispatched, progress_at_dispatch = True, self.responses
                call = asyncio.ensure_future(self.endpoint.call(bucket.name, pixels, deadline.wall_clock_at(reserve_ms)))
                call.add_done_callback(self._responded)
                # Shielded: when this request stops waiting, the runner call still finishes
                # (the runner has the item either way), so its answer counts as progress.
                return await asyncio.shield(call)

        def timed_out() -> Attempt:
            # A late call is a failure for the breaker only if the runner sent nothing back
            # at all while it waited, not even a late answer or a TTL drop for someone else:
            # a hung model. A busy model keeps answering, just not in time for everyone.
            stalled = (dispatched and self.responses == progress_at_dispatch
                       and time.monotonic() - self.last_response > self.stall_after_s())
            self._record(False if stalled else None, "stalled")
            return Attempt(None, f"{self.role}_timeout", shed=not dispatched)

        try:
            answer = await run_within(admitted_call(), budget_s)
        except Shed as shed:
            self._record(None)
            logger.debug("%s shed: %s", self.role, shed)
            return self._refused(shed.reason, Attempt(None, f"{self.role}_overloaded", shed=True))
        except asyncio.TimeoutError:
            return timed_out()
        except Exception as exc:  # any runner failure degrades; it never becomes a 5xx
            self._record(False, "error")
            logger.warning("%s failed: %s: %s", self.endpoint.name, type(exc).__name__, exc)
            return Attempt(None, f"{self.role}_error")
        if answer.expired:
            return timed_out()
        self._record(True)
        self.gate.completed()
        return Attempt(answer)

    def _responded(self, call: asyncio.Future) -> None:
        """Count a runner response (an answer or a TTL drop, in time or not); errors are not progress."""
        if not call.cancelled() and call.exception() is None:
            self.responses += 1
            self.last_response = time.monotonic()
            self._ms_per_image_at_response = self.gate.meter.ms_per_image

    def stall_after_s(self) -> float:
        """Seconds of runner silence after which a timeout counts as a failure: ``STALL_BATCHES`` full
        batches at the time per image measured at the last response (before any: now; 0 unmeasured)."""
        ms = self._ms_per_image_at_response or self.gate.meter.ms_per_image or 0.0
        return self.STALL_BATCHES * self.gate.max_batch_size * ms / 1000.0

    def _record(self, ok: bool | None, kind: str = "") -> None:
        """Tell the breaker: ``ok`` for a call that reached the model, ``None`` for one that did not;
        a failure's ``kind`` (``error`` or ``stalled``) is counted and logged when the breaker opens."""
        if self.breaker is None:
            return
        if ok is None:
            self.breaker.cancel()
        else:
            opened = self.breaker.times_opened
            if not ok:
                self.failures[kind] = self.failures.get(kind, 0) + 1
            self.breaker.record(ok)
            if self.breaker.times_opened > opened:
                logger.warning("%s circuit breaker opened; failures so far: %s; last runner response %.0f ms ago",
                               self.role, self.failures, (time.monotonic() - self.last_response) * 1000)
        metrics.BREAKER_STATE.labels(self.role).set(STATE_VALUES[self.breaker.state])

    def state(self) -> dict:
        """Gate, throughput and breaker state, for ``GET /stats``."""
        gate = self.gate
        return {
            "model": {"name": self.endpoint.name, "version": self.endpoint.version},
            "dispatched": gate.dispatched,
            "dispatch_window": gate.window,
            "queued": gate.queued,
            "queue_limit": gate.queue_limit,
            "throughput_ips": None if gate.meter.ips is None else round(gate.meter.ips, 2),
            "drain_s": round(gate.drain_s(), 3),
            "retry_after_cap_s": gate.retry_after_cap_s,
            "breaker": None if self.breaker is None else self.breaker.state,
            "breaker_opened": None if self.breaker is None else self.breaker.times_opened,
            "breaker_failures": None if self.breaker is None else dict(self.failures),
        }


@dataclass
class Admission:
    """What a request was granted on arrival: a ``primary`` ticket, or else a ``fallback``
    ticket plus the primary's refusal ``primary_refused``."""

    primary: Ticket | None = None
    fallback: Ticket | None = None
    primary_refused: Attempt | None = None


class Classifier:
    """Classifies one upload within its deadline, degrading honestly; see the module doc."""

    def __init__(self, settings: Settings, primary: ModelEndpoint, fallback: ModelEndpoint, pool: BoundedPool) -> None:
        self.settings = settings
        self.pool = pool
        tau_s = settings.throughput_tau_ms / 1000
        self.primary = ModelLane("primary", primary, AdmissionGate(
            primary.name, settings.primary_max_batch_size, settings.primary_concurrent_batches,
            settings.primary_queue_delay_ms, ThroughputMeter(settings.primary_throughput_ips, tau_s),
        ), CircuitBreaker(
            window_s=settings.breaker_window_ms / 1000, min_calls=settings.breaker_min_calls,
            failure_rate=settings.breaker_failure_rate, open_s=settings.breaker_open_ms / 1000,
            probes=settings.breaker_probes,
        ))
        self.fallback = ModelLane("fallback", fallback, AdmissionGate(
            fallback.name, settings.fallback_max_batch_size, settings.fallback_concurrent_batches,
            settings.fallback_queue_delay_ms, ThroughputMeter(settings.fallback_throughput_ips, tau_s),
        ), None)
        self.cache = ResultCache(settings.cache_size)
        self.limits = decode_limits(settings, [*primary.buckets.values(), *fallback.buckets.values()])
        self.plan = DecodePlan(self.limits, {"primary": primary.buckets, "fallback": fallback.buckets},
                               settings.crop_margin, settings.fault_decode_hang, settings.fault_file)

    def retry_after_s(self) -> float:
        """``Retry-After`` for a 429: when the first of the two models will have drained its queue.

        Whole seconds, at least 1 and at most that gate's ``retry_after_cap_s`` (see
        ``AdmissionGate.retry_after_s``): a retry is admitted as soon as either
        model has room.
        """
        return min(self.primary.gate.retry_after_s(), self.fallback.gate.retry_after_s())

    def inflight_limit(self) -> int:
        """Most ``/classify`` requests one API worker lets in at once (``rampart.arrival.bound_inflight``).

        Twice the places both gates have (dispatch window + queue limit of each):
        up to one request per place holds it, and as many again may be reading
        their body (no place held yet) or be on their way out. Any more could only
        be shed by admission, so they are refused before BentoML's middlewares.
        """
        return 2 * sum(lane.gate.window + lane.gate.queue_limit for lane in (self.primary, self.fallback))

    def check_capacity(self, deadline: Deadline, high: bool) -> None:
        """Raise ``Overloaded`` (429) when neither model could take a request now.

        Called before the body is read, so shedding costs next to nothing and a slow
        upload holds no place in any queue; the place itself is taken by ``admit``
        once the body is in. A deadline shorter than the shortest possible answer is
        refused the same way, with a message that says so.
        """
        if self.primary.has_room(high, deadline.remaining_s(self.settings.fallback_reserve_ms)):
            return
        if self.fallback.has_room(high, deadline.remaining_s()):
            return
        if deadline.remaining_s() <= 0:
            raise Overloaded(f"the deadline ({deadline.budget_ms:.0f} ms after margins) leaves no time to answer",
                             self.retry_after_s())
        raise Overloaded("both models are at capacity; retry later", self.retry_after_s())

    def admit(self, deadline: Deadline, high: bool) -> Admission:
        """Reserve a place for a request arriving now, before its body is read.

        A ticket for the primary, else one for the fallback; raises ``Overloaded``
        (429) when neither model can take it, so shedding costs next to nothing.
        """
        primary = self.primary.reserve(high, deadline.remaining_s(self.settings.fallback_reserve_ms))
        if isinstance(primary, Ticket):
            return Admission(primary=primary)
        fallback = self.fallback.reserve(high, deadline.remaining_s())
        if isinstance(fallback, Ticket):
            return Admission(fallback=fallback, primary_refused=primary)
        raise Overloaded("both models are at capacity; retry later", self.retry_after_s())

    def release(self, admission: Admission) -> None:
        """Give back whatever tickets of ``admission`` were not used."""
        for lane, ticket in ((self.primary, admission.primary), (self.fallback, admission.fallback)):
            if ticket is not None:
                lane.release(ticket)

    async def _prepare(self, data: bytes, deadline: Deadline, high: bool) -> Prepared:
        """Decode ``data`` on the pool into both models' inputs (``rampart.decode_job.prepare``).

        Raises ``DecodeTimeout`` past ``decode_timeout_ms``, ``JobTimeout`` when the
        deadline ran out first, ``Overloaded`` when no decoder is free in time,
        ``CorruptImage`` when the decoder process died on the input, and the
        decoder's own ``ImageError``.
        """
        try:
            prepared = await self.pool.run(prepare, data, self.plan, high=high, budget_s=deadline.remaining_s(),
                                           run_limit_s=self.settings.decode_timeout_ms / 1000)
        except JobTimeout as exc:
            if exc.by_run_limit:
                raise DecodeTimeout(f"decoding took longer than {self.settings.decode_timeout_ms} ms") from None
            raise
        except WorkerDied as exc:  # a decoder crash (or the OOM killer) on this input: the input's fault
            raise CorruptImage(f"the image could not be decoded: {exc}") from None
        metrics.INPUT_MEGAPIXELS.observe(prepared.declared_size[0] * prepared.declared_size[1] / 1e6)
        return prepared

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
        jobs = [self.pool.run(prepare, data, self.plan) for _ in range(self.settings.decode_workers)]
        for outcome in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(outcome, BaseException):
                logger.warning("decoder warm-up failed: %s: %s", type(outcome).__name__, outcome)

    async def classify(self, data: bytes, top_k: int, deadline: Deadline, high: bool = False) -> dict:
        """The response body for one image (see README, "API").

        Takes the request's place (``admit``) now that its body is in. Raises ``rampart.errors.ImageError`` for a bad upload (``DecodeTimeout``
        when decoding runs past ``decode_timeout_ms``) and ``Overloaded`` when
        decoding capacity is exhausted or both models shed the request and nothing
        is cached; model failures never raise.
        """
        admission = self.admit(deadline, high)
        try:
            result = await self._classify(data, top_k, deadline, high, admission)
        finally:
            self.release(admission)
        self._observe(result)
        return result

    def _observe(self, result: dict) -> None:
        """Metrics of one answer: stage durations, degraded reason, top-1 class and confidence, input warnings."""
        name = (result["model"] or {}).get("name")
        role = {self.primary.endpoint.name: "primary", self.fallback.endpoint.name: "fallback"}.get(name, "none")
        if result["degraded_reason"] == "cached_result":
            role = "cache"
        for stage, ms in result["timings_ms"].items():
            metrics.STAGE_SECONDS.labels(role, stage).observe(ms / 1000.0)
        if result["degraded"]:
            metrics.DEGRADED.labels(result["degraded_reason"]).inc()
        for warning in result["input_warnings"]:
            metrics.INPUT_WARNINGS.labels(warning).inc()
        if result["labels"] and role in ("primary", "fallback"):
            metrics.TOP1_CONFIDENCE.labels(role).observe(result["labels"][0]["score"])
            metrics.TOP1_CLASS.labels(role, result["labels"][0]["label"]).inc()

    async def _classify(self, data: bytes, top_k: int, deadline: Deadline, high: bool, admission: Admission) -> dict:
        start = time.perf_counter()
        try:
            prepared = await self._prepare(data, deadline, high)
        except JobTimeout:
            return self._static_answer("deadline_exceeded", _ms_since(start), start)
        decode_ms = _ms_since(start)

        if admission.primary is not None:
            first = await self.primary.attempt(admission.primary, prepared.inputs["primary"], deadline,
                                               self.settings.fallback_reserve_ms)
            if first.answer is not None:
                return self._answer(self.primary, first.answer, prepared, top_k, decode_ms, start, None)
            admission.fallback = self.fallback.reserve(high, deadline.remaining_s())
            if isinstance(admission.fallback, Attempt):
                second, admission.fallback = admission.fallback, None
            else:
                second = await self._fallback_attempt(prepared, admission.fallback, deadline)
        else:
            first = admission.primary_refused
            second = await self._fallback_attempt(prepared, admission.fallback, deadline)
        metrics.FALLBACK.labels(first.reason).inc()
        if second.answer is not None:
            return self._answer(self.fallback, second.answer, prepared, top_k, decode_ms, start, first.reason)

        logger.warning("no model answered: %s, then %s", first.reason, second.reason)
        cached = self.cache.get(prepared.key)
        if cached is not None:
            return self._cached_answer(cached, top_k, decode_ms, start, prepared.warnings)
        if first.shed and second.shed:
            raise Overloaded("both models are at capacity; retry later", self.retry_after_s())
        return self._static_answer("no_model_available", decode_ms, start, prepared.warnings)

    async def _fallback_attempt(self, prepared: Prepared, ticket: Ticket, deadline: Deadline) -> Attempt:
        return await self.fallback.attempt(ticket, prepared.inputs["fallback"], deadline, 0.0)

    def _answer(self, lane: ModelLane, answer: RunnerAnswer, prepared: Prepared, top_k: int, decode_ms: float,
                start: float, reason: str | None) -> dict:
        endpoint = lane.endpoint
        bucket = prepared.inputs[lane.role][0]
        indices, scores = top_classes(answer.probs, MAX_TOP_K)
        self.cache.put(prepared.key, CachedAnswer(indices, scores, lane.role, bucket.name))
        total_ms = _ms_since(start)
        # An AnsweredBody is the plain body that also keeps the model's inputs for shadow traffic (rampart.shadow).
        return AnsweredBody({
            "labels": label_entries(indices[:top_k], scores[:top_k], endpoint.labels),
            "model": {"name": endpoint.name, "version": endpoint.version},
            "degraded": reason is not None,
            "degraded_reason": reason,
            "needs_review": False,
            "bucket": bucket.name,
            "timings_ms": _timings(decode_ms, max(total_ms - decode_ms - answer.inference_ms, 0.0),
                                   answer.inference_ms, total_ms),
            "input_warnings": list(prepared.warnings),
        }, lane.role, prepared.inputs, endpoint.labels, indices)

    def state(self) -> dict:
        """Admission, throughput and breaker state of both models, for ``GET /stats``."""
        return {
            "primary": self.primary.state(),
            "fallback": self.fallback.state(),
            "cache_entries": len(self.cache),
            "inflight_limit": self.inflight_limit(),
            "decode_pending": self.pool.pending,
            "decode_workers": self.pool.stats(),
        }

    def _cached_answer(self, cached: CachedAnswer, top_k: int, decode_ms: float, start: float,
                       warnings: tuple[str, ...]) -> dict:
        endpoint = (self.primary if cached.role == "primary" else self.fallback).endpoint
        return {
            "labels": label_entries(cached.indices[:top_k], cached.scores[:top_k], endpoint.labels),
            "model": {"name": endpoint.name, "version": endpoint.version},
            "degraded": True,
            "degraded_reason": "cached_result",
            "needs_review": False,
            "bucket": cached.bucket,
            "timings_ms": _timings(decode_ms, 0.0, 0.0, _ms_since(start)),
            "input_warnings": list(warnings),
        }

    def _static_answer(self, reason: str, decode_ms: float, start: float, warnings: tuple[str, ...] = ()) -> dict:
        return {
            "labels": [],
            "model": None,
            "degraded": True,
            "degraded_reason": reason,
            "needs_review": True,
            "bucket": None,
            "timings_ms": _timings(decode_ms, 0.0, 0.0, _ms_since(start)),
            "input_warnings": list(warnings),
        }


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _timings(decode_ms: float, queue_ms: float, inference_ms: float, total_ms: float) -> dict:
    return {"decode": round(decode_ms, 3), "queue": round(queue_ms, 3), "inference": round(inference_ms, 3),
            "total": round(total_ms, 3)}
