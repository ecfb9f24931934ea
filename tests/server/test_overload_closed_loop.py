"""Closed-loop overload without after-effects, deadlines from arrival, Retry-After after idle: one real server.

The server has a shortened throughput-meter time constant (``RAMPART_THROUGHPUT_TAU_MS``
1000 instead of 5000) so that the idle-then-burst check can idle for 5 time constants
in 5 s. Each closed-loop sequence is: 1 connection (the reference), 64 connections,
256 connections (5 s each: 5 meter time constants, so every learned state has settled at its
overload value), then 1 connection again; the load comes from this process
(``bench.loadgen``). No wall-clock time is asserted: latency after the overload is
compared with latency before it in the same run, and deadlines with the documented
slack.
"""

from __future__ import annotations

import math
import time

import httpx
import numpy as np
import pytest

from bench.loadgen import burst, closed_loop_round, load_bodies, run_sync
from bench.harness import Replica
from tests.support import encode, photo

DEADLINE_MS = 1000
REFERENCE_S = 5.0
OVERLOAD_S = 5.0
AFTER_S = 10.0
TAU_MS = 1000
#: Single-connection latency after the overload may be at most this multiple of the one before it (no after-effects of an overload).
AFTER_EFFECT_RATIO = 1.5
#: ... and from this many seconds after the overload on (recovery "within 5 s").
RECOVERY_S = 5.0


@pytest.fixture(scope="module")
def tau_server(tmp_path_factory, stop_in_background):
    """Rampart with a 1 s throughput time constant; stopped when this module ends."""
    server = Replica("serve", tmp_path_factory.mktemp("serve"), {"RAMPART_THROUGHPUT_TAU_MS": str(TAU_MS)})
    try:
        server.wait_ready()
        answered_by_primary(server)
        yield server
    finally:
        stop_in_background(server)


def answered_by_primary(server: Replica, timeout_s: float = 120) -> None:
    """Wait until the primary answers three times in a row, then for the loop-lag window (2 s) to pass.

    On a loaded host the first requests after readiness pay for cold code paths and
    can stall the event loop; the deadline checks below must not start in that.
    """
    body, deadline, in_a_row = encode(photo("coffee")), time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and in_a_row < 3:
        answer = httpx.post(f"{server.url}/classify", content=body, timeout=30).json()
        in_a_row = in_a_row + 1 if answer.get("degraded_reason") is None else 0
        time.sleep(0.5)
    if in_a_row < 3:
        raise RuntimeError(f"the primary did not answer within {timeout_s} s:\n{server.log()}")
    time.sleep(2.5)


def stats(server: Replica) -> dict:
    return httpx.get(f"{server.url}/stats", timeout=10).json()


