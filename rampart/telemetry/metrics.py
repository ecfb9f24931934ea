"""Rampart's Prometheus metrics, all named ``rampart_*``, served on BentoML's ``/metrics``.

``bentoml serve`` sets ``PROMETHEUS_MULTIPROC_DIR`` for every process it starts
(the entry service and each runner), so prometheus_client writes these metrics to
shared files and BentoML's ``/metrics`` merges them with its own
(``bentoml_service_*``): they are correct with several workers. Gauges say how
they combine across processes (``multiprocess_mode``). Outside ``bentoml serve``
(unit tests, notebooks) they are ordinary in-process metrics.

Label values are bounded: ``model`` is the model's role, ``primary`` or
``fallback`` (``MODELS``), not its model-store name (in ``rampart_stage_duration_seconds``
the answering path: also ``cache`` or ``none``); ``role`` is ``primary``, ``fallback`` or
``api``; ``bucket`` one of three names; ``stage``, ``reason`` and ``warning`` come
from fixed sets; ``class`` from the model's own label list (1000 ImageNet classes).
"""

from __future__ import annotations

import os
import time

import psutil
from prometheus_client import Counter, Gauge, Histogram

from rampart.hangup import STAGES as HANG_UP_STAGES
from rampart.inputs import recovery
from rampart.overload.admission import PRIORITIES

__all__ = [
    "QUEUE_DEPTH", "INFLIGHT_BATCHES", "ADMITTED", "REJECTED", "RESPONSES", "TTL_DROPPED", "FALLBACK", "DEGRADED",
    "BREAKER_STATE", "STAGE_SECONDS", "BATCH_SIZE", "INPUT_MEGAPIXELS", "TOP1_CONFIDENCE", "TOP1_CLASS",
    "GPU_MEMORY_USED", "GPU_MEMORY_TOTAL", "PROCESS_RSS", "LOOP_LAG", "GC_PAUSE", "update_process_rss", "init_api_series",
    "init_runner_series", "INPUT_WARNINGS", "ACCESS_LOG_DROPPED",
]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)

QUEUE_DEPTH = Gauge(
    "rampart_queue_depth", "Requests waiting in a model's admission queue (bucket 'decoding': not decoded yet).",
    ["model", "bucket"], multiprocess_mode="livesum",
)
INFLIGHT_BATCHES = Gauge(
    "rampart_inflight_batches", "Batches a runner is computing now.", ["model"], multiprocess_mode="livesum",
)
ADMITTED = Counter("rampart_admitted_total", "Requests given a place in a model's admission queue.", ["model"])
REJECTED = Counter(
    "rampart_rejected_total",
    "Requests a model's gate did not take: queue_full, predicted_late, evicted, circuit_open, timeout.",
    ["model", "reason"],
)
RESPONSES = Counter(
    "rampart_responses_total", "Answers by HTTP status and code ('ok' for a result).", ["status", "code"],
)
TTL_DROPPED = Counter(
    "rampart_ttl_dropped_total", "Items a runner dropped because their deadline had passed before computing.",
    ["model"],
)
FALLBACK = Counter("rampart_fallback_total", "Requests handed to the fallback, by why the primary did not answer.",
                   ["reason"])
DEGRADED = Counter("rampart_degraded_total", "Degraded answers by degraded_reason.", ["reason"])
CLIENT_GONE = Counter("rampart_client_gone_total",
                      "Requests whose client closed the connection before the answer, by where they were "
                      "(rampart.hangup.STAGES): their places were released and they were not answered.", ["stage"])
ACCESS_LOG_DROPPED = Counter("rampart_access_log_dropped_total",
                             "Access-log lines dropped because the log's writer thread was that many lines behind "
                             "(rampart.telemetry.accesslog.ACCESS_LOG_QUEUE_LINES): stderr was not being read.")
