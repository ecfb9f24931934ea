"""Rampart's settings, read once from ``RAMPART_*`` environment variables.

Every limit and knob has one home here. ``Settings.from_env()`` reads each field
from ``RAMPART_<FIELD NAME IN UPPER CASE>`` (for example ``RAMPART_MAX_BODY_BYTES``),
validates it with pydantic and raises ``pydantic.ValidationError`` naming the bad
value. BentoML starts the runners as child processes of ``bentoml serve``, so they
inherit the same environment and see the same settings.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rampart.inputs.decode_cost import DEFAULT_MAX_CHUNKS, DEFAULT_MAX_JPEG_SCANS
from rampart.overload.admission import ADMISSION_MODES
from rampart.results import CONFIDENCE_KINDS

ENV_PREFIX = "RAMPART_"


def default_cpu_threads(role: str, cores: int, gpu: bool) -> int:
    """Intra-op CPU threads for ``role`` ("primary" or "fallback") on a host with ``cores`` CPUs.

    CPU-only host: the fallback gets a quarter of the cores (at least 1) and the primary the
    rest less one core left to the API layer (at least 1); on 2 cores both get 1, because the
    primary measured 35 ms CPU/image with 1 torch thread against 49-51 ms with 2 (docs/benchmarks.md, "CPU defaults").
    GPU host: the primary computes on the GPU, so 1 CPU thread feeds it, and the fallback
    (on the GPU too if ONNX Runtime's CUDA provider loads, else on the CPU) may take half
    the cores. Any other role: 1.
    """
    cores = max(1, cores)
    fallback = max(1, cores // 2) if gpu else max(1, cores // 4)
    if role == "fallback":
        return fallback
    if role == "primary":
        return 1 if gpu else max(1, cores - fallback - 1)
    return 1


class Settings(BaseModel):
    """All of Rampart's configuration. Units are in each field's name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Models in the BentoML model store (written by `python -m models.import_models`).
    primary_model: str = "rampart-primary:latest"
    fallback_model: str = "rampart-fallback:latest"

    # Upload and decode limits (checked from the header, before any pixel is decoded).
    max_body_bytes: int = Field(20_000_000, gt=0)
    # Connections (rampart.compat.uvicorn_httptools.HeadLimitedProtocol): a connection whose request head
    # (request line and headers) is not complete this long after its first byte, or after the connection
    # was opened, is closed; so is a keep-alive connection idle this long between requests (uvicorn's
    # timeout_keep_alive, which it replaces). Behind a proxy, keep_alive_timeout_s must exceed the proxy's
    # idle timeout to Rampart (docs/deploy.md, "Connection timeouts").
    request_head_timeout_ms: int = Field(10_000, gt=0)
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    max_pixels: int = Field(50_000_000, gt=0)
    min_side_px: int = Field(16, ge=1)
    max_aspect_ratio: float = Field(10.0, ge=1.0)
    max_frames: int = Field(100, ge=1)
    # Decode cost beyond width x height, counted in the container before decoding (rampart.inputs.decode_cost):
    # scans of a progressive JPEG (libjpeg writes 6-10) and chunks a parser steps through.
    max_jpeg_scans: int = Field(DEFAULT_MAX_JPEG_SCANS, ge=1)
    max_chunks: int = Field(DEFAULT_MAX_CHUNKS, ge=1)
    # Colour that transparent pixels are composited over (RGB, 0..255): white, like a browser page.
    alpha_background: tuple[int, int, int] = (255, 255, 255)
    # Resize so the crop covers the bucket times this margin, then centre-crop.
    # 1.14 ~ 1/0.875, the crop ratio of the EfficientNet-Lite reference evaluation.
    crop_margin: float = Field(1.14, ge=1.0, le=2.0)
    # Source pixels per output pixel (each axis) the decoder keeps: a JPEG is decoded at 1/2, 1/4 or
    # 1/8 scale and any frame box-reduced only as far as the bucket still gets this many
    # (rampart.inputs.buckets.shrink_rule). 1.0: measured top-1 agreement in docs/decoding.md.
    decode_oversample: float = Field(1.0, ge=1.0, le=8.0)

    # Processes of the entry (API) service that accept HTTP requests (`bentoml.service(workers=...)`).
    # Each has its own admission gates, which divide the runners' capacity between the workers
    # (rampart.overload.admission; why: docs/overload.md). At most the smaller max_batch_size,
    # so every worker's gate keeps at least one image of each batch and their shares add up to the runner's.
    api_workers: int = Field(1, ge=1)

    # Decode pool: workers on the host (shared between the API workers: `decode_workers_per_api_worker`)
    # and how many uploads may wait for one. Waiting uploads hold only
    # their compressed bytes (already read); decoded pixels exist only in workers.
    # "processes": each worker is a process, killed and replaced when a decode overruns
    # decode_timeout_ms (its slot is free again at once); "threads": workers are threads
    # of the API process, and an overrunning decode keeps its slot until it ends.
    decode_mode: Literal["processes", "threads"] = "processes"
    decode_workers: int = Field(2, ge=1)
    decode_queue: int = Field(512, ge=0)
    # Niceness of the decode workers: the event loop thread, which answers and sheds,
    # stays ahead of them for the CPU.
    decode_nice: int = Field(5, ge=0, le=19)
    # Longest one decode may run before the upload is refused (422 decode_timeout).
    decode_timeout_ms: int = Field(3000, gt=0)

    # Deadlines (X-Deadline-Ms), end to end.
    default_deadline_ms: int = Field(1000, gt=0)
    max_deadline_ms: int = Field(60_000, gt=0)
    # Default deadline of a low-priority request (X-Priority: low, bulk work that only fills idle
    # capacity): long, because it waits for the primary to have room; at most max_deadline_ms.
    low_priority_deadline_ms: int = Field(10_000, gt=0)
    # Part of every deadline kept back for the fallback when the primary is slow.
    fallback_reserve_ms: int = Field(250, ge=0)
    # The pipeline stops this long before the client's deadline, leaving time to send the answer.
    answer_margin_ms: int = Field(20, ge=0)
    # The least time an idle server needs, after the answer margin, to decode one photo and have the
    # fallback classify it: measured 25 ms on the 2-core CI host (decode 5 ms, fallback call 20 ms:
    # 5 transport, 15 inference), 2026-12-01. A deadline below min_deadline_ms = answer_margin_ms +
    # min_service_ms (50 ms by default) is refused with 422 deadline_too_short, and the loop-lag
    # reserve never cuts an accepted deadline's share below min_service_ms (docs/clients.md, "Deadlines").
    min_service_ms: int = Field(30, ge=1)

    # Adaptive batching (BentoML), per model. BentoML's dispatcher cancels (503) a request
    # it predicts will exceed max_latency_ms; Rampart's own deadlines do the shedding, so
    # the default is the longest deadline and the dispatcher never sheds first.
    primary_max_batch_size: int = Field(16, ge=2)
    primary_max_latency_ms: int = Field(60_000, gt=0)
    fallback_max_batch_size: int = Field(32, ge=2)
    fallback_max_latency_ms: int = Field(60_000, gt=0)

    # GPU safety and admission control, per model (see rampart.overload.admission). Concurrent
    # batches per device = runner threads; images dispatched at once =
    # (concurrent_batches + 1) x max_batch_size; the wait queue holds throughput x
    # queue_delay_ms images. Throughput is measured (warm-up, then every batch)
    # unless *_throughput_ips > 0 fixes it.
    primary_concurrent_batches: int = Field(1, ge=1)
    fallback_concurrent_batches: int = Field(1, ge=1)
    # Batching before the runner boundary (rampart.coalesce): images bound for one bucket of one runner
    # that wait in an API worker go in one call when a call for that bucket returns, at most
    # runner_calls_in_flight calls out per bucket (docs/serving-cost.md). Off: one call per image.
    # One call out per bucket: at 5x overload on the 2-core host the primary's core then sat idle 5-7 s of 20
    # waiting for round trips (2.2 s with two calls out), but with two, two replicas sharing the host
    # served less than with one and in-flight requests of a draining replica got the static answer
    # (docs/overload.md, "Predicting completion").
    runner_coalescing: bool = True
    runner_calls_in_flight: int = Field(1, ge=1)
    # How a runner's batch dispatcher waits for its batch slot while a batch computes and requests are
    # queued: "release" waits for the slot's release (rampart.compat.bentoml_batching.wake_on_release);
    # "poll" is BentoML's own 1 ms poll, kept for the same-run A/B (docs/serving-cost.md).
    runner_dispatch_wake: Literal["release", "poll"] = "release"
    # A request whose client closes the connection after its body and before the answer is cancelled where it
    # waits and its places are released (rampart.hangup); false: it runs to the end, as before (the A/B arm).
    cancel_on_hang_up: bool = True
    # A request holds an in-flight place only once its body is in; a body must arrive at min_body_bytes_per_s
    # after body_grace_ms (at t after the head, (t - grace) x rate bytes), else it is cut with 408 and the
    # connection closed (rampart.api.arrival). 0 turns the rate check off. Behind nginx (which buffers the
    # body before it sends it on) bodies arrive at loopback speed.
    min_body_bytes_per_s: int = Field(16384, ge=0)
    body_grace_ms: int = Field(2000, ge=0)
    primary_queue_delay_ms: int = Field(200, gt=0)
    fallback_queue_delay_ms: int = Field(200, gt=0)
    primary_throughput_ips: float = Field(0.0, ge=0.0)
    fallback_throughput_ips: float = Field(0.0, ge=0.0)
    # Time constant of the measured throughput, in busy time (idle time does not count).
    throughput_tau_ms: int = Field(5_000, gt=0)
    # OpenTelemetry spans for /classify and /classify_batch. Off: BentoML's tracing middleware
    # costs about 0.3 ms of event-loop CPU per request even with no exporter (bench/middleware_bench.py).
    trace_requests: bool = False
    # BentoML's access line for every runner call (runners.common.runner_access_log_enabled); off,
    # the entry service's JSON line (rampart.telemetry.accesslog) is the only line per request.
    runner_access_log: bool = False
    # Niceness of the runner processes. On a CPU-only host inference then yields the CPU
    # to the API layer, which must keep answering (and shedding) under overload, and the
    # fallback yields to the primary, whose full answers are worth more.
    primary_nice: int = Field(5, ge=0, le=19)
    fallback_nice: int = Field(10, ge=0, le=19)
    # CPU threads of each model's engine: torch intra-op threads of the primary, ONNX Runtime
    # intra-op threads of the fallback. 0 = the rule of ``default_cpu_threads`` from the host's
    # cores and whether a GPU is present (docs/benchmarks.md, "CPU defaults").
    # OpenMP's wait policy (OMP_WAIT_POLICY, PASSIVE unless set) is set in service.py.
    primary_cpu_threads: int = Field(0, ge=0)
    fallback_cpu_threads: int = Field(0, ge=0)
    # CPU placement (rampart.cores): "auto" reserves the primary's cores on a CPU-only host and
    # pins every other process to the rest; "off" leaves placement to the OS (replicas sharing
    # one host, deploy.cluster, use it: each would reserve the same cores).
    cpu_pinning: Literal["auto", "off"] = "auto"
    # The primary's engine (inference.engine_choice, docs/engines.md): "auto" runs a PyTorch primary on the
    # faster of PyTorch and its checked ONNX export, measured per image at each one's compute batch size when
    # the runner starts on a CPU-only host, and on PyTorch on a GPU host; "torch" or "onnx" forces one (ONNX
    # Runtime's CUDA provider on a GPU host). A stored primary without an export runs on PyTorch.
    # Default "torch" for now: with the faster ONNX primary (33 images/s here) the 2-core host's
    # other core saturates at 5x overload and the primary answered only 0.40-0.48 of its capacity
    # in time, against 0.70-0.81 on PyTorch (docs/engines.md). deploy/k8s sets "auto".
    primary_engine: Literal["auto", "torch", "onnx"] = "torch"
    # Share of the GPU's memory the primary may allocate (torch.cuda.set_per_process_memory_fraction).
    gpu_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)

    # Circuit breaker on the primary (see rampart.overload.breaker).
    breaker_window_ms: int = Field(10_000, gt=0)
    breaker_min_calls: int = Field(10, ge=1)
    breaker_failure_rate: float = Field(0.5, gt=0.0, le=1.0)
    breaker_open_ms: int = Field(5_000, gt=0)
    breaker_probes: int = Field(3, ge=1)

    # Routing (rampart.pipeline, docs/overload.md, "Cascade"). "primary-first": the primary answers, the fallback
    # only when the primary cannot. "cascade": the fallback answers first and keeps its answer when its
    # confidence (cascade_confidence, rampart.results.confidences) is at least cascade_threshold, else
    # the primary is asked within the same deadline. Both defaults are the calibration's recommendation
    # (python -m bench.cascade_eval, docs/bench/cascade_eval.json "recommendation", run of 2026-11-30):
    # msp at 0.42 is the lowest threshold with >= 99% top-1 agreement with the primary alone on the
    # 322 bundled photos, leaving 23.0% of them to the fallback (margin: 17.7% at 0.32).
    # "primary-only" (for experiments: the ablation, docs/benchmarks.md, "Ablation"): the fallback is never asked, and the
    # primary gets the whole deadline (no fallback reserve).
    routing: Literal["primary-first", "cascade", "primary-only"] = "primary-first"
    cascade_confidence: Literal[CONFIDENCE_KINDS] = "msp"  # type: ignore[valid-type]  # "msp" or "margin"
    cascade_threshold: float = Field(0.42, ge=0.0, le=1.0)

    # Switches for experiments, not for production (the ablation, bench.ablation, docs/benchmarks.md, "Ablation").
    # admission (rampart.overload.admission.ADMISSION_MODES): "full" sheds on the queue bound and on predicted
    # lateness; "queue-bound" only on the queue bound; "off" never (unbounded model queues and decode queue, no
    # in-flight bound). honour_deadlines false: the server ignores the client's deadline and gives every request
    # max_deadline_ms (no early stop, no TTL drop in practice).
    admission: Literal[ADMISSION_MODES] = "full"  # type: ignore[valid-type]  # "full", "queue-bound" or "off"
    # How a gate predicts completion (rampart.overload.admission.AdmissionGate.completion_s): "meter", images
    # ahead x the busy-time meter's time per image; "service", the runner's own compute per image plus a
    # measured travel time (ServiceTime). "meter" by default (docs/overload.md, "Predicting completion").
    admission_prediction: Literal["meter", "service"] = "meter"
    honour_deadlines: bool = True

    # Monitoring that stays cheap under a storm of scrapes (rampart.telemetry.scrapes, docs/observability.md).
    # GET /stats takes each runner's counters from a copy in the API worker, asked again when it is older than
    # this (one call in flight per runner; the body's runner_age_ms says how old); 0: asked on every /stats.
    stats_runner_refresh_ms: int = Field(500, ge=0)
    # GET /metrics (every process's metric files merged) is rendered at most once per this interval; each
    # scrape gets the next rendering begun after it arrived, shared with the scrapes waiting for the same one;
    # 0: every scrape renders its own.
    metrics_render_interval_ms: int = Field(500, ge=0)

    # Content-hash LRU cache of answers, used when both models fail; 0 turns it off.
    cache_size: int = Field(1024, ge=0)

    # Batch API.
    max_batch_images: int = Field(16, ge=1)

    # Shadow traffic (rampart.shadow, docs/overload.md, "Shadow traffic"): a candidate model in the store
    # (empty: off, no third runner) gets this share of the /classify requests a model answered,
    # after the answer is sent, only while the models are not busy (rampart.shadow.models_busy) and
    # no request was shed for a second, at most shadow_max_inflight at once, each within
    # shadow_deadline_ms, its runner at shadow_nice.
    shadow_model: str = ""
    shadow_rate: float = Field(0.1, ge=0.0, le=1.0)
    shadow_deadline_ms: int = Field(1000, gt=0)
    shadow_max_inflight: int = Field(2, ge=1)
    shadow_nice: int = Field(15, ge=0, le=19)

    # Fault injection for drills and tests: off by default.
    fault_primary_delay_ms: int = Field(0, ge=0)
    fault_primary_error_rate: float = Field(0.0, ge=0.0, le=1.0)
    fault_primary_hang: bool = False
    fault_fallback_error_rate: float = Field(0.0, ge=0.0, le=1.0)
    fault_shadow_delay_ms: int = Field(0, ge=0)
    fault_shadow_error_rate: float = Field(0.0, ge=0.0, le=1.0)
    # Every decode hangs (before decoding) until the fault ends: drills the decode timeout.
    fault_decode_hang: bool = False
    # A JSON file of fault_* keys, re-read while the server runs, that overrides the
    # fault_* settings above: drills can start and stop a fault without a restart.
    fault_file: str = ""

    @model_validator(mode="after")
    def _deadlines_consistent(self) -> "Settings":
        if self.default_deadline_ms > self.max_deadline_ms:
            raise ValueError(
                f"default_deadline_ms={self.default_deadline_ms} exceeds max_deadline_ms={self.max_deadline_ms}"
            )
        # Only a low default set on purpose is refused; the built-in 10 s yields to a shorter
        # max_deadline_ms (rampart.api.http.parse_deadline caps it), so such a server still starts.
        if "low_priority_deadline_ms" in self.model_fields_set and self.low_priority_deadline_ms > self.max_deadline_ms:
            raise ValueError(f"low_priority_deadline_ms={self.low_priority_deadline_ms} exceeds "
                             f"max_deadline_ms={self.max_deadline_ms}")
        return self

    @model_validator(mode="after")
    def _workers_fit_the_batches(self) -> "Settings":
        smallest = min(self.primary_max_batch_size, self.fallback_max_batch_size)
        if self.api_workers > smallest:
            raise ValueError(f"api_workers={self.api_workers} exceeds the smaller max_batch_size ({smallest}): "
                             "the workers' admission gates would together hold more than the runner's batches")
        return self

    @property
    def min_deadline_ms(self) -> int:
        """The shortest ``X-Deadline-Ms`` served, ms: ``answer_margin_ms`` + ``min_service_ms`` (50 by default).

        Below it the answer is 422 ``deadline_too_short``; from it on an idle server answers 200
        (``rampart.api.http.parse_deadline``).
        """
        return self.answer_margin_ms + self.min_service_ms

    @model_validator(mode="after")
    def _min_deadline_below_the_default(self) -> "Settings":
        if self.min_deadline_ms > self.default_deadline_ms:
            raise ValueError(f"min_deadline_ms (answer_margin_ms + min_service_ms = {self.min_deadline_ms}) exceeds "
                             f"default_deadline_ms={self.default_deadline_ms}")
        return self

    @property
    def decode_workers_per_api_worker(self) -> int:
        """Decode workers each API worker starts: ``decode_workers // api_workers``, at least 1.

        ``decode_workers`` counts decoders on the whole host, so adding API workers does
        not multiply the decode processes competing for the same cores (only when there
        are more API workers than ``decode_workers`` does each still get one).
        """
        return max(1, self.decode_workers // self.api_workers)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        """Build settings from ``RAMPART_*`` variables (``os.environ`` by default).

        Tuples are written comma-separated (``RAMPART_ALPHA_BACKGROUND=0,0,0``).
        Raises ``pydantic.ValidationError`` for a malformed or out-of-range value.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, field in cls.model_fields.items():
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is None:
                continue
            values[name] = raw.split(",") if field.annotation == tuple[int, int, int] else raw
        return cls.model_validate(values)


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings, read from the environment on first use."""
    return Settings.from_env()
