"""``bench.plan_check``: the figures a two-replica run is measured by, and how they are set against the plan."""

from __future__ import annotations

from bench.loadgen import Sample
from bench.plan_check import compare, measured_outcome
from rampart.plan.planner import FALLBACK, PRIMARY


def sample(status: int, model: str | None, latency_ms: float, deadline_ms: float = 1000.0) -> Sample:
    return Sample(0.0, latency_ms, status, model, None if model == PRIMARY else "primary_overloaded", False, deadline_ms)


def test_a_run_s_outcome_counts_only_answers_in_time_by_a_model():
    samples = ([sample(200, PRIMARY, 100)] * 6 + [sample(200, FALLBACK, 300)] * 2 + [sample(200, PRIMARY, 1500)]
               + [sample(429, None, 5)])
    outcome = measured_outcome(samples, 2.0)
    assert outcome["goodput_rps"] == 4.0 and outcome["offered_rps"] == 5.0
    assert (outcome["primary_share"], outcome["fallback_share"], outcome["shed_share"]) == (0.6, 0.2, 0.2)


def test_goodput_is_compared_relative_to_the_prediction_and_shares_as_differences():
    predicted = {"offered_rps": 20.0, "primary_share": 0.8, "fallback_share": 0.2, "shed_share": 0.0}
    measured = {"goodput_rps": 17.0, "primary_share": 0.7, "fallback_share": 0.15, "shed_share": 0.15}
    comparison = compare(predicted, measured)
    assert comparison["goodput_rps"] == {"predicted": 20.0, "measured": 17.0, "error": -0.15}
    assert comparison["shed_share"]["difference"] == 0.15 and comparison["primary_share"]["difference"] == -0.1
