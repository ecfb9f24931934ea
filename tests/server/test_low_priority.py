"""The low priority class on a real server: it fills the primary's idle capacity and stays out of the way.

On the session ``server`` (default settings), all measured in this run by ``bench.low_priority.beside_normal``:
the primary's closed-loop capacity C_p; normal open-loop traffic at ``NORMAL_SHARE`` × C_p (C_p measured so far)
alone and beside a saturating low-priority closed loop, and C_p again, in rounds (phases interleaved,
so drift of the shared host falls on each alike); then normal traffic at 5 × C_p beside the
same low stream.
No wall-clock time is asserted: normal P99 is compared with normal P99 of the same run.
"""

from __future__ import annotations

import asyncio
import json

from bench.loadgen import load_bodies, summarize
from bench.low_priority import PRIMARY, beside_normal, side_by_side
from tests.support import SLACK_MS

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
#: host stalled sets the pooled P99. Five runs that evening: 0.93, 0.99, 1.02, 1.03 and 1.07. Those runs set the normal
#: rate from the first C_p measurement, which put it at 0.64-0.97 of the rounds' C_p; held at 0.8 of it (since
#: 2026-12-07 late), ten runs of the benchmark: 0.86-1.38, median 1.14, and three of this test: 1.66, 0.84 and 0.64
#: (docs/planning.md, "Measuring it at 0.8 C_p").
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
#: a call was in the primary runner 69% and 95% of two phases (docs/planning.md, "Worked example"). With low images
#: riding in normal calls (the default since 2026-12-07), three runs each way, alternated: 0.59, 0.72 and 0.62
#: against 0.37, 0.33 and 0.27 without (docs/planning.md, "Riders"). With a low arrival waiting behind queued normal
#: work instead of being refused (the default since 2026-12-07 evening), ten runs of the benchmark: 0.63-1.06,
#: median 0.91, against 0.36-0.93 (median 0.61) refused, alternated (docs/planning.md, "Waiting, not refused"); one
#: run of this test: 0.81. With the normal rate held at 0.8 C_p, ten runs: 0.64-1.30, median 0.80. The floor is half
#: the goal, under the least of those runs.
LOW_SHARE_FLOOR = 0.4
OVERLOAD_FACTOR = 5.0
OVERLOAD_S = 5.0


def test_low_priority_fills_idle_capacity_without_slowing_normal_traffic_and_never_takes_the_fallback(server):
    bodies = load_bodies()
    report, samples = beside_normal(server.url, bodies)
    alone, beside, low, c_p = samples["alone"], samples["beside"], samples["low"], samples["c_p"]
    assert c_p > 0, report
    print("low priority beside normal:", json.dumps(report))
    assert not [s for s in low if s.model not in (PRIMARY, None)], report  # never the fallback
    assert all(s.status in (200, 429) for s in alone + beside + low), report
    assert report["p99_beside_ms"] <= P99_RATIO * report["p99_alone_ms"], report
    assert report["normal_by_primary_beside"] >= DISPLACED_RATIO * report["normal_by_primary_alone"], report
    assert report["low_rps"] >= LOW_SHARE_FLOOR * (report["c_p_in_rounds"] - report["normal_rate"]), report
    assert report["low_riders"] > 0, report  # low images rode in normal calls

    normal, low = asyncio.run(side_by_side(f"{server.url}/classify", bodies, OVERLOAD_FACTOR * c_p, OVERLOAD_S, seed=7,
                                           low=True))
    overload = {"normal": summarize(normal, OVERLOAD_S), "low": summarize(low, OVERLOAD_S)}
    print("low priority at 5x overload:", json.dumps(overload))
    assert low and all(s.status in (200, 429) for s in low), overload
    refused = [s for s in low if s.status == 429]
    assert all(s.retry_after_s is not None and s.retry_after_s >= 1 for s in refused), overload
    answered = [s for s in low if s.status == 200]
    assert all(s.model == PRIMARY and s.degraded_reason is None for s in answered), overload  # no fallback, no static
    assert all(s.latency_ms <= s.deadline_ms + SLACK_MS for s in answered), overload
