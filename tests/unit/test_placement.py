"""``bench.placement``: the figures of one arm's round, from its samples (no server)."""

from __future__ import annotations

from bench.loadgen import Sample
from bench.placement import PRIMARY, arm_figures


def sample(status: int, model: str | None, latency_ms: float, degraded: str | None = None) -> Sample:
    return Sample(0.0, latency_ms, status, model, degraded, False, 1000.0)


def test_capacity_is_the_better_knee_step_of_primary_answers_in_time_and_overload_shares_are_of_it():
    knee = {4: [sample(200, PRIMARY, 300.0)] * 8 + [sample(200, "rampart-fallback", 50.0, "primary_queue_full")] * 4,
            8: [sample(200, PRIMARY, 900.0)] * 6 + [sample(200, PRIMARY, 1200.0)] * 6}  # late ones do not count
    overload = ([sample(200, PRIMARY, 500.0)] * 12 + [sample(200, "rampart-fallback", 100.0, "primary_queue_full")] * 18
                + [sample(429, None, 5.0)] * 30 + [sample(200, PRIMARY, 1500.0)] * 2)
    figures = arm_figures(knee, 2.0, overload, 3.0)
    assert figures["c_p"] == 4.0  # 8 in time in 2 s at 4 clients beats 6 in 2 s at 8
    assert figures["knee_steps"][8]["primary_rps"] == 3.0
    over = figures["overload_5x"]
    assert (over["primary_rps"], over["total_rps"]) == (4.0, 10.0)
    assert (over["primary_share_of_c_p"], over["total_share_of_c_p"]) == (1.0, 2.5)
    assert over["shed_429"] == 30 and over["errors_5xx"] == 0 and over["late"] == 2
