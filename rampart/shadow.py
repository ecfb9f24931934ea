"""Shadow traffic: try a candidate model on live requests without touching their answers.

With ``shadow_model`` set, ``bentoml serve`` starts a third runner (``runners.shadow``)
and the entry service keeps one ``ShadowMirror``. For a ``/classify`` request that a
model answered, ``ShadowMirror.background`` draws with probability ``shadow_rate`` and,
if drawn, returns a Starlette ``BackgroundTask``: it runs only after the client's
response has been sent, and all it does is decide and start an asyncio task, so
nothing of the mirror is ever awaited by the request itself.

Mirrored work only uses idle capacity. When the task starts, the mirror is
skipped (``skipped_busy``) if either model's admission gate has any request queued
or a full batch dispatched (``models_busy``), for ``OVERLOAD_QUIET_S`` after any sign
of overload (a 429 reported through ``note_overload``, or an answer degraded with
``primary_overloaded``), or if the shadow already has ``shadow_max_inflight`` calls
outstanding (counted until the runner has replied or failed, not until the mirror
stopped waiting), and
``skipped_not_ready`` until the shadow runner has warmed up. The candidate gets the
pixels already decoded for the request (``rampart.inputs.decode_job.Prepared.inputs``, no
second decode): an input that already has the candidate's bucket shape, else the
primary's resized to it. Its call has its own deadline, ``shadow_deadline_ms``;
an error or a timeout is counted and logged, and never reaches any answer.

Each answered mirror is compared with the answer that was sent, by class name:
top-1 equal, and the share of the sent top-5 also in the candidate's top-5. A
disagreement on top-1 is logged as one line with the request id. Counters,
agreement and latency are in ``GET /stats`` (``shadow``) and in the
``rampart_shadow_*`` metrics.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from typing import Awaitable, Callable, Sequence

import numpy as np
from starlette.background import BackgroundTask

from rampart.inputs.buckets import Bucket, refit
from rampart.telemetry import metrics

__all__ = ["AnsweredBody", "ShadowMirror", "agreement", "shadow_input", "models_busy", "TOP_N"]

#: Disagreements, failures and readiness. BentoML's server logging passes only WARNING and up from
#: other loggers, so this one is set to INFO: a disagreement line is what the operator asked for.
logger = logging.getLogger("rampart.shadow")
logger.setLevel(logging.INFO)

#: Classes compared per answer ("top-5 overlap").
TOP_N = 5
#: Shadow latencies kept for the percentiles in ``/stats``.
LATENCY_WINDOW = 1000
#: How often the mirror asks a warming shadow runner whether it is ready, in seconds.
READY_POLL_S = 0.5
#: Mirrors pause this long after any sign of overload (a 429, or the primary shedding to the fallback), in
#: seconds: Rampart's shortest Retry-After, so the retries it asked for find no shadow work in their way.
OVERLOAD_QUIET_S = 1.0
#: Answers that say the primary was saturated: they pause mirroring like a 429 does.
OVERLOAD_REASONS = ("primary_overloaded",)


class AnsweredBody(dict):
    """A model's answer: the response body (a plain ``dict`` to every reader and to JSON) plus what produced it.

    ``role``: the lane that answered ("primary" or "fallback"); ``inputs``: the decoded
    pixels of every role, ``{role: (Bucket, uint8 H×W×3)}``; ``labels``: the answering
    model's class names; ``indices``: its most probable class indices, highest first
    (int array, at least ``TOP_N`` long for a 1000-class model).
    """

    def __init__(self, body: dict, role: str, inputs: dict[str, tuple[Bucket, np.ndarray]],
                 labels: Sequence[str], indices: np.ndarray) -> None:
        super().__init__(body)
        self.role, self.inputs, self.labels, self.indices = role, inputs, labels, indices

    def top_names(self, n: int = TOP_N) -> list[str]:
        """The class names of the answer's ``n`` most probable classes, highest first."""
        return [self.labels[int(i)] for i in self.indices[:n]]


