"""``rampart.overload.breaker``: the circuit breaker opens on its failure rate, probes half-open, and counts
only calls that reached the model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rampart.overload.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


def test_breaker_opens_on_failure_rate_then_half_open_probes_close_it():
    now = [0.0]
    breaker = CircuitBreaker(window_s=10, min_calls=4, failure_rate=0.5, open_s=5, probes=2, clock=lambda: now[0])
    for ok in (True, False, True, False):
        assert breaker.allow()
        breaker.record(ok)
    assert breaker.state == OPEN and not breaker.allow()
    now[0] = 6.0
    assert breaker.state == HALF_OPEN
    assert breaker.allow() and breaker.allow() and not breaker.allow()  # two probes at a time
    breaker.record(True)
    breaker.record(True)
    assert breaker.state == CLOSED


def test_breaker_reopens_on_a_failed_probe_and_ignores_shed_calls():
    now = [0.0]
    breaker = CircuitBreaker(window_s=10, min_calls=2, failure_rate=0.5, open_s=1, probes=1, clock=lambda: now[0])
    for _ in range(10):
        assert breaker.allow()
        breaker.cancel()  # shed before reaching the model: not a failure
    assert breaker.state == CLOSED
    breaker.record(False)
    breaker.record(False)
    now[0] = 2.0
    assert breaker.allow()
    breaker.record(False)
    assert breaker.state == OPEN and breaker.times_opened == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.booleans()), max_size=300))
def test_the_failure_count_is_the_windows_own_at_every_call(calls):
    """The breaker keeps its failure count as outcomes enter and leave the window; it opens exactly when a
    recount of the window's outcomes says it should."""
    now = [0.0]
    breaker = CircuitBreaker(window_s=5, min_calls=4, failure_rate=0.5, open_s=2, probes=1, clock=lambda: now[0])
    window: list[tuple[float, bool]] = []
    for step, ok in calls:
        now[0] += step
        if breaker.state != CLOSED:
            window.clear()
            breaker.record(ok)
            continue
        window = [(at, good) for at, good in window + [(now[0], ok)] if at >= now[0] - 5]
        should_open = len(window) >= 4 and sum(not good for _, good in window) >= 0.5 * len(window)
        breaker.record(ok)
        assert (breaker.state == OPEN) == should_open
        if should_open:
            window.clear()
