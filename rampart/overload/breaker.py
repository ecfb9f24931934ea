"""A circuit breaker for the primary model.

- **closed**: calls go through; outcomes are kept for ``window_s``. When at least
  ``min_calls`` outcomes are in the window and the share of failures (errors,
  timeouts, TTL drops) reaches ``failure_rate``, the breaker opens.
- **open**: calls are refused (the pipeline goes straight to the fallback) for
  ``open_s``.
- **half_open**: up to ``probes`` calls at a time go through as probes; ``probes``
  successes in a row close the breaker, one failure opens it again.

Busy is not broken. Load shedding is not a failure: only calls that reached the
model count. The pipeline counts a timeout as a failure only when the runner
sent nothing back at all while the call waited (no answer, not even a late one
for a caller that had given up, and no TTL drop) and has been silent for longer
than two full batches at its last measured speed (see
``rampart.lane.ModelLane``). An overloaded model keeps answering, only not
in time for everyone, so overload alone never opens the breaker; a hung model
(nothing comes back) or a failing one (errors) does. A model that is merely slow
is the admission gate's business: its measured throughput falls and requests go
to the fallback as ``primary_overloaded``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

__all__ = ["CircuitBreaker", "CLOSED", "OPEN", "HALF_OPEN", "STATE_VALUES"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
#: Numeric value of each state, for the ``rampart_circuit_breaker_state`` gauge.
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class CircuitBreaker:
    """Closed → open on a failure rate over a time window; half-open probes close it again.

    Call ``allow()`` before a call; when it returns True, call ``record(ok)`` exactly
    once afterwards, or ``cancel()`` if the call never reached the model. ``would_allow()``
    asks the same question without taking a probe.
    """

    def __init__(self, window_s: float = 10.0, min_calls: int = 10, failure_rate: float = 0.5,
                 open_s: float = 5.0, probes: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.min_calls = min_calls
        self.failure_rate = failure_rate
        self.open_s = open_s
        self.probes = probes
        self.clock = clock
        self._state = CLOSED
        self._outcomes: deque[tuple[float, bool]] = deque()
        self._failures = 0  # the failures among _outcomes, kept as they come and go (no sum over the window)
        self._opened_at = 0.0
        self._probes_in_flight = 0
        self._probe_successes = 0
        self.times_opened = 0

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open``; an open breaker turns half-open once ``open_s`` has passed."""
        if self._state == OPEN and self.clock() - self._opened_at >= self.open_s:
            self._state = HALF_OPEN
            self._probes_in_flight = self._probe_successes = 0
        return self._state

    def would_allow(self) -> bool:
        """Whether ``allow()`` would return True now (closed, or half-open with a probe free); changes nothing."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and self._probes_in_flight < self.probes)

    def allow(self) -> bool:
        """Whether a call may go to the model now; in half-open the call takes one of the ``probes`` probes."""
        if not self.would_allow():
            return False
        if self._state == HALF_OPEN:
            self._probes_in_flight += 1
        return True

    def record(self, ok: bool) -> None:
        """The outcome of an allowed call: ``ok`` False for an error, timeout or TTL drop."""
        now = self.clock()
        if self._state == HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
            if not ok:
                self._open(now)
                return
            self._probe_successes += 1
            if self._probe_successes >= self.probes:
                self._state = CLOSED
                self._forget_outcomes()
            return
        if self._state == OPEN:
            return  # a call from before the breaker opened
        self._outcomes.append((now, ok))
        self._failures += not ok
        while self._outcomes and self._outcomes[0][0] < now - self.window_s:
            self._failures -= not self._outcomes.popleft()[1]
        if len(self._outcomes) >= self.min_calls and self._failures >= self.failure_rate * len(self._outcomes):
            self._open(now)

    def _forget_outcomes(self) -> None:
        self._outcomes.clear()
        self._failures = 0

    def cancel(self) -> None:
        """An allowed call never reached the model (it was shed): forget it."""
        if self._state == HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)

    def _open(self, now: float) -> None:
        self._state = OPEN
        self._opened_at = now
        self._forget_outcomes()
        self.times_opened += 1
