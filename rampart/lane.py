"""One model as the pipeline drives it: its endpoint, admission gate and circuit breaker.

``ModelLane`` is the one place where a request takes (or is refused) a place
with one model and where that model is called:

- ``reserve`` / ``has_room``: the same refusals in the same order (the request's
  share of its deadline is used up → ``timeout``, the breaker refuses →
  ``circuit_open``, the gate sheds → ``queue_full``, ``predicted_late``, ``evicted``),
  the first taking the place, the second only looking;
- ``attempt``: waits for the turn the ticket gives, calls the model within the
  lane's share of the deadline (``rampart.overload.deadline.Share``), and tells the
  breaker what happened.

Every refusal comes back as an ``Attempt`` with a ``degraded_reason``
(``<role>_timeout``, ``<role>_circuit_open``, ``<role>_overloaded``,
``<role>_error``); nothing here raises to the caller.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from rampart.telemetry import metrics
from rampart.coalesce import Boarding
from rampart.hangup import hung_up, set_stage
from rampart.overload.admission import LOW, AdmissionGate, Shed, Ticket, priority_rank
from rampart.overload.breaker import STATE_VALUES, CircuitBreaker
from rampart.inputs.buckets import Bucket
from rampart.overload.deadline import Deadline, Share, run_within

__all__ = ["RunnerResult", "RunnerCall", "ModelEndpoint", "Attempt", "ModelLane"]

logger = logging.getLogger("rampart.pipeline")  # the lanes log as part of the pipeline, as before


@dataclass(frozen=True)
class RunnerResult:
    """What a runner sent back for one image: float32 ``probs`` (C,) or ``expired`` (None: the runner
    dropped the item because its deadline had passed); ``inference_ms`` (ms) of its batch of ``batch_size``.

    The pipeline's side of the runner's ``runners.common.RunnerResult`` (the pydantic model on the
    wire, where an expired item has an ``expired`` flag and empty ``probs``): ``from_wire`` converts.
    """

    probs: np.ndarray | None
    inference_ms: float
    batch_size: int

    @classmethod
    def from_wire(cls, result) -> RunnerResult:
        """The pipeline's form of a runner's ``runners.common.RunnerResult`` ``result`` (``probs`` None when expired)."""
        return cls(probs=None if result.expired else result.probs, inference_ms=result.inference_ms,
                   batch_size=result.batch_size)

    @property
    def expired(self) -> bool:
        """True when the runner dropped the item unanswered (its deadline had passed)."""
        return self.probs is None


#: ``call(bucket_name, pixels uint8 H×W×3, deadline_epoch_s)``: ``deadline_epoch_s`` is the end of
#: the lane's share of the request's deadline as ``time.time()`` seconds (``Deadline.epoch_s``).
RunnerCall = Callable[[str, np.ndarray, float], Awaitable[RunnerResult]]
#: ``source(boarding) -> [(pixels, deadline_epoch_s, future)]``: at most ``boarding.room`` images, already
#: dispatched, to ride in the call ``boarding`` describes (``rampart.coalesce.Boarding``), each with
#: ``deadline_epoch_s`` after ``boarding.done_by``; the call sets each one's runner result (the wire form) on its
#: ``future``.
RiderSource = Callable[[Boarding], list[tuple[np.ndarray, float, asyncio.Future]]]


@dataclass(frozen=True)
class ModelEndpoint:
    """A model as the pipeline sees it: identity, labels, buckets and a call."""

    name: str
    version: str
    labels: list[str]
    buckets: dict[str, Bucket]
    call: RunnerCall
    #: Counts of the calls made to the runner (``rampart.coalesce.CoalescerStats`` as a dict), for ``/stats``.
    call_stats: Callable[[], dict] | None = None
    #: ``accept_riders(source, fill_to)``: calls of this endpoint are topped up to ``fill_to()`` images with
    #: ``source``'s (a ``RiderSource``); None where calls carry one image each (no coalescing, or riders off).
    accept_riders: Callable[["RiderSource", Callable[[], int]], None] | None = None

    @property
    def identity(self) -> dict[str, str]:
        """``{"name", "version"}``: the ``model`` object of answers and ``/stats``."""
        return {"name": self.name, "version": self.version}


@dataclass(frozen=True)
class Attempt:
    """One model's try: its ``answer``, or why not (``reason``) and whether it was ``shed`` before reaching the model."""

    answer: RunnerResult | None
    reason: str | None = None
    shed: bool = False


#: The ``degraded_reason`` suffix of each refusal (``Shed.reason``); gate sheds are ``overloaded``.
REFUSAL_SUFFIX = {"timeout": "timeout", "circuit_open": "circuit_open"}


