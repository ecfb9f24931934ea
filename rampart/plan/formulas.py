"""The capacity planner's rules as plain functions of measured figures (no I/O): docs/planning.md.

Units: rates in requests (one image each) per second, times in ms, CPU in cores, memory in bytes.
Every function raises ``ValueError`` for an input outside its documented range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["HEADROOM", "MIN_REPLICAS", "queue_places", "queue_delay_ms", "fallback_reserve_ms", "replicas",
           "api_workers", "Outcome", "outcome", "keda_bounds", "memory_request_bytes", "cpu_request_cores"]

#: Share of each replica's knee kept free at the planned peak: replicas run at ``1 - HEADROOM`` of their knee, so
#: the peak survives measurement noise, an uneven load balancer and one slow replica without leaving the knee.
HEADROOM = 0.2
#: Fewest replicas planned: one can drain or fail while the other answers (the base PodDisruptionBudget).
MIN_REPLICAS = 2
#: Least acceptable queueing delay (ms): below it the queue is shorter than one batch on any host measured.
MIN_QUEUE_DELAY_MS = 20


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or math.isinf(value):
            raise ValueError(f"{name} must be positive and finite, got {value}")


def queue_places(throughput_ips: float, delay_ms: float, least: int = 1) -> int:
    """Places in a bounded queue: throughput × the acceptable queueing delay (200 img/s × 200 ms = 40), at
    least ``least`` (one batch)."""
    _positive(throughput_ips=throughput_ips, delay_ms=delay_ms)
    return max(least, int(throughput_ips * delay_ms / 1000.0))


def queue_delay_ms(p99_target_ms: float, service_ms: float, deadline_ms: float, reserve_ms: float,
                   margin_ms: float) -> int:
    """The acceptable queueing delay: what the P99 target leaves after the service time of one request alone
    (``service_ms``: the 1-client P50), and never more than the primary's share of the deadline
    (``deadline_ms - reserve_ms - margin_ms``) leaves after it; at least ``MIN_QUEUE_DELAY_MS``. Rounded down to
    10 ms."""
    _positive(p99_target_ms=p99_target_ms, service_ms=service_ms, deadline_ms=deadline_ms)
    room = min(p99_target_ms, deadline_ms - reserve_ms - margin_ms) - service_ms
    return max(MIN_QUEUE_DELAY_MS, int(room // 10 * 10))


def fallback_reserve_ms(fallback_inference_p99_ms: float | None, deadline_ms: float, default_ms: float = 250) -> int:
    """The part of each deadline kept for the fallback: twice the P99 of its batch inference time measured at
    5× overload (one batch ahead of a handed-over request, then its own), rounded up to 10 ms, at least 50 ms
    and at most half the deadline. ``default_ms`` (the setting's default) when the fallback answered nothing
    during the measurement."""
    _positive(deadline_ms=deadline_ms)
    if fallback_inference_p99_ms is None or fallback_inference_p99_ms <= 0:
        return int(min(default_ms, deadline_ms // 2))
    return int(min(max(50, math.ceil(fallback_inference_p99_ms * 2 / 10) * 10), deadline_ms // 2))


def replicas(peak_rps: float, knee_rps: float, primary_rps: float, degraded_share: float = 0.0,
             headroom: float = HEADROOM) -> int:
    """Replicas for ``peak_rps``: enough that each runs at ``1 - headroom`` of its knee (``knee_rps``: the most
    it answers at the P99 target), and that the primaries (``primary_rps`` each, C_p) answer all but
    ``degraded_share`` of the peak at the same headroom; at least ``MIN_REPLICAS``.

    >>> replicas(100, knee_rps=40, primary_rps=40)  # 100 / (0.8 × 40) = 3.1
    4
    """
    _positive(peak_rps=peak_rps, knee_rps=knee_rps, primary_rps=primary_rps)
    if not 0.0 <= degraded_share < 1.0:
        raise ValueError(f"degraded_share must be in [0, 1), got {degraded_share}")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    usable = 1.0 - headroom
    by_knee = peak_rps / (knee_rps * usable)
    by_primary = peak_rps * (1.0 - degraded_share) / (primary_rps * usable)
    return max(MIN_REPLICAS, math.ceil(round(max(by_knee, by_primary), 9)))


def api_workers(api_cpu_ms_per_request: float, rps_per_replica: float, core_budget: float = 0.5,
                most: int = 4) -> int:
    """API worker processes per replica: the API layer's CPU at the replica's planned rate
    (``api_cpu_ms_per_request`` × ``rps_per_replica``) over ``core_budget`` cores per worker (an event loop
    kept half idle answers and sheds in time), rounded up, 1..``most``."""
    _positive(rps_per_replica=rps_per_replica)
    if api_cpu_ms_per_request < 0:
        raise ValueError(f"api_cpu_ms_per_request must be at least 0, got {api_cpu_ms_per_request}")
    cores = api_cpu_ms_per_request * rps_per_replica / 1000.0
    return max(1, min(most, math.ceil(round(cores / core_budget, 9))))


@dataclass(frozen=True)
class Outcome:
    """What becomes of an offered load: shares (0..1) answered by the primary, the fallback, and shed."""

    offered_rps: float
    primary: float
    fallback: float
    shed: float


def outcome(offered_rps: float, replica_count: int, primary_rps: float, total_rps: float) -> Outcome:
    """The shares of ``offered_rps`` spread over ``replica_count`` replicas that each answer ``primary_rps`` by the
    primary (C_p) and ``total_rps`` in all (the goodput measured at 5× overload, primary and fallback): the
    primary answers up to C_p per replica, the fallback the rest up to the total, and the remainder is shed."""
    _positive(offered_rps=offered_rps, primary_rps=primary_rps)
    if replica_count < 1:
        raise ValueError(f"replica_count must be at least 1, got {replica_count}")
    total_rps = max(total_rps, primary_rps)
    per_replica = offered_rps / replica_count
    primary = min(per_replica, primary_rps)
    fallback = min(per_replica, total_rps) - primary
    return Outcome(round(offered_rps, 2), round(primary / per_replica, 4), round(fallback / per_replica, 4),
                   round(max(0.0, per_replica - primary - fallback) / per_replica, 4))


def keda_bounds(planned: int, peak_rps: float, knee_rps: float, surge: float = 3.0) -> tuple[int, int]:
    """KEDA's ``(minReplicaCount, maxReplicaCount)``: the minimum holds half the planned peak (at least
    ``MIN_REPLICAS``; a cold replica takes about 90 s, so the autoscaler adds the rest as the evening ramps up),
    the maximum holds ``surge`` × the peak at the knee (and is at least ``planned``)."""
    _positive(peak_rps=peak_rps, knee_rps=knee_rps, surge=surge)
    least = max(MIN_REPLICAS, math.ceil(planned / 2))
    most = max(planned, math.ceil(round(surge * peak_rps / knee_rps, 9)))
    return least, most


def memory_request_bytes(rss_bytes: float, margin: float = 1.25) -> int:
    """A pod's memory request: the server's measured resident memory (every process) × ``margin``, rounded up
    to 256 MiB."""
    _positive(rss_bytes=rss_bytes)
    step = 256 * 2 ** 20
    return math.ceil(rss_bytes * margin / step) * step


def cpu_request_cores(cpu_ms_per_request: float, rps_per_replica: float) -> float:
    """A pod's CPU request: the server's measured CPU per request (every process) × the planned rate per
    replica, rounded up to half a core, at least 1."""
    _positive(rps_per_replica=rps_per_replica)
    cores = cpu_ms_per_request * rps_per_replica / 1000.0
    return max(1.0, math.ceil(round(cores * 2, 9)) / 2)
