"""Client-side back-off: adaptive throttling, a retry budget, Retry-After and deadlines.

When every replica sheds, a client that keeps sending only adds to the overload:
each refused request still costs the server a read and an answer. ``Backoff``
keeps the client's share of that waste bounded, with three rules:

- **Adaptive throttling** (Google SRE book, "Handling Overload", client-side
  throttling): over a sliding window the client counts ``requests`` (every attempt
  the application made, including those it refused itself) and ``accepts`` (attempts
  the server took: anything but an overload refusal or a transport failure). An attempt
  counts once its outcome is known, so requests still in flight do not look like refusals
  to a burst of concurrent calls. A new attempt is refused locally, raising ``Throttled``, with probability
  ``min(max_reject_probability, max(0, (requests - K * accepts) / (requests + 1)))``, K = 2;
  so in a sustained overload the server receives about K times what it accepts. The throttle
  starts only once the window holds ``min_requests`` (20) requests: a ratio of three requests
  says nothing about a backend, and a fresh client that met one refusal must not refuse its
  own next calls. The odds are capped at ``max_reject_probability`` (0.9) over a window of
  30 s (Envoy's admission control caps them at 0.8 over 30 s): with the book's two minutes and
  no cap, a client calling 20 times a second through a 30 s outage refused every call of its
  own for minutes after the server was back, since its own refusals kept the odds at 0.99 and
  at that rate too few attempts went out to bring them down (simulated: none of the next 150 s
  of calls got through; with the cap and window, 45% of them in the third 15 s after, 93% in
  the fourth, all after).
- **Only overload counts as a refusal**: a 429 whose ``cause`` is ``deadline`` (the request's
  own deadline was used up before the server could start on it, ``Overloaded.cause``)
  and every other 4xx are answers about the request, counted as accepts and not retried.
- **Retry budget**: at most ``max_attempts`` (3) attempts per call, and retries at
  most ``retry_budget_ratio`` (10%) of the calls in the window (the Finagle/gRPC
  retry-budget rule), so retries can never multiply the load.
- **Deadlines**: a retry waits for ``Retry-After`` when the server sent one
  (``Overloaded.retry_after``; Rampart's is at least 1 s), else a short jittered
  exponential delay, and is sent only if the call's own deadline then still has
  ``min_remaining_ms`` left; it carries the remaining budget in ``X-Deadline-Ms``.

Retried: 429 (``Overloaded``), 502/503/504 and transport failures (``ServiceError``
with ``status`` None): a replica that is full, draining or gone. Never retried: other
4xx (the request itself is wrong) and 500 (a bug answers the same way again).

``Backoff.stats()`` gives the counters, like the server's ``/stats``. The policy is
plain Python over an injectable clock and random source, so it is tested without a
server; ``call_sync`` / ``call_async`` run one call through it.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable, TypeVar

from .errors import Overloaded, RampartClientError, ServiceError, Throttled

__all__ = ["BackoffPolicy", "Backoff", "Call"]

T = TypeVar("T")

#: Statuses of a ``ServiceError`` that mean "this replica cannot answer now" (gateway errors, draining).
RETRYABLE_SERVICE_STATUSES = frozenset({None, 502, 503, 504})


@dataclass(frozen=True)
class BackoffPolicy:
    """Settings of ``Backoff``; every field is validated on construction (``ValueError`` names it).

    - ``k``: the SRE throttling multiplier (2: the book's recommended value).
    - ``window_s``: sliding window of the throttle and the retry budget, seconds (30: the book keeps
      two minutes of history, which with the client's own refusals counted recovers too slowly; above).
    - ``max_attempts``: attempts per call, the first included (3).
    - ``retry_budget_ratio``: retries allowed per call in the window (0.1: at most 10% extra load).
    - ``default_deadline_ms``: a call's deadline when the caller gives none: Rampart's
      ``RAMPART_DEFAULT_DEADLINE_MS`` default, 1000 ms.
    - ``min_remaining_ms``: a retry is sent only if at least this much of the deadline is left
      when it leaves (100 ms: below that Rampart can only shed it or answer degraded).
    - ``base_delay_ms`` / ``max_delay_ms``: the jittered exponential delay before a retry that
      has no ``Retry-After`` (25 ms doubling, full jitter, capped at 1 s).
    - ``throttle``: turns the local rejection off (the counters still count).
    - ``min_requests``: the throttle refuses nothing while the window holds fewer requests (20).
    - ``max_reject_probability``: the throttle's odds never exceed this (0.9), so some attempts always go
      out and the client learns that the service is back.
    """

    k: float = 2.0
    window_s: float = 30.0
    max_attempts: int = 3
    retry_budget_ratio: float = 0.1
    default_deadline_ms: float = 1000.0
    min_remaining_ms: float = 100.0
    base_delay_ms: float = 25.0
    max_delay_ms: float = 1000.0
    throttle: bool = True
    min_requests: int = 20
    max_reject_probability: float = 0.9

    @classmethod
    def disabled(cls) -> "BackoffPolicy":
        """One attempt per call and no local rejection: the client as it was; the counters still count."""
        return cls(max_attempts=1, throttle=False)

    def __post_init__(self) -> None:
        checks = {
            "k": self.k >= 1.0, "window_s": self.window_s > 0, "max_attempts": self.max_attempts >= 1,
            "retry_budget_ratio": self.retry_budget_ratio >= 0, "default_deadline_ms": self.default_deadline_ms > 0,
            "min_remaining_ms": self.min_remaining_ms >= 0, "base_delay_ms": self.base_delay_ms >= 0,
            "max_delay_ms": self.max_delay_ms >= self.base_delay_ms, "min_requests": self.min_requests >= 0,
            "max_reject_probability": 0.0 <= self.max_reject_probability <= 1.0,
        }
        bad = [f"{name}={getattr(self, name)!r}" for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid BackoffPolicy: {', '.join(bad)}")


class _Window:
    """Event counts over the last ``window_s`` seconds, in 1-second slots (at most ``window_s`` + 1 kept)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._slots: collections.deque[tuple[int, collections.Counter]] = collections.deque()

    def _expire(self, now: float) -> None:
        oldest = math.floor(now - self.window_s)
        while self._slots and self._slots[0][0] < oldest:
            self._slots.popleft()

    def add(self, now: float, **counts: int) -> None:
        self._expire(now)
        second = math.floor(now)
        if not self._slots or self._slots[-1][0] != second:
            self._slots.append((second, collections.Counter()))
        self._slots[-1][1].update(counts)

    def totals(self, now: float) -> collections.Counter:
        self._expire(now)
        total: collections.Counter = collections.Counter()
        for _, counts in self._slots:
            total.update(counts)
        return total


class Backoff:
    """The shared state of one client: the throttle's window, the retry budget and the counters.

    ``clock`` returns seconds (``time.monotonic``); ``rng`` draws the throttle's coin and the
    jitter. Thread-safe: a sync client may be shared by threads.
    """

    def __init__(self, policy: BackoffPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.policy = policy or BackoffPolicy()
        self.clock = clock
        self.rng = rng or random.Random()
        self._window = _Window(self.policy.window_s)
        self._lock = threading.Lock()
        self._totals: collections.Counter = collections.Counter()

    def _count(self, **counts: int) -> None:
        self._window.add(self.clock(), **counts)
        self._totals.update(counts)

    def reject_probability(self) -> float:
        """``max(0, (requests - K * accepts) / (requests + 1))`` over the window, at most
        ``max_reject_probability``; 0 while the window holds fewer than ``min_requests`` requests."""
        with self._lock:
            window = self._window.totals(self.clock())
        if window["requests"] < self.policy.min_requests:
            return 0.0
        odds = max(0.0, (window["requests"] - self.policy.k * window["accepts"]) / (window["requests"] + 1))
        return min(self.policy.max_reject_probability, odds)

    def start(self, deadline_ms: float | None) -> "Call":
        """A new call with ``deadline_ms`` (the policy's default when None), starting now."""
        with self._lock:
            self._count(calls=1)
        return Call(self, deadline_ms)

    def stats(self) -> dict:
        """Counters since the client was made, and the window's view now.

        ``calls``: classify calls; ``attempts``: requests sent; ``accepts``: attempts the server
        took; ``throttled``: attempts refused locally; ``retries``; ``retries_denied_budget`` /
        ``_deadline`` / ``_attempts``: retries not sent and why; ``reject_probability``: the
        throttle's odds now; ``window``: the same counts over the last ``window_s``.
        """
        probability = self.reject_probability()
        with self._lock:
            window = self._window.totals(self.clock())
            keys = ("calls", "attempts", "accepts", "throttled", "retries", "retries_denied_budget",
                    "retries_denied_deadline", "retries_denied_attempts")
            return {
                **{key: self._totals[key] for key in keys},
                "reject_probability": round(probability, 4),
                "window": {key: window[key] for key in ("calls", "requests", "accepts", "retries")},
                "policy": asdict(self.policy),
            }

    def call_sync(self, send: Callable[[float | None], T], deadline_ms: float | None) -> T:
        """Run ``send(x_deadline_ms)`` under the policy: retried as allowed, sleeping in between.

        ``send`` makes one attempt with the ``X-Deadline-Ms`` value it is given (None: send
        none) and raises a ``RampartClientError`` on failure. Raises ``Throttled`` when an
        attempt is refused locally, else the last attempt's error.
        """
        call = self.start(deadline_ms)
        while True:
            header = call.begin_attempt()
            try:
                result = send(header)
            except RampartClientError as exc:
                delay = call.failed(exc)
                if delay is None:
                    raise
                time.sleep(delay)
                continue
            call.succeeded()
            return result

    async def call_async(self, send: Callable[[float | None], Awaitable[T]], deadline_ms: float | None) -> T:
        """The asyncio twin of ``call_sync``: ``send`` is awaited, the delays are ``asyncio.sleep``."""
        call = self.start(deadline_ms)
        while True:
            try:
                header = call.begin_attempt()
            except Throttled:
                await asyncio.sleep(0)  # a local refusal still yields: a caller retrying at once must not starve its
                raise                   # own calls in flight of the event loop
            try:
                result = await send(header)
            except RampartClientError as exc:
                delay = call.failed(exc)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                continue
            call.succeeded()
            return result


class Call:
    """One logical request: its deadline, attempts so far, and the decisions between them."""

    def __init__(self, backoff: Backoff, deadline_ms: float | None) -> None:
        self.backoff = backoff
        self.explicit_deadline = deadline_ms is not None
        self.deadline_ms = float(deadline_ms) if deadline_ms is not None else backoff.policy.default_deadline_ms
        self.started = backoff.clock()
        self.attempts = 0

    def remaining_ms(self) -> float:
        """Milliseconds left of the call's deadline (negative once it has passed)."""
        return self.deadline_ms - (self.backoff.clock() - self.started) * 1000.0

    def begin_attempt(self) -> float | None:
        """Count an attempt and return its ``X-Deadline-Ms`` (None on a first attempt without a deadline).

        Raises ``Throttled`` when the adaptive throttle refuses it locally.
        """
        b = self.backoff
        probability = b.reject_probability() if b.policy.throttle else 0.0
        with b._lock:
            if probability > 0 and b.rng.random() < probability:
                b._count(requests=1, throttled=1)
                raise Throttled(
                    f"refused by the client's adaptive throttle (p={probability:.2f}): the service is shedding",
                    retry_after=1.0, code="client_throttled",
                )
            b._count(attempts=1)
            if self.attempts:
                b._count(retries=1)
        self.attempts += 1
        if self.attempts == 1:
            return self.deadline_ms if self.explicit_deadline else None
        return max(1, math.floor(self.remaining_ms()))

    def succeeded(self) -> None:
        """The attempt got an answer the server took (a result, or a 4xx about the request)."""
        with self.backoff._lock:
            self.backoff._count(requests=1, accepts=1)

    def failed(self, error: RampartClientError) -> float | None:
        """Seconds to wait before the next attempt, or None: give up and raise ``error``."""
        b, policy = self.backoff, self.backoff.policy
        if isinstance(error, Throttled):
            return None  # refused locally (already counted): the throttle's answer stands for this call
        retryable = (isinstance(error, Overloaded) and error.cause != "deadline") or (
            isinstance(error, ServiceError) and error.status in RETRYABLE_SERVICE_STATUSES)
        with b._lock:
            if not retryable:
                b._count(requests=1, accepts=1)  # the server answered about the request itself (its deadline too)
                return None
            b._count(requests=1)
            if self.attempts >= policy.max_attempts:
                b._count(retries_denied_attempts=1)
                return None
            retry_after = float(error.retry_after or 0)
            if retry_after > 0 and math.isfinite(retry_after):  # honoured as sent: Overloaded always has one,
                delay_s = retry_after                           # a draining 503 may (NaN or inf: not a delay)
            else:
                cap_ms = min(policy.max_delay_ms, policy.base_delay_ms * 2 ** (self.attempts - 1))
                delay_s = b.rng.uniform(0, cap_ms) / 1000.0
            if self.remaining_ms() - delay_s * 1000.0 < policy.min_remaining_ms:
                b._count(retries_denied_deadline=1)
                return None
            window = b._window.totals(b.clock())
            if window["retries"] + 1 > policy.retry_budget_ratio * window["calls"]:
                b._count(retries_denied_budget=1)
                return None
        return delay_s