async def _carried(result: asyncio.Future) -> RunnerResult:
    """The pipeline's form of a rider's result (``RiderSource``), once its call answered."""
    return RunnerResult.from_wire(await result)


class ModelLane:
    """One model as the pipeline drives it: endpoint, admission gate, optional circuit breaker.

    ``share`` is the slice of each request's deadline this model may use
    (``Share.PRIMARY`` for the primary, which leaves the fallback its reserve).

    For the breaker, a timed-out call is a failure only when the runner has been
    silent (no response of any kind, see ``_responded``) since the call was
    dispatched *and* for longer than ``STALL_BATCHES`` full batches at the
    throughput measured when it last responded (``stall_after_s``): long enough
    that a busy runner, even one starved of CPU by an overloaded host (whose
    measured throughput is then low), would have answered something. The
    throughput is taken as of the last response because the meter itself falls
    while a hung model completes nothing, which would push the limit away. The
    silence is counted from the last response or from when this worker gave the
    runner work after having no call out (``busy_since``; a call goes on after its
    request timed out, so a hung runner keeps it), whichever is later: counted
    from the last response alone, the first burst after a quiet spell (or after
    start) met a "silence" of minutes, and every timeout before the runner's first
    answer counted as a stall (an attack round saw a fresh server's breaker open
    with five such "stalls" under a burst of pure overload).

    With several API workers a lane sees only its own worker's responses, and the
    runner may compute the other workers' batches in between: a full batch at this
    worker's measured speed (its share, about 1/N of the runner's) lasts N runner
    batches, the time the others' batches can keep it waiting. (Counted with its
    ``batch_share`` instead, one runner batch, a worker of 2 under 5x overload counted
    5 "stalled" timeouts while the runner was answering the other worker, and opened
    its breaker.)
    """

    #: Silence, in full batches at the measured speed, after which a timeout means "hung", not "busy".
    #: A busy runner answers about once per batch time, and the measured speed already includes CPU
    #: starvation on a saturated host (in the closed-loop overload, with the call's own wait as the only limit, 256
    #: connections opened the breaker). Twice that, so a hung model is still caught within about a
    #: second (the fault drill of test_fallback.py: two rounds of 8 requests).
    STALL_BATCHES = 2

    def __init__(self, role: str, endpoint: ModelEndpoint, gate: AdmissionGate, breaker: CircuitBreaker | None,
                 share: Share) -> None:
        self.role = role
        self.endpoint = endpoint
        self.gate = gate
        self.breaker = breaker
        self.share = share
        self.responses = 0  # runner responses ever (answers, late answers, TTL drops): the model's progress
        self.last_response = time.monotonic()
        self.busy_since = self.last_response  # when this worker last gave the runner work after having none out
        self.calls_out = 0  # runner calls of this worker not ended yet (a timed-out request's call goes on)
        self._ms_per_image_at_response: float | None = None
        self.failures = {"error": 0, "stalled": 0}  # what the breaker was told, by kind
        self._published_queue: dict[str, int] = {}  # queue depth last written per bucket
        gate.on_change = self._publish_queue
        #: Images a call is topped up to with waiting low ones (``AdmissionGate.carry``): the runner's compute batch
        #: size, from its ``/stats`` once it is warm (``seed``); 1 (no riders) until then.
        self.fill_to = 1
        if endpoint.accept_riders is not None:
            endpoint.accept_riders(self._riders, lambda: self.fill_to)

    def seed(self, runner_counters: dict) -> None:
        """Take a warm runner's ``stats`` (``runners.common``): its warm-up speed seeds the gate's meter, its
        ``compute_batch_size`` is what calls are topped up to with low images (``fill_to``)."""
        self.gate.meter.seed(runner_counters["warmup_ms_per_image"])
        self.fill_to = max(1, int(runner_counters.get("compute_batch_size") or 1))

    def _riders(self, boarding: Boarding) -> list[tuple[np.ndarray, float, asyncio.Future]]:
        """The ``RiderSource`` of this lane's endpoint: waiting low tickets the gate lets ride (``AdmissionGate.carry``)
        whose share of the deadline (the cargo's ``deadline_epoch_s``, ``attempt``) ends after ``boarding.done_by``:
        a rider that would come back late is not sent, it waits for its own turn, where the gate sheds it in time."""
        def in_time(cargo: tuple[np.ndarray, float]) -> bool:
            return cargo[1] > boarding.done_by
        carried = self.gate.carry(boarding.bucket, boarding.room, boarding.in_call, boarding.behind, in_time)
        return [(*cargo, ticket.carried) for ticket, cargo in carried]

    def _publish_queue(self, gate: AdmissionGate) -> None:
        """Set the queue-depth gauge of each bucket whose count changed since the last call: a change
        moves one ticket, so one or two gauges are written, not every bucket's (each write is a
        multiprocess-file write under BentoML's Prometheus setup)."""
        for bucket, count in gate.queued_by_bucket.items():
            if self._published_queue.get(bucket) != count:
                self._published_queue[bucket] = count
                metrics.QUEUE_DEPTH.labels(self.role, bucket).set(count)

    def refusal(self, priority: str, deadline: Deadline) -> Shed | None:
        """Why this model would refuse a request of class ``priority`` (``rampart.overload.admission.PRIORITIES``;
        a bool: True high) arriving now, or None when it has room; changes nothing.

        In order: the lane's share of ``deadline`` is used up (``Shed("timeout")``),
        the breaker refuses calls (``circuit_open``: open, or half-open with every
        probe out), the gate sheds (``AdmissionGate.refusal``).
        """
        return self._refusal(priority, deadline.remaining_s(self.share_of(priority)))

    def share_of(self, priority: str | bool | int) -> Share:
        """The slice of a request's deadline this lane spends on one of class ``priority``: the lane's ``share``,
        but the whole deadline (``Share.ALL``) for the low class, which never takes the fallback, so keeps no
        reserve for it (with the reserve, a low request with a deadline under ``fallback_reserve_ms`` was
        refused as if the primary had no room, on an idle server)."""
        return Share.ALL if priority_rank(priority) == LOW else self.share

    def _refusal(self, priority: str, budget_s: float) -> Shed | None:
        return self._lane_refusal(budget_s) or self.gate.refusal(priority, budget_s)

    def _lane_refusal(self, budget_s: float) -> Shed | None:
        """``timeout`` when the lane's share is used up, ``circuit_open`` when the breaker refuses calls, else None."""
        if budget_s <= 0:
            return Shed("timeout", f"{self.role}: its share of the deadline is used up")
        if self.breaker is not None and not self.breaker.would_allow():
            return Shed("circuit_open", f"{self.role}: the circuit breaker is {self.breaker.state}")
        return None

    def has_room(self, priority: str, deadline: Deadline) -> bool:
        """Whether ``reserve(priority, deadline)`` would give a ticket now, without taking one."""
        return self.refusal(priority, deadline) is None

    def reserve(self, priority: str, deadline: Deadline) -> Ticket | Attempt:
        """A ticket in the gate (and, when the breaker is half-open, one of its probes), or the refusal
        as a shed ``Attempt`` (``<role>_timeout`` / ``_circuit_open`` / ``_overloaded``), counted.

        The gate decides once, in ``AdmissionGate.reserve``, whose ``Shed`` is caught here.
        (Asking ``refusal`` first and then taking the place decided twice: the deadline's
        clock and the throughput meter, which decays while the model is busy, moved in
        between, and a request predicted to finish just in time passed the check and was
        then shed by the gate, a ``Shed`` that escaped as a 500 at 5x overload.)
        """
        budget_s = deadline.remaining_s(self.share_of(priority))
        shed = self._lane_refusal(budget_s)
        if shed is not None:
            return self._refused(shed)
        try:
            ticket = self.gate.reserve(priority, budget_s)
        except Shed as shed:
            return self._refused(shed)
        if self.breaker is not None:
            self.breaker.allow()  # True, as ``would_allow`` just saw; takes a probe when half-open
        metrics.ADMITTED.labels(self.role).inc()
        return ticket

    def _refused(self, shed: Shed) -> Attempt:
        """The shed ``Attempt`` for ``shed``, counted in ``rampart_rejected_total`` and logged at debug level."""
        metrics.REJECTED.labels(self.role, shed.reason).inc()
        self._publish_breaker()
        logger.debug("%s shed: %s", self.role, shed)
        return Attempt(None, f"{self.role}_{REFUSAL_SUFFIX.get(shed.reason, 'overloaded')}", shed=True)

    def release(self, ticket: Ticket) -> None:
        """Give back a ticket that will not be used (the upload was bad, or never got this far)."""
        if ticket.queued:
            ticket.cancel()
            self._record(None)

    async def attempt(self, ticket: Ticket, inputs: tuple[Bucket, np.ndarray], deadline: Deadline) -> Attempt:
        """Call the model with ``ticket`` on ``inputs`` (bucket, uint8 H×W×3 pixels) within the lane's share of
        ``deadline``; the runner gets the share's end as ``deadline_epoch_s``. Never raises: failures are ``Attempt``s."""
        bucket, pixels = inputs
        share = self.share_of(ticket.rank)
        dispatched = False
        progress_at_dispatch = self.responses

        async def admitted_call() -> RunnerResult:
            nonlocal dispatched, progress_at_dispatch
            set_stage("queue")
            deadline_epoch_s = deadline.epoch_s(share)
            async with ticket.turn(lambda: deadline.remaining_s(share), bucket.name, (pixels, deadline_epoch_s)):
                dispatched, progress_at_dispatch = True, self.responses
                if self.calls_out == 0:  # no call of this worker out: the runner's silence so far was not a stall
                    self.busy_since = time.monotonic()
                set_stage("model")
                if ticket.carried is not None:  # it rides in a call a higher class's image formed
                    call = asyncio.ensure_future(_carried(ticket.carried))
                else:
                    call = asyncio.ensure_future(self.endpoint.call(bucket.name, pixels, deadline_epoch_s))
                self.calls_out += 1
                call.add_done_callback(self._responded)
                call.add_done_callback(functools.partial(self._observe, time.monotonic(), self.gate.dispatched))
                # Shielded: when this request stops waiting, the runner call still finishes
                # (the runner has the item either way), so its answer counts as progress;
                # but when its client has gone, an image not yet sent is taken back (rampart.hangup).
                try:
                    return await asyncio.shield(call)
                except asyncio.CancelledError:
                    if hung_up():
                        call.cancel()
                    raise

        def timed_out() -> Attempt:
            # A late call is a failure for the breaker only if the runner sent nothing back
            # at all while it waited, not even a late answer or a TTL drop for someone else:
            # a hung model. A busy model keeps answering, just not in time for everyone.
            silent_s = time.monotonic() - max(self.last_response, self.busy_since)
            stalled = dispatched and self.responses == progress_at_dispatch and silent_s > self.stall_after_s()
            self._record(False if stalled else None, "stalled")
            return Attempt(None, f"{self.role}_timeout", shed=not dispatched)

        try:
            answer = await run_within(admitted_call(), deadline.remaining_s(share))
        except Shed as shed:  # evicted while queued, or predicted late at its turn
            self._record(None)
            return self._refused(shed)
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
        """A runner call ended (``calls_out``); count it as a response (an answer or a TTL drop, in time or not)
        unless it failed or was cancelled: errors are not progress."""
        self.calls_out -= 1
        if not call.cancelled() and call.exception() is None:
            self.responses += 1
            self.last_response = time.monotonic()
            self._ms_per_image_at_response = self.gate.meter.ms_per_image

    def _observe(self, dispatched_at: float, images_in_line: int, call: asyncio.Future) -> None:
        """Give the gate's ``ServiceTime`` a runner answer (in time or late; not a TTL drop or an error)."""
        if call.cancelled() or call.exception() is not None:
            return
        answer = call.result()
        if not answer.expired:
            self.gate.observe(time.monotonic() - dispatched_at, images_in_line, answer.inference_ms, answer.batch_size)

    def stall_after_s(self) -> float:
        """Seconds of runner silence after which a timeout counts as a failure: ``STALL_BATCHES`` full
        batches at the time per image measured at the last response (before any: now; 0 unmeasured)."""
        ms = self._ms_per_image_at_response or self.gate.meter.ms_per_image or 0.0
        return self.STALL_BATCHES * self.gate.max_batch_size * ms / 1000.0  # N runner batches with N workers

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
        self._publish_breaker()

    def _publish_breaker(self) -> None:
        if self.breaker is not None:
            metrics.BREAKER_STATE.labels(self.role).set(STATE_VALUES[self.breaker.state])

    def state(self) -> dict:
        """Gate, throughput and breaker state, for ``GET /stats``."""
        gate = self.gate
        return {
            "model": self.endpoint.identity,
            "dispatched": gate.dispatched,
            "dispatch_window": gate.window,
            "queued": gate.queued,
            "queued_by_priority": gate.queued_by_priority(),
            "queue_limit": gate.queue_limit,
            "throughput_ips": None if gate.meter.ips is None else round(gate.meter.ips, 2),
            "compute_ms_per_image": None if gate.service.compute_s is None else round(gate.service.compute_s * 1000, 2),
            "overhead_ms": round(gate.service.overhead_s * 1000, 2),
            "drain_s": round(gate.drain_s(), 3),
            "retry_after_cap_s": gate.retry_after_cap_s,
            "breaker": None if self.breaker is None else self.breaker.state,
            "breaker_opened": None if self.breaker is None else self.breaker.times_opened,
            "breaker_failures": None if self.breaker is None else dict(self.failures),
            "runner_calls": None if self.endpoint.call_stats is None else self.endpoint.call_stats(),
        }