def agreement(sent: Sequence[str], candidate: Sequence[str], n: int = TOP_N) -> tuple[bool, float]:
    """(top-1 equal, share of ``sent``'s top ``n`` class names also in ``candidate``'s top ``n``, 0..1).

    Both are class-name lists, most probable first; compared by name so a candidate
    with its own label order is compared fairly. Raises ``ValueError`` when either is empty.
    """
    if not sent or not candidate:
        raise ValueError("agreement needs at least one class on each side")
    return sent[0] == candidate[0], len(set(sent[:n]) & set(candidate[:n])) / n


def shadow_input(inputs: dict[str, tuple[Bucket, np.ndarray]], buckets: dict[str, Bucket]) -> tuple[Bucket, np.ndarray]:
    """The candidate's input from the request's decoded ``inputs`` (``Prepared.inputs``), without decoding again.

    The candidate's bucket has the same name (aspect ratio) as the primary's. An
    input already of that shape is used as is (the primary's first); otherwise the
    primary's pixels, already cropped to that aspect ratio, are resized (bicubic,
    ``rampart.inputs.buckets.refit``). Returns (Bucket, uint8 H×W×3).
    """
    primary_bucket, primary_pixels = inputs["primary"]
    target = buckets[primary_bucket.name]
    for _, (_, pixels) in sorted(inputs.items(), key=lambda item: item[0] != "primary"):
        if pixels.shape == target.shape:
            return target, pixels
    return target, refit(primary_pixels, target)


def models_busy(*lanes) -> Callable[[], bool]:
    """A check that is true while real traffic needs any of ``lanes`` (``ModelLane``): its admission gate has a
    request queued (waiting for its turn or still being decoded), or at least one full batch
    (``max_batch_size``) dispatched, that is, the model is working at its batch capacity.

    The second half matters at overload: the gate sheds on arrival what could not finish in
    time, so its queue can be empty while the model is saturated.
    """
    return lambda: any(lane.gate.queued or lane.gate.dispatched >= lane.gate.max_batch_size for lane in lanes)