def test_x_request_start_counts_against_the_deadline(tau_server):
    """A request that spent 400 ms in front of Rampart has 400 ms less budget; past its deadline it is shed."""
    body = encode(photo("chelsea"))

    def post(deadline_ms: int, age_ms: float | None) -> httpx.Response:
        headers = {"X-Deadline-Ms": str(deadline_ms)}
        if age_ms is not None:  # nginx's "t=${msec}": epoch seconds with millisecond resolution
            headers["X-Request-Start"] = f"t={time.time() - age_ms / 1000:.3f}"
        return httpx.post(f"{tau_server.url}/classify", content=body, headers=headers, timeout=30)

    fresh = post(650, None)
    assert fresh.status_code == 200 and fresh.json()["degraded_reason"] is None, fresh.text
    assert fresh.json()["timings_ms"]["before_handler"] < 400
    # 650 ms less 400 ms leaves less than the primary's share (deadline minus the 250 ms fallback reserve)
    old = post(650, 400)
    assert old.status_code == 200, old.text
    assert old.json()["degraded_reason"] == "primary_timeout" and old.json()["model"]["name"] == "rampart-fallback"
    assert old.json()["timings_ms"]["before_handler"] >= 400
    assert "before_handler;dur=" in old.headers["Server-Timing"]
    # Older than its whole deadline: shed at once with 429, as if the budget were spent.
    late = post(350, 400)
    assert late.status_code == 429 and late.json()["error"]["code"] == "overloaded", late.text
    # A stamp from the future or beyond any deadline is ignored (a clock problem, not a request).
    for age_ms in (-60_000, 3_600_000):
        ignored = post(650, age_ms)
        assert ignored.status_code == 200 and ignored.json()["degraded_reason"] is None, ignored.text


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_closed_loop_overload_leaves_no_after_effect(tau_server, client):
    bodies = load_bodies()
    url = f"{tau_server.url}/classify"
    before = run_sync(closed_loop_round(url, bodies, 1, REFERENCE_S, DEADLINE_MS, client))
    overloads = [run_sync(closed_loop_round(url, bodies, n, OVERLOAD_S, DEADLINE_MS, client)) for n in (64, 256)]
    state = stats(tau_server)
    after = run_sync(closed_loop_round(url, bodies, 1, AFTER_S, DEADLINE_MS, client))

    report = {"before": before.summary(), "overloads": [r.summary() for r in overloads], "after": after.summary(),
              "stats": state}
    for overload in overloads:
        summary = overload.summary()
        assert summary["requests"] > overload.connections, report  # the load really was offered
        assert summary["errors_5xx"] == 0, report
        # Busy is not broken: the breaker never opens on overload alone.
        assert not [s for s in overload.samples if s.degraded_reason == "primary_circuit_open"], report
        # An efficient client measures the server. httpx at 256 connections spends 12-18 ms of CPU per
        # request on this machine and measures itself: it reads answers late and may hit its own timeout.
        if client == "aiohttp":
            assert summary["failed"] == 0, report  # no resets, no refused connections
            assert {s.status for s in overload.samples} <= {200, 429}, report
            assert summary["late_200"] == 0, report
    assert state["primary"]["breaker"] == "closed" and state["primary"]["breaker_opened"] == 0, report

    def median_waiting_ms(run, from_s: float = 0.0) -> float:
        """Median client latency of the 200s sent ``from_s`` or later into the round, less the model's
        own compute time. Every after-effect this test looks for is waiting (a learned batching delay,
        a shed, an open breaker, a lag reserve), never computing; compute time is what other processes
        on a shared host vary."""
        times = [s.latency_ms - (s.inference_ms or 0.0) for s in run.samples if s.status == 200 and s.sent_s >= from_s]
        assert len(times) >= 5, report
        return float(np.median(times))

    report["median_latency_ms"] = {name: float(np.median([s.latency_ms for s in run.samples]))
                                   for name, run in (("before", before), ("after", after))}
    report["median_waiting_ms"] = {"before": median_waiting_ms(before), "after": median_waiting_ms(after)}

    # Full answers again (before the fix, 13 of 45 were degraded); a rare loop-lag spike on a shared host may degrade one.
    assert all(s.status == 200 for s in after.samples), report
    assert sum(s.degraded_reason is not None for s in after.samples) <= 0.05 * len(after.samples), report
    assert median_waiting_ms(after) <= AFTER_EFFECT_RATIO * median_waiting_ms(before), report
    assert median_waiting_ms(after, RECOVERY_S) <= AFTER_EFFECT_RATIO * median_waiting_ms(before), report
    print(client, {k: report[k] for k in ("median_latency_ms", "median_waiting_ms")},
          [(r["connections"], r["p50_ms"], r["shed_rate"], r["late_200"], r["client_cpu_ms_per_request"])
           for r in (report["before"], *report["overloads"], report["after"])])


def test_retry_after_stays_bounded_after_idle(tau_server):
    """Idle for 5 meter time constants, then 200 requests at once: every Retry-After within the cap and the drain time."""
    bodies = load_bodies()
    url = f"{tau_server.url}/classify"
    run_sync(closed_loop_round(url, bodies, 16, 2.0, DEADLINE_MS))  # the meters measure something first
    time.sleep(5 * TAU_MS / 1000)
    idle = stats(tau_server)
    samples = run_sync(burst(url, bodies, 200, DEADLINE_MS))
    after = stats(tau_server)

    def drain_bound_s(state: dict) -> float:  # Retry-After: the sooner of the two models' full-queue drain times
        return min(max(1, math.ceil((lane["dispatch_window"] + lane["queue_limit"]) / lane["throughput_ips"]))
                   for lane in (state["primary"], state["fallback"]))

    shed = [s for s in samples if s.status == 429]
    report = {"idle": idle, "after": after, "retry_after": sorted({s.retry_after_s for s in shed})}
    assert shed and all(s.status in (200, 429) for s in samples), report
    cap = max(idle["primary"]["retry_after_cap_s"], after["primary"]["retry_after_cap_s"])
    bound = max(drain_bound_s(idle), drain_bound_s(after))
    assert all(s.retry_after_s is not None and 1 <= s.retry_after_s <= min(cap, bound) for s in shed), report