BREAKER_STATE = Gauge(
    "rampart_circuit_breaker_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open.", ["model"],
    multiprocess_mode="livemax",
)
STAGE_SECONDS = Histogram(
    "rampart_stage_duration_seconds", "Time per request stage: decode, queue, inference, total.",
    ["model", "stage"], buckets=_LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram(
    "rampart_batch_size", "Images per computed batch.", ["model", "bucket"],
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
INPUT_MEGAPIXELS = Histogram(
    "rampart_input_megapixels", "Declared resolution of decoded uploads, in megapixels.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 33, 50),
)
INPUT_WARNINGS = Counter(
    "rampart_input_warnings_total",
    "Answers for uploads decoded after repairing benign damage, by input warning (rampart/inputs/recovery.py).",
    ["warning"],
)
TOP1_CONFIDENCE = Histogram(
    "rampart_top1_confidence", "Score of the top-1 class of each model answer.", ["model"],
    buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99),
)
TOP1_CLASS = Counter("rampart_top1_class_total", "Top-1 class of each model answer.", ["model", "class"])
GPU_MEMORY_USED = Gauge("rampart_gpu_memory_used_bytes", "GPU memory allocated by the primary (CUDA only).",
                        ["device"], multiprocess_mode="livesum")
GPU_MEMORY_TOTAL = Gauge("rampart_gpu_memory_total_bytes", "Total memory of the GPU (CUDA only).",
                         ["device"], multiprocess_mode="livemax")
PROCESS_RSS = Gauge("rampart_process_resident_memory_bytes", "Resident memory of each Rampart process.",
                    ["role"], multiprocess_mode="liveall")
LOOP_LAG = Gauge("rampart_event_loop_lag_seconds", "Largest event-loop lag of the API layer in the last 2 s.",
                 multiprocess_mode="livemax")
GC_PAUSE = Histogram("rampart_gc_pause_seconds",
                     "Pauses of the API layer's cycle collector of 1 ms or more, by generation (rampart/overload/looplag.py).",
                     ["generation"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))


#: The fixed label values, created at start-up so every series exists (at 0) before its first event.
MODELS = ("primary", "fallback")
REJECT_REASONS = ("queue_full", "predicted_late", "evicted", "higher_priority_waiting", "circuit_open", "timeout")
FALLBACK_REASONS = ("primary_overloaded", "primary_circuit_open", "primary_timeout", "primary_error")
DEGRADED_REASONS = FALLBACK_REASONS + ("cached_result", "no_model_available", "deadline_exceeded")


# Priority classes (X-Priority; rampart.overload.admission.PRIORITIES) and what became of their requests.
#: ``primary`` / ``fallback`` / ``cache`` / ``none`` (the static answer): who answered; ``shed``: a 429.
PRIORITY_OUTCOMES = ("primary", "fallback", "cache", "none", "shed")
PRIORITY_OUTCOMES_TOTAL = Counter(
    "rampart_priority_outcomes_total",
    "Classified images by priority class (high, normal, low) and outcome: answered by the primary, the fallback, "
    "the cache or the static answer (none), or refused with 429 (shed).",
    ["priority", "outcome"],
)
__all__ += ["PRIORITIES", "PRIORITY_OUTCOMES", "PRIORITY_OUTCOMES_TOTAL"]


def init_api_series() -> None:
    """Create the API layer's labelled series at 0 (call once in the entry service)."""
    for model in MODELS:
        ADMITTED.labels(model)
        for reason in REJECT_REASONS:
            REJECTED.labels(model, reason)
    for reason in FALLBACK_REASONS:
        FALLBACK.labels(reason)
    for reason in DEGRADED_REASONS:
        DEGRADED.labels(reason)
    for warning in recovery.INPUT_WARNINGS:
        INPUT_WARNINGS.labels(warning)
    BREAKER_STATE.labels("primary").set(0)
    for priority in PRIORITIES:
        for outcome in PRIORITY_OUTCOMES:
            PRIORITY_OUTCOMES_TOTAL.labels(priority, outcome)
    for stage in HANG_UP_STAGES:
        CLIENT_GONE.labels(stage)
    for generation in (0, 1, 2):
        GC_PAUSE.labels(str(generation))


def init_runner_series(model: str) -> None:
    """Create a runner's labelled series at 0 (call once in each runner)."""
    TTL_DROPPED.labels(model)
    INFLIGHT_BATCHES.labels(model).set(0)
    update_process_rss(model, min_interval_s=0.0)


_rss_updated_at = 0.0


def update_process_rss(role: str, min_interval_s: float = 1.0) -> None:
    """Set ``rampart_process_resident_memory_bytes{role}`` for this process (psutil), at most once per interval."""
    global _rss_updated_at
    now = time.monotonic()
    if now - _rss_updated_at >= min_interval_s:
        _rss_updated_at = now
        PROCESS_RSS.labels(role).set(psutil.Process(os.getpid()).memory_info().rss)


# Shadow traffic (rampart.shadow). ``model`` is the lane whose answer was sent: primary or fallback.
SHADOW_OUTCOMES = ("skipped_busy", "skipped_not_ready", "compared", "error", "timeout")
SHADOW_REQUESTS = Counter(
    "rampart_shadow_requests_total",
    "Sampled requests by what became of their mirror: skipped_busy, skipped_not_ready, compared, error, timeout.",
    ["outcome"],
)
SHADOW_TOP1_AGREED = Counter("rampart_shadow_top1_agreed_total",
                             "Compared mirrors whose top-1 class equals the answer sent.", ["model"])
SHADOW_TOP5_OVERLAP = Histogram(
    "rampart_shadow_top5_overlap", "Share of the answer's top-5 classes also in the candidate's top 5 (0..1); "
    "its _count is the compared mirrors.", ["model"], buckets=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
)
SHADOW_SECONDS = Histogram("rampart_shadow_latency_seconds", "Duration of each answered shadow call.",
                           buckets=_LATENCY_BUCKETS)
__all__ += ["SHADOW_REQUESTS", "SHADOW_TOP1_AGREED", "SHADOW_TOP5_OVERLAP", "SHADOW_SECONDS", "init_shadow_series"]


def init_shadow_series() -> None:
    """Create the shadow-traffic series at 0 (call once in the entry service when a shadow model is set)."""
    for outcome in SHADOW_OUTCOMES:
        SHADOW_REQUESTS.labels(outcome)
    for model in MODELS:
        SHADOW_TOP1_AGREED.labels(model)
        SHADOW_TOP5_OVERLAP.labels(model)


# Cascade routing (rampart.pipeline, settings routing=cascade). ``route`` is one of CASCADE_ROUTES.
CASCADE_ROUTES = ("cascade_confident", "cascade_escalated", "cascade_not_escalated", "cascade_fallback_unavailable")
CASCADE_ROUTES_TOTAL = Counter(
    "rampart_cascade_routes_total",
    "Cascade answers by route: cascade_confident (the fallback was sure), cascade_escalated (the primary answered "
    "after the fallback was unsure), cascade_not_escalated (unsure, but the primary could not answer: degraded), "
    "cascade_fallback_unavailable (the fallback could not answer; the primary was asked first).",
    ["route"],
)
CASCADE_CONFIDENCE = Histogram(
    "rampart_cascade_confidence",
    "Confidence (settings cascade_confidence: msp or margin) of every fallback answer in cascade mode, "
    "compared with cascade_threshold.",
    buckets=(0.05, 0.1, 0.2, 0.3, 0.35, 0.4, 0.42, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99),
)
__all__ += ["CASCADE_ROUTES", "CASCADE_ROUTES_TOTAL", "CASCADE_CONFIDENCE", "init_cascade_series"]


def init_cascade_series() -> None:
    """Create the cascade's route series at 0 (called by the pipeline when routing is ``cascade``)."""
    for route in CASCADE_ROUTES:
        CASCADE_ROUTES_TOTAL.labels(route)
