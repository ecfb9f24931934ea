"""Deadline-aware admission control for one model: bounded, priority-ordered, measured.

Each model sits behind an ``AdmissionGate``. At most ``window`` images are
*dispatched* (sent to the runner's adaptive-batching queue or being computed) at
once: ``(concurrent_batches + 1) × max_batch_size``, one batch computing and one
forming. Requests beyond that wait in the gate's own queue, high priority first,
then in arrival order, so the runner's queue stays short and priority means
something (BentoML's dispatcher itself is first in, first out).

Queued requests include those still being decoded: the place is taken once the
body is in, before decoding. The wait queue is bounded by measured throughput ×
the acceptable queueing delay (``queue_delay_ms``), as in the seed's sizing rule:
200 img/s × 0.2 s = 40. The throughput comes from ``ThroughputMeter``: seeded by the
runner's warm-up, then measured online from completions while the model is busy,
or fixed by configuration.

Admission asks one question, ``AdmissionGate.refusal`` (a few microseconds, no
I/O), twice: on arrival, before the body is read, ``has_room`` only looks (so
shedding costs next to nothing and a slow upload holds no place); once the body
is in, ``reserve`` takes a ``Ticket``. A request is refused (``Shed``) when

- the gate is full (``queue_full``); an arrival of a higher class instead evicts the
  newest queued request of the lowest class below it (low first, then, for a high
  arrival, normal), which is shed with ``evicted``;
- it is of the ``low`` class, a request of a higher class is queued and the gate's ``low_arrival`` is
  ``idle-only`` (``higher_priority_waiting``); with ``queue``, the default, it waits behind them instead;
- the predicted completion time exceeds what is left of its deadline
  (``predicted_late``): the images ahead of it and itself (rounded up to whole
  batches when a batch is full) times the measured time per image. The check is
  made again when the request's turn comes, after decoding.

The caller then tries the next model in the chain (see ``rampart.pipeline``).

**Priority classes** (``PRIORITIES``, header ``X-Priority``): ``high``, ``normal``, ``low``.
Waiting requests are dispatched high first, then normal, then low, each in arrival
order; a request's prediction counts only the images ahead of it (dispatched, and
queued at its class or higher), so queued low requests never make a normal one look
late. The low class is bulk work that fills idle capacity: it waits behind every queued request of a
higher class (or, with ``low_arrival`` ``idle-only``, is admitted only while none is queued), its queued
tickets are the first a full gate evicts, and it is dispatched only while fewer than ``low_window``
images (a sixteenth of a batch share, at least one) are dispatched: a normal or high arrival finds at
most that many images in the runner ahead of it, and the rest of the window (always more than a batch) is
free for it, so a low item never holds a place a higher one could take. (Items
already sent to the runner cannot be called back; the small low window is what
keeps them out of a higher request's way.) A waiting low image may also ride in a call that a normal or high
image forms while nothing else of a higher class is with the runner (by default; ``riders_ahead`` lets it past
that many images in calls already out), up to the runner's compute batch size (``carry``:
``rampart.lane.ModelLane`` hands them to the ``rampart.coalesce.Coalescer`` that forms the call).

For experiments only (setting ``admission``, docs/benchmarks.md, "Ablation"), a gate's ``mode`` can
switch shedding off in part: ``queue-bound`` refuses only ``queue_full`` (no
prediction, at arrival or at the turn), ``off`` refuses nothing (an unbounded queue,
no eviction). ``full``, the default, is everything above.

**Several API workers** (setting ``api_workers``, N). Each worker process has its
own gate and sees only its own requests, while the runner's queue is shared. The
runner's capacity is therefore divided between them: a gate built with
``workers=N`` dispatches at most ``window // N`` images (so all workers together
never dispatch more than one runner's window), treats ``max_batch_size // N`` images
as its share of a batch (the queue's least length and the rounding of predictions),
and its meter (``ThroughputMeter(share=1/N)``) starts from ``1/N`` of the warm-up
speed. From then on the meter measures this worker's own completions over its own
busy time, which is its share of the model whatever the others do: about ``C/N``
while every worker is busy, up to ``C`` while it is the only one. So the wait
queue (throughput × delay) and the prediction (images ahead × time per image) of
each worker count its own share of the runner's work. A worker less busy than the
others over-predicts (its time per image also holds the others' images its requests
waited behind: at worst about 2× with one request of its own) and sheds early, to the
fallback. One that earned the full speed while alone under-predicts for a few τ
once the others get busy (the re-check at dispatch and the deadline catch it). Why this and not a shared counter or admission
in the runner: docs/overload.md.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

__all__ = ["DECODING", "ADMISSION_MODES", "PREDICTIONS", "PRIORITIES", "priority_rank", "priority_name", "Shed", "ThroughputMeter",
           "ServiceTime", "Ticket", "AdmissionGate"]

#: Pseudo-bucket of queued requests whose image is still being decoded.
DECODING = "decoding"
#: What a gate may refuse (``AdmissionGate.mode``, setting ``admission``): ``full`` (queue bound and predicted
#: lateness: production), ``queue-bound`` (queue bound only), ``off`` (nothing). The last two are for experiments.
ADMISSION_MODES = ("full", "queue-bound", "off")
#: How a gate predicts completion (setting ``admission_prediction``): ``meter`` (images ahead × the busy-time
#: meter's time per image, the default) or ``service`` (``ServiceTime``: travel time + images × compute).
PREDICTIONS = ("meter", "service")
#: The priority classes (``X-Priority``), highest first; a class's rank is its index (0 high, 1 normal, 2 low).
PRIORITIES = ("high", "normal", "low")
HIGH, NORMAL, LOW = range(3)
#: What a low-priority arrival finds while a request of a higher class is queued (``AdmissionGate.low_arrival``):
#: ``idle-only``, a refusal (``higher_priority_waiting``); ``queue``, a place behind them (dispatched after them,
#: the first a full gate evicts).
LOW_ARRIVALS = ("idle-only", "queue")


def priority_rank(priority: str | bool | int) -> int:
    """The rank (0 high, 1 normal, 2 low) of a class name of ``PRIORITIES``; a bool is read as the two classes
    callers had before the low class (True high, False normal), an int as a rank already. Raises ``ValueError``
    for any other name or rank."""
    if isinstance(priority, bool):
        return HIGH if priority else NORMAL
    if isinstance(priority, int) and HIGH <= priority <= LOW:
        return priority
    try:
        return PRIORITIES.index(priority)
    except ValueError:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}") from None


def priority_name(priority: str | bool) -> str:
    """The class name (``PRIORITIES``) of ``priority`` (a name, or a bool as in ``priority_rank``)."""
    return PRIORITIES[priority_rank(priority)]


class Shed(Exception):
    """A request was not admitted (or was evicted); ``reason`` is ``queue_full``, ``predicted_late``, ``evicted`` or
    ``higher_priority_waiting`` (a low request while a higher one is queued) from a gate, ``timeout`` or ``circuit_open`` from a model lane (``rampart.lane``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ThroughputMeter:
    """Images per second one model completes while it is busy, measured online.

    The gate reports when the model is busy (anything dispatched) and each image
    answered in time. Throughput is images completed while busy divided by time
    spent busy, both exponentially weighted with time constant ``tau_s`` of *busy*
    time. It sees everything that slows the model down at the current load (batch
    sizes, batches of the three buckets taking turns, contention for the CPU or
    GPU, transport), and calls that time out add time but no images.

    Idle time changes nothing: the meter's clock stops while the model is idle, so
    after any idle spell the estimate is the one the model last earned, and a
    burst is judged by it (if idle time decayed both sums, the first busy second of
    a burst would see about 0 images in 1 s and predict hours). Nor does the
    estimate ever fall below ``floor_fraction`` of the warm-up speed: a model
    that completes nothing at all (hung) is the circuit breaker's business, and a
    meter near zero would only turn into absurd ``Retry-After`` values.

    The runner's warm-up (a timed full batch) seeds it, worth one second of
    observation; ``override_ips`` > 0 fixes it instead (setting
    ``<model>_throughput_ips``). Both are the whole model's speed; ``share`` (0..1]
    is the part of it this meter's API worker gets while all ``api_workers`` are
    busy (``1 / api_workers``), and scales both. Units: seconds, images, images per second.
    """

    #: Lowest estimate, as a fraction of the warm-up speed. Under overload on the 2-core
    #: machine the primary serves 35-42 requests/s against 89 images/s at warm-up, about
    #: 0.4-0.5 of it (docs/overload.md); a tenth leaves room for worse hosts.
    FLOOR_FRACTION = 0.1

    def __init__(self, override_ips: float = 0.0, tau_s: float = 5.0, clock=time.monotonic,
                 floor_fraction: float = FLOOR_FRACTION, share: float = 1.0) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.share = share
        self.override_ips = override_ips * share
        self.tau_s = tau_s
        self.clock = clock
        self.floor_fraction = floor_fraction
        self.seed_ips: float | None = None
        self._images = 0.0
        self._busy_s = 0.0
        self._busy = False
        self._last = clock()

    def seed(self, ms_per_image: float) -> None:
        """Start from a warm-up measurement of the whole model (ms per image at full batch), worth one second
        of busy time; this meter's ``share`` of it is the seed."""
        if ms_per_image > 0:
            self.seed_ips = self.share * 1000.0 / ms_per_image
            if self._busy_s == 0:
                self._images, self._busy_s = self.seed_ips, 1.0

    def busy(self, busy: bool) -> None:
        """The model is (or is no longer) busy from now on."""
        self._advance()
        self._busy = busy

    def completed(self, images: int = 1) -> None:
        """``images`` were answered just now."""
        self._advance()
        self._images += images

    def _advance(self) -> None:
        now = self.clock()
        if self._busy:  # only busy time moves the meter: idle time neither decays nor dilutes it
            decay = math.exp(-(now - self._last) / self.tau_s)
            self._images *= decay
            self._busy_s = self._busy_s * decay + self.tau_s * (1.0 - decay)
        self._last = now

    @property
    def ips(self) -> float | None:
        """Images per second (at least ``floor_fraction`` × the warm-up speed), or ``None`` before any measurement."""
        if self.override_ips > 0:
            return self.override_ips
        self._advance()
        if self._busy_s <= 0:
            return None
        floor = self.floor_fraction * self.seed_ips if self.seed_ips else 0.0
        ips = max(self._images / self._busy_s, floor)
        return ips if ips > 0 else None

    @property
    def floor_ips(self) -> float | None:
        """The lowest value ``ips`` can take (``override_ips`` when fixed), or ``None`` before the warm-up seed."""
        if self.override_ips > 0:
            return self.override_ips
        return self.floor_fraction * self.seed_ips if self.seed_ips else None

    @property
    def ms_per_image(self) -> float | None:
        """Milliseconds per image, or ``None`` before any measurement."""
        ips = self.ips
        return None if ips is None else 1000.0 / ips


class ServiceTime:
    """How long the runner takes for the images in line, from its own answers: ``overhead_s + images × compute_s``.

    ``ThroughputMeter`` divides images answered by time with anything dispatched, so it
    also counts the time an image spends travelling (the coalescer's wait for the call
    before it, pickling, the HTTP round trip, an API event loop busy shedding). Under
    overload on a shared CPU that time grows, the meter falls, the gate dispatches less,
    the runner waits for work between calls and the meter falls further: on the 2-core
    host at 5x overload it fell from 19 to 7 img/s while the primary's core sat idle a
    third of the time, and the primary answered 0.4 of its own capacity
    (docs/overload.md, "Predicting completion"). That time does not grow with the
    images in line, so it is measured apart:

    - ``compute_s``: the runner's own inference time per image (``inference_ms /
      batch_size`` of the batch that answered, divided by its ``concurrent_batches``),
      over ``share``, this API worker's part of the runner (``1 / api_workers``);
    - ``overhead_s``: what a call took beyond the compute of the images in line when it
      was dispatched (itself included), at least 0.

    Both are exponentially weighted over answers (``ALPHA`` each). Units: seconds.
    ``ready`` once an answer was observed; before that the gate predicts with its meter.
    """

    #: Weight of each new answer in both averages (about the last 20 answers count).
    ALPHA = 0.05

    def __init__(self, share: float = 1.0, concurrent_batches: int = 1) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.share = share
        self.concurrent_batches = max(1, concurrent_batches)
        self.compute_s: float | None = None
        self.overhead_s = 0.0

    @property
    def ready(self) -> bool:
        """Whether an answer was observed (``compute_s`` is known)."""
        return self.compute_s is not None

    def observe(self, latency_s: float, images_in_line: int, inference_ms: float, batch_size: int) -> None:
        """One answer: ``latency_s`` from dispatch to answer, ``images_in_line`` dispatched by this gate when it
        was dispatched (itself included), and the runner's ``inference_ms`` for its batch of ``batch_size``."""
        if batch_size < 1 or inference_ms <= 0:
            return
        per_image = inference_ms / 1000.0 / batch_size / self.concurrent_batches / self.share
        self.compute_s = per_image if self.compute_s is None else self.compute_s + self.ALPHA * (per_image - self.compute_s)
        residual = max(0.0, latency_s - max(images_in_line, 1) * self.compute_s)
        self.overhead_s += (residual - self.overhead_s) if self.overhead_s == 0.0 else self.ALPHA * (residual - self.overhead_s)

    def completion_s(self, images: int) -> float:
        """Predicted seconds until the last of ``images`` in line is answered (0 before any answer)."""
        return 0.0 if self.compute_s is None else self.overhead_s + images * self.compute_s


def _retrieved(future: asyncio.Future) -> None:
    """Mark ``future``'s exception as read, so that one nobody awaits is not logged as never retrieved."""
    if not future.cancelled():
        future.exception()


class Ticket:
    """A place in an ``AdmissionGate``, taken once the request's body is in (before it is decoded).

    ``async with ticket.turn():`` waits until the gate dispatches it and holds the
    dispatch slot for the runner call; ``cancel()`` gives back a ticket that will
    not be used. A ticket may be evicted by an arrival of a higher class while it waits:
    ``turn()`` then raises ``Shed("evicted")``. ``rank`` is its class (``priority_rank``).
    """

    def __init__(self, gate: "AdmissionGate", rank: int, seq: int) -> None:
        self.gate = gate
        self.rank = rank
        self.seq = seq
        self.future: asyncio.Future | None = None
        self.evicted = False
        self.bucket = DECODING  # the bucket it waits in, once its image is decoded
        #: What a call needs to carry this ticket's image (``turn(cargo=...)``), kept while a low ticket waits.
        self.cargo: object | None = None
        #: Set when ``AdmissionGate.carry`` dispatched this ticket into a call a higher class's image formed: the
        #: future of its result in that call. The ticket's holder then waits for it and makes no call of its own.
        self.carried: asyncio.Future | None = None

    @property
    def high(self) -> bool:
        """Whether the ticket is of the high class."""
        return self.rank == HIGH

    @asynccontextmanager
    async def turn(self, remaining_s: Callable[[], float] | None = None, bucket: str = DECODING,
                   cargo: object | None = None) -> AsyncIterator[None]:
        """Wait for dispatch (high first, then normal, then low, each in arrival order), then hold the slot.

        At dispatch the prediction is made again with ``remaining_s()`` (seconds
        left, if given): a request that can no longer finish in time is not sent
        (``Shed("predicted_late")``), so the model spends nothing on it and the
        fallback gets the time that is left. Call ``gate.completed()`` for an
        answer that came back in time.

        A low ticket waiting with ``cargo`` (what a call needs to carry its image) may be dispatched by
        ``AdmissionGate.carry`` into a call that a higher class's image formed in ``bucket``: ``carried`` is then
        its result's future, already on its way, and no prediction is made again.
        """
        gate = self.gate
        if self.evicted:
            raise Shed("evicted", f"{gate.name}: evicted by a request of a higher priority class")
        gate._move(self, bucket)
        if self.rank == LOW:
            self.cargo = cargo
        if gate.dispatched < gate.window_for(self.rank) and not gate._heap_has_waiters(self.rank):
            gate._take(self)
        else:
            self.future = asyncio.get_running_loop().create_future()
            heapq.heappush(gate._heap, (self.rank, self.seq, self))
            try:
                await self.future
            except BaseException:
                if self.future.done() and not self.future.cancelled() and self.future.exception() is None:
                    gate._release(self)  # dispatched in the same instant the caller gave up: hand the slot on
                else:
                    self.cancel()
                raise
        try:
            alone = gate.dispatched == 1  # an idle model always gets a try: the meter may be stale
            if (self.carried is None and gate.predicts and remaining_s is not None and not alone
                    and gate.completion_s(gate.dispatched) > remaining_s()):
                raise Shed("predicted_late", f"{gate.name}: {gate.dispatched} images ahead no longer fit the deadline")
            yield
        finally:
            gate._release(self)

    @property
    def queued(self) -> bool:
        """True until the ticket is dispatched, cancelled or evicted."""
        return self.seq in self.gate._pending

    @property
    def waiting(self) -> bool:
        """True while the ticket waits in the gate's dispatch heap for its turn (queued, its turn not given)."""
        return self.queued and self.future is not None and not self.future.done()

    def cancel(self) -> None:
        """Give the place back if it was never dispatched (no-op otherwise)."""
        if self.queued:
            self.gate._forget(self)
        if self.future is not None and not self.future.done():
            self.future.cancel()


class AdmissionGate:
    """Bounded, priority-ordered, deadline-aware admission to one model.

    ``max_batch_size`` and ``concurrent_batches`` describe the runner;
    ``queue_delay_ms`` is the acceptable queueing delay that sizes the wait queue
    (never below one batch). ``workers`` is the number of API worker processes
    that share the runner, each with its own gate: this gate gets ``window // workers``
    dispatch places and counts ``max_batch_size // workers`` images as its share of a
    batch (``batch_share``), at least 1 each (``Settings`` refuses more workers than
    the smaller ``max_batch_size``, so the gates' shares and windows never add up to
    more than the runner's). Its ``meter`` should have ``share=1/workers``.
    ``has_room(priority, budget_s)`` answers on arrival whether a request would get a place; ``reserve(priority,
    budget_s)``, once its body is in, returns a ``Ticket`` or raises ``Shed`` (both decide with ``refusal``);
    ``priority`` is a class of ``PRIORITIES`` (or a bool: True high, False normal);
    ``async with ticket.turn():`` goes around the runner call. ``riders_ahead`` bounds riders (``carry``);
    ``low_arrival`` (``LOW_ARRIVALS``) is what a low arrival finds behind a queued higher class.
    ``mode`` (``ADMISSION_MODES``) is ``full`` in production; ``queue-bound`` and ``off`` switch shedding
    off in part, for experiments (module doc).
    """

    def __init__(self, name: str, max_batch_size: int, concurrent_batches: int, queue_delay_ms: float,
                 meter: ThroughputMeter, workers: int = 1, mode: str = "full",
                 service: ServiceTime | None = None, prediction: str = "meter", riders_ahead: int = 0,
                 low_arrival: str = "queue") -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if mode not in ADMISSION_MODES:
            raise ValueError(f"admission mode {mode!r} is not one of {ADMISSION_MODES}")
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction {prediction!r} is not one of {PREDICTIONS}")
        if riders_ahead < 0:
            raise ValueError(f"riders_ahead must be at least 0, got {riders_ahead}")
        if low_arrival not in LOW_ARRIVALS:
            raise ValueError(f"low_arrival {low_arrival!r} is not one of {LOW_ARRIVALS}")
        #: What a low arrival finds while a request of a higher class is queued (``LOW_ARRIVALS``): ``idle-only``
        #: refuses it (``higher_priority_waiting``), ``queue`` gives it a place behind them.
        self.low_arrival = low_arrival
        #: Most higher-class images of other calls this worker may have dispatched (ahead of it in the runner) for
        #: waiting low tickets to ride in a call a higher class's image formed (``carry``).
        self.riders_ahead = riders_ahead
        #: How completion is predicted (``PREDICTIONS``): ``meter`` or ``service`` (``completion_s``).
        self.prediction = prediction
        self.name = name
        self.mode = mode
        self.max_batch_size = max_batch_size
        self.workers = workers
        #: This worker's share of one runner batch: images it counts as a batch.
        self.batch_share = max(1, max_batch_size // workers)
        #: This worker's share of the runner's dispatch window (one batch computing, one forming, per worker).
        self.window = max(1, (concurrent_batches + 1) * max_batch_size // workers)
        self.queue_delay_ms = queue_delay_ms
        self.meter = meter
        #: The runner's measured compute and overhead (``observe`` feeds it, ``/stats`` shows it); with
        #: ``prediction`` "service" they predict completion once observed, unless the throughput is fixed.
        self.service = service if service is not None else ServiceTime(1 / workers, concurrent_batches)
        self.dispatched = 0
        self.dispatched_low = 0  # of ``dispatched``, low-priority images
        self.queued = 0  # tickets reserved or waiting, not dispatched yet
        self.queued_by_rank = [0, 0, 0]  # the same, by class (0 high, 1 normal, 2 low)
        self._pending: dict[int, Ticket] = {}  # the queued tickets, in arrival order
        self._heap: list[tuple[int, int, Ticket]] = []
        self._seq = itertools.count()
        self.queued_by_bucket: dict[str, int] = {DECODING: 0}
        self.on_change: Callable[["AdmissionGate"], None] = lambda gate: None  # e.g. to update gauges

    @property
    def queued_high(self) -> int:
        """High-priority tickets queued."""
        return self.queued_by_rank[HIGH]

    #: Low-priority images dispatched at most at once, as a share of ``batch_share`` (``low_window``).
    LOW_BATCH_FRACTION = 1 / 16

    @property
    def low_window(self) -> int:
        """Most images dispatched at once while low ones are being dispatched: ``LOW_BATCH_FRACTION`` of a batch
        share (at least 1, and never more than the window less one batch share): 1 image with the primary's
        default batch of 16. A normal or high arrival then finds at most that many images ahead of it in the
        runner. Measured on the shared 2-core host (tests/server/test_low_priority.py), larger low windows
        pushed normal requests onto the fallback: with the window less one batch, and with a quarter batch
        (4 images, 0.4 s of work at the 10 img/s the loaded host gave), a normal arrival's predicted
        completion passed the primary's share of its 1 s deadline."""
        return max(1, min(int(self.batch_share * self.LOW_BATCH_FRACTION), self.window - self.batch_share))

    def window_for(self, rank: int) -> int:
        """The dispatch window for a ticket of class ``rank``: ``low_window`` for low, else ``window``."""
        return self.low_window if rank == LOW else self.window

    def queued_by_priority(self) -> dict[str, int]:
        """Queued tickets by class name, for ``/stats``."""
        return dict(zip(PRIORITIES, self.queued_by_rank))

    @property
    def queue_limit(self) -> int:
        """Most requests that may wait: throughput × ``queue_delay_ms``, at least one batch (``batch_share``)."""
        ips = self.meter.ips
        if ips is None:
            return self.batch_share
        return max(self.batch_share, int(ips * self.queue_delay_ms / 1000.0))

    def predicted_s(self, priority: str | bool) -> float:
        """Predicted seconds until a request of class ``priority`` arriving now is answered.

        See ``completion_s``; the images ahead are those dispatched plus those queued
        at its class or higher.
        """
        return self.completion_s(self.dispatched + self._ahead(priority_rank(priority)) + 1)

    def _ahead(self, rank: int) -> int:
        """Tickets queued at class ``rank`` or higher."""
        return sum(self.queued_by_rank[:rank + 1])

    def completion_s(self, images: int) -> float:
        """Predicted seconds until the last of ``images`` (the request itself and those ahead) is answered.

        When at least a full batch is in line, ``images`` is rounded up to whole
        batches, because a batch is answered only when all of it is done (this
        worker's images and time per image, so its ``batch_share``). Then images × the
        meter's time per image; with ``prediction`` "service", once the runner has
        answered and unless the throughput is fixed by configuration,
        ``ServiceTime.completion_s`` (overhead plus images × the runner's compute per
        image) instead. 0 before anything was measured.
        """
        if images > self.batch_share:
            images = math.ceil(images / self.batch_share) * self.batch_share
        if self._from_service():
            return self.service.completion_s(images)
        ms = self.meter.ms_per_image
        return 0.0 if ms is None else images * ms / 1000.0

    def _from_service(self) -> bool:
        """Whether ``ServiceTime`` predicts: ``prediction`` "service", an answer observed, no fixed throughput."""
        return self.prediction == "service" and self.service.ready and self.meter.override_ips <= 0

    def observe(self, latency_s: float, images_in_line: int, inference_ms: float, batch_size: int) -> None:
        """A runner answer for a dispatched image (in time or late): feeds ``service`` (``ServiceTime.observe``)."""
        self.service.observe(latency_s, images_in_line, inference_ms, batch_size)

    @property
    def compute_s_per_image(self) -> float | None:
        """Seconds per image this gate predicts with (s): the meter's time per image, or with ``prediction``
        "service" (``_from_service``) the runner's compute per image for this worker; None before a measurement."""
        if self._from_service():
            return self.service.compute_s
        ms = self.meter.ms_per_image
        return None if ms is None else ms / 1000.0

    def refusal(self, priority: str | bool, budget_s: float) -> Shed | None:
        """Why a request of class ``priority`` with ``budget_s`` seconds left would be shed now, or None when
        it may take a place; changes nothing.

        ``predicted_late`` when its predicted completion (``predicted_s``) is past
        ``budget_s``, unless the gate is idle (the meter may be stale);
        ``higher_priority_waiting`` for a low request while a normal or high one is
        queued, with ``low_arrival`` ``idle-only``; ``queue_full`` when ``window`` are dispatched and ``queue_limit``
        queued, unless a request of a lower class is queued (``reserve`` then evicts it).
        """
        rank = priority_rank(priority)
        predicted = self.predicted_s(rank)
        idle = self.dispatched == 0 and self._ahead(rank) == 0
        if self.predicts and predicted > budget_s and not idle:  # an idle model always gets a try: the meter may be stale
            return Shed("predicted_late", f"{self.name}: predicted {predicted * 1000:.0f} ms > {budget_s * 1000:.0f} ms left")
        if rank == LOW and self.low_arrival == "idle-only" and self._ahead(NORMAL) > 0 and self.mode != "off":
            return Shed("higher_priority_waiting",
                        f"{self.name}: {self._ahead(NORMAL)} requests of a higher class are queued; low priority "
                        "work only takes idle capacity")
        if self._full() and self._newest_below(rank) is None:
            return Shed("queue_full", f"{self.name}: {self.queued} requests queued, the limit is {self.queue_limit}")
        return None

    def has_room(self, priority: str | bool, budget_s: float) -> bool:
        """Whether ``reserve(priority, budget_s)`` would succeed now, without reserving anything."""
        return self.refusal(priority, budget_s) is None

    def reserve(self, priority: str | bool, budget_s: float) -> Ticket:
        """Admit a request of class ``priority`` (``PRIORITIES``, or a bool: True high) that has ``budget_s``
        seconds left, or raise the ``Shed`` of ``refusal`` at once.

        When the gate is full, the newest queued request of the lowest class below the
        arrival's (low, then normal) is evicted (shed with ``evicted``) and the arrival
        takes its place.
        """
        rank = priority_rank(priority)
        shed = self.refusal(rank, budget_s)
        if shed is not None:
            try:
                raise shed
            finally:  # this frame, in the traceback, must not hold the exception: no reference cycle
                del shed
        if self._full():
            self._evict(self._newest_below(rank))
        ticket = Ticket(self, rank, next(self._seq))
        self._pending[ticket.seq] = ticket
        self.queued += 1
        self.queued_by_rank[rank] += 1
        self.queued_by_bucket[DECODING] += 1
        self.on_change(self)
        return ticket

    @property
    def predicts(self) -> bool:
        """Whether the gate sheds requests predicted to finish late (``mode`` ``full``)."""
        return self.mode == "full"

    def _full(self) -> bool:
        """Whether the queue is at its bound (never with ``mode`` ``off``: the queue is unbounded)."""
        return self.mode != "off" and self.dispatched + self.queued >= self.window + self.queue_limit

    def drain_s(self) -> float:
        """Seconds until everything dispatched and queued now has been answered (0 before any measurement)."""
        return self.completion_s(self.dispatched + self.queued)

    @property
    def retry_after_cap_s(self) -> float:
        """The longest ``Retry-After`` this gate ever gives: the drain time of a full gate at the meter's floor.

        ``(window + queue_limit) × ms_per_image`` with the lowest throughput the meter
        can report (``ThroughputMeter.floor_ips``; with it the queue limit is at
        least one batch), rounded up to whole seconds, at least 1. Before the
        warm-up seed: 1 s.
        """
        floor = self.meter.floor_ips
        if floor is None:
            return 1.0
        queue_limit = max(self.batch_share, int(floor * self.queue_delay_ms / 1000.0))
        images = math.ceil((self.window + queue_limit) / self.batch_share) * self.batch_share
        return max(1.0, math.ceil(images / floor))

    def retry_after_s(self) -> float:
        """Seconds until the current queue has drained, in whole seconds, within 1..``retry_after_cap_s``.

        For ``Retry-After``: the drain time of what is dispatched and queued now
        (``drain_s``), never more than the drain time of a full gate.
        """
        return min(max(1.0, math.ceil(self.drain_s())), self.retry_after_cap_s)

    #: Entries of the dispatch heap beyond twice the queue (plus this many) are mostly of tickets that left it
    #: (cancelled, evicted, dispatched past their turn): ``_forget`` then drops them all.
    HEAP_SLACK = 64

    def _forget(self, ticket: Ticket) -> None:
        """Take ``ticket`` out of the queue. Its cargo goes with it (a request that hung up must not keep its pixels
        alive in the heap), and the heap is rebuilt without such tickets once they outnumber the queue: an entry
        leaves the heap only when it reaches the top, and a low ticket waiting there can hold the rest for up to
        ``max_deadline_ms``."""
        del self._pending[ticket.seq]
        ticket.cargo = None
        self.queued -= 1
        self.queued_by_rank[ticket.rank] -= 1
        self.queued_by_bucket[ticket.bucket] -= 1
        if len(self._heap) > 2 * self.queued + self.HEAP_SLACK:
            self._heap = [entry for entry in self._heap if entry[2].queued]
            heapq.heapify(self._heap)
        self.on_change(self)

    def _move(self, ticket: Ticket, bucket: str) -> None:
        if ticket.queued and bucket != ticket.bucket:
            self.queued_by_bucket[ticket.bucket] -= 1
            self.queued_by_bucket[bucket] = self.queued_by_bucket.get(bucket, 0) + 1
            ticket.bucket = bucket
            self.on_change(self)

    def completed(self) -> None:
        """One dispatched image was answered in time: feeds the throughput meter."""
        self.meter.completed()

    def _take(self, ticket: Ticket) -> None:
        self._forget(ticket)
        self.dispatched += 1
        self.dispatched_low += ticket.rank == LOW
        self.meter.busy(self.dispatched > 0)

    def _release(self, released: Ticket) -> None:
        self.dispatched -= 1
        self.dispatched_low -= released.rank == LOW
        self.meter.busy(self.dispatched > 0)
        while self._heap and self.dispatched < self.window:
            rank, _, ticket = self._heap[0]
            waiting = ticket.waiting
            if waiting and self.dispatched >= self.window_for(rank):
                break  # the rest of the heap is low priority too: it waits for the batch share to free up
            heapq.heappop(self._heap)
            if waiting:
                self._take(ticket)
                ticket.future.set_result(None)

    def carry(self, bucket: str, room: int, in_call: int, behind: int = 0,
              boards: Callable[[object], bool] = lambda cargo: True) -> list[tuple[Ticket, object]]:
        """Dispatch up to ``room`` waiting low tickets of ``bucket`` into a call being formed with ``in_call`` images
        of a higher class, and return them with their cargo, oldest first; each gets ``carried``, a new future for
        its result (and leaves its cargo with the caller: a dispatched ticket keeps none). A ticket whose cargo
        ``boards`` refuses (the caller's test: would it be answered in time in this call?) stays waiting.

        Low work rides only where it delays no image of a higher class that is already waiting: no ticket of a
        higher class waits for dispatch, none of this worker's images waits to be sent in a later call
        (``behind``, ``rampart.coalesce.Boarding``), and the window has room; and this gate has at most
        ``riders_ahead`` images of a higher class dispatched besides the ``in_call`` images: those are in calls
        already out, ahead of this one in the runner, which a rider does not delay (0: the call's images are the
        model's only higher-class work, as this worker sees the runner). A rider can still delay images that arrive
        while its call is in the runner, the longer the runner's backlog the more: docs/planning.md ("Riders")
        gives the measured trade. Up to the runner's compute batch size a batch costs less per image than one
        image alone (EfficientNet-Lite2 on the 2-core host, warm-up timing: 25.5 ms an image alone, 18.6 at two),
        so a rider costs the model less than its own call would, and delays the images in its call by that
        difference. Only tickets waiting with ``cargo`` (``turn``) ride.
        """
        higher = self.dispatched - self.dispatched_low
        if (room <= 0 or not self.queued_by_rank[LOW] or not 1 <= higher <= in_call + self.riders_ahead or behind
                or self._heap_has_waiters(NORMAL)):
            return []
        riders: list[tuple[Ticket, object]] = []
        for rank, _, ticket in sorted(self._heap):
            if len(riders) >= room or self.dispatched >= self.window:
                break
            if (rank == LOW and ticket.bucket == bucket and ticket.cargo is not None and ticket.waiting
                    and boards(ticket.cargo)):
                cargo = ticket.cargo
                self._take(ticket)
                ticket.carried = asyncio.get_running_loop().create_future()
                ticket.carried.add_done_callback(_retrieved)  # a rider whose request gave up never reads it
                riders.append((ticket, cargo))
        for ticket, _ in riders:  # left in the heap, dispatched: _release or _forget drops them from it
            ticket.future.set_result(None)
        return riders

    def _heap_has_waiters(self, rank: int) -> bool:
        """Whether a ticket of class ``rank`` or higher waits for dispatch (a lower one never holds it back)."""
        return any(t.waiting for r, _, t in self._heap if r <= rank)

    def _newest_below(self, rank: int) -> Ticket | None:
        """The ticket a full gate evicts for an arrival of class ``rank``: the newest queued one of the lowest
        class below ``rank`` (low first, then normal), or None."""
        for lower in range(LOW, rank, -1):
            if self.queued_by_rank[lower]:
                return next(ticket for ticket in reversed(self._pending.values()) if ticket.rank == lower)
        return None

    def _evict(self, ticket: Ticket) -> None:
        """Take ``ticket``'s place away; its ``turn()`` raises ``Shed("evicted")``."""
        self._forget(ticket)
        ticket.evicted = True
        if ticket.future is not None and not ticket.future.done():
            ticket.future.set_exception(Shed("evicted", f"{self.name}: evicted by a request of a higher priority class"))
