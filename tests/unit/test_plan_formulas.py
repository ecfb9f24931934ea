"""``rampart.plan.formulas``: the capacity planner's rules on known inputs."""

from __future__ import annotations

import pytest

from rampart.plan import formulas


def test_queue_places_are_throughput_times_the_acceptable_delay_the_seed_rule():
    assert formulas.queue_places(200, 200) == 40  # 200 img/s x 0.2 s
    assert formulas.queue_places(10, 200, least=16) == 16  # never below one batch
    with pytest.raises(ValueError):
        formulas.queue_places(0, 200)


def test_queue_delay_is_what_the_p99_target_leaves_after_the_service_time():
    assert formulas.queue_delay_ms(500, 120, deadline_ms=1000, reserve_ms=250, margin_ms=20) == 380
    # the primary's share of the deadline (1000 - 250 - 20 = 730) caps it: 730 - 120 = 610, rounded down to 10 ms
    assert formulas.queue_delay_ms(2000, 120, deadline_ms=1000, reserve_ms=250, margin_ms=20) == 610
    assert formulas.queue_delay_ms(100, 120, deadline_ms=1000, reserve_ms=250, margin_ms=20) == 20  # the floor


def test_fallback_reserve_is_twice_its_batch_time_within_bounds():
    assert formulas.fallback_reserve_ms(61, 1000) == 130  # 122 rounded up to 10 ms
    assert formulas.fallback_reserve_ms(10, 1000) == 50
    assert formulas.fallback_reserve_ms(900, 1000) == 500  # at most half the deadline
    assert formulas.fallback_reserve_ms(None, 1000) == 250  # nothing measured: the setting's default


@pytest.mark.parametrize("peak, knee, primary, degraded, expected", [
    (100, 40, 40, 0.0, 4),    # 100 / (0.8 x 40) = 3.125
    (96, 40, 40, 0.0, 3),     # 96 / 32 = 3 exactly
    (10, 40, 40, 0.0, 2),     # the minimum
    (100, 80, 20, 0.0, 7),    # the primaries bind: 100 / (0.8 x 20) = 6.25
    (100, 80, 20, 0.5, 4),    # half may degrade: 50 / 16 = 3.1, the knee: 100 / 64 = 1.6
])
def test_replicas_run_each_at_80_percent_of_its_knee_and_its_primary(peak, knee, primary, degraded, expected):
    assert formulas.replicas(peak, knee, primary, degraded) == expected


def test_replicas_refuse_impossible_inputs():
    with pytest.raises(ValueError):
        formulas.replicas(100, 40, 40, degraded_share=1.0)
    with pytest.raises(ValueError):
        formulas.replicas(100, 0, 40)


def test_outcome_splits_load_between_primary_fallback_and_shed():
    at_peak = formulas.outcome(60, 2, primary_rps=40, total_rps=90)
    assert (at_peak.primary, at_peak.fallback, at_peak.shed) == (1.0, 0.0, 0.0)
    surge = formulas.outcome(180, 2, primary_rps=40, total_rps=60)  # 90 per replica: 40 + 20 answered, 30 shed
    assert (surge.primary, surge.fallback, surge.shed) == pytest.approx((0.4444, 0.2222, 0.3333), abs=1e-4)


def test_api_workers_keep_each_event_loop_half_idle():
    assert formulas.api_workers(10, 40) == 1   # 0.4 cores
    assert formulas.api_workers(10, 120) == 3  # 1.2 cores / 0.5
    assert formulas.api_workers(10, 1000) == 4  # capped


def test_keda_bounds_and_resource_requests():
    assert formulas.keda_bounds(6, 100, 40) == (3, 8)  # half the plan; 3 x 100 / 40 = 7.5
    assert formulas.keda_bounds(2, 10, 40) == (2, 2)
    assert formulas.memory_request_bytes(3.3 * 2 ** 30) == 17 * 256 * 2 ** 20  # 4.125 GiB -> 4.25 GiB
    assert formulas.cpu_request_cores(60, 30) == 2.0  # 1.8 cores, rounded up to half a core
    assert formulas.cpu_request_cores(10, 10) == 1.0