class ShadowMirror:
    """Mirrors sampled answered requests to a candidate ``endpoint`` (``rampart.pipeline.ModelEndpoint``).

    ``busy()`` is true while real traffic needs the models (``models_busy``); ``ready_check(timeout_s)``
    is the shadow runner's readiness (BentoML's ``is_ready``), or None when it is in
    process and ready. ``rng`` draws the sample (``random.Random``; seeded in tests).
    """

    def __init__(self, endpoint, rate: float, deadline_ms: int, max_inflight: int, busy: Callable[[], bool],
                 ready_check: Callable[[float], Awaitable[bool]] | None = None,
                 rng: random.Random | None = None) -> None:
        self.endpoint = endpoint
        self.rate = rate
        self.deadline_s = deadline_ms / 1000.0
        self.max_inflight = max_inflight
        self.busy = busy
        self.ready_check = ready_check
        self.ready = ready_check is None
        self.rng = rng or random.Random()
        self.in_flight = 0
        self.sampled = 0
        self.mirrored = 0
        self.outcomes = dict.fromkeys(metrics.SHADOW_OUTCOMES, 0)
        self.top1_agreed = 0
        self.top5_overlap_sum = 0.0
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.overloaded_at = -OVERLOAD_QUIET_S
        self._tasks: set[asyncio.Task] = set()
        self._watch: asyncio.Task | None = None
        metrics.init_shadow_series()

    def background(self, request_id: str, result: dict) -> BackgroundTask | None:
        """For a response about to be sent: a task that mirrors it afterwards, or None (not a model's
        answer, or not drawn at ``rate``). Pass it as the response's ``background``."""
        if result.get("degraded_reason") in OVERLOAD_REASONS:
            self.note_overload()
        if not isinstance(result, AnsweredBody) or self.rng.random() >= self.rate:
            return None
        self.sampled += 1
        return BackgroundTask(self.start, request_id, result)

    def note_overload(self) -> None:
        """Record that real traffic was just shed (a 429): mirrors pause for ``OVERLOAD_QUIET_S``.

        The gates' state alone can look idle at overload: a request is refused on arrival
        when it could not finish in time, so the queues stay short, and every answer frees
        a place just before its mirror is considered.
        """
        self.overloaded_at = time.monotonic()

    async def start(self, request_id: str, result: AnsweredBody) -> None:
        """Start mirroring ``result`` unless the shadow is not ready or capacity is not idle; never waits for it."""
        if not self.ready:
            self._watch_readiness()
            return self._count("skipped_not_ready")
        if (self.in_flight >= self.max_inflight or self.busy()
                or time.monotonic() - self.overloaded_at < OVERLOAD_QUIET_S):
            return self._count("skipped_busy")
        self.in_flight += 1
        self.mirrored += 1
        task = asyncio.create_task(self._mirror(request_id, result))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mirror(self, request_id: str, result: AnsweredBody) -> None:
        released = False

        def release(call: asyncio.Future | None = None) -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
            if call is not None and not call.cancelled():
                call.exception()  # retrieved: a late failure is not "never retrieved"

        started, call = time.perf_counter(), None
        try:
            bucket, pixels = await asyncio.to_thread(shadow_input, result.inputs, self.endpoint.buckets)
            call = asyncio.ensure_future(self.endpoint.call(bucket.name, pixels, time.time() + self.deadline_s))
            call.add_done_callback(release)  # the slot stays taken until the runner is done with the item
            answer = await asyncio.wait_for(asyncio.shield(call), self.deadline_s - (time.perf_counter() - started))
        except asyncio.TimeoutError:
            return self._count("timeout")
        except Exception as exc:  # a shadow failure is counted and logged, never raised
            logger.warning("shadow %s failed for request %s: %s: %s", self.endpoint.name, request_id,
                           type(exc).__name__, exc)
            return self._count("error")
        finally:
            if call is None:
                release()
        if answer.expired:
            return self._count("timeout")
        latency_ms = (time.perf_counter() - started) * 1000.0
        sent = result.top_names()
        candidate = [self.endpoint.labels[int(i)] for i in np.argsort(-answer.probs)[:TOP_N]]
        top1, overlap = agreement(sent, candidate)
        self._count("compared")
        self.top1_agreed += top1
        self.top5_overlap_sum += overlap
        self.latencies_ms.append(latency_ms)
        metrics.SHADOW_TOP1_AGREED.labels(result.role).inc(top1)
        metrics.SHADOW_TOP5_OVERLAP.labels(result.role).observe(overlap)
        metrics.SHADOW_SECONDS.observe(latency_ms / 1000.0)
        if not top1:
            logger.info("shadow disagreement: request %s: sent %r (%s), candidate %s says %r; top-5 overlap %.1f",
                        request_id, sent[0], result.role, self.endpoint.name, candidate[0], overlap)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        metrics.SHADOW_REQUESTS.labels(outcome).inc()

    def _watch_readiness(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._wait_until_ready())

    async def _wait_until_ready(self) -> None:
        while not self.ready:
            try:
                self.ready = bool(await asyncio.wait_for(self.ready_check(5), 1.0))
            except Exception:  # still starting: refuses or holds the connection
                pass
            if not self.ready:
                await asyncio.sleep(READY_POLL_S)
        logger.info("shadow runner %s ready; mirroring %.0f%% of answered requests", self.endpoint.name,
                    self.rate * 100)

    def state(self) -> dict:
        """Counters, agreement and latency for ``GET /stats`` (see docs/overload.md, "Shadow traffic")."""
        compared = self.outcomes["compared"]
        latencies = np.asarray(self.latencies_ms)
        return {
            "model": self.endpoint.identity,
            "rate": self.rate,
            "ready": self.ready,
            "in_flight": self.in_flight,
            "max_inflight": self.max_inflight,
            "deadline_ms": round(self.deadline_s * 1000),
            "sampled": self.sampled,
            "mirrored": self.mirrored,
            "skipped_busy": self.outcomes["skipped_busy"],
            "skipped_not_ready": self.outcomes["skipped_not_ready"],
            "failed": {"error": self.outcomes["error"], "timeout": self.outcomes["timeout"]},
            "compared": compared,
            "top1_agreement": round(self.top1_agreed / compared, 4) if compared else None,
            "top5_overlap_mean": round(self.top5_overlap_sum / compared, 4) if compared else None,
            "latency_ms": None if not len(latencies) else {
                "mean": round(float(latencies.mean()), 2),
                **{f"p{q}": round(float(np.percentile(latencies, q)), 2) for q in (50, 90, 99)},
            },
        }
