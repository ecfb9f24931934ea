"""Rampart's settings, read once from ``RAMPART_*`` environment variables.

Every limit and knob has one home here. ``Settings.from_env()`` reads each setting from
``RAMPART_<FLAT NAME IN UPPER CASE>`` (for example ``RAMPART_MAX_BODY_BYTES``), validates it
with pydantic and raises ``pydantic.ValidationError`` naming the bad value. BentoML starts the
runners as child processes of ``bentoml serve``, so they inherit the same environment and see
the same settings.

Layout. The settings are grouped by concern into nested models: ``settings.primary`` and
``settings.fallback`` (one ``ModelRoleSettings`` class for both model roles, the primary's
subclass adding its engine), ``inputs``, ``connections``, ``decoding``, ``deadlines``, ``runners``,
``admission``, ``routing``, ``breaker``, ``shadow``, ``faults``, ``telemetry`` and
``experiments``; four host-wide settings stay flat on ``Settings`` (``api_workers``,
``cpu_pinning``, ``gpu_memory_fraction``, ``cache_size``).

Names. Each group has an environment prefix (``GROUPS``): a field ``f`` of a group with prefix
``p`` has the flat name ``p + f`` (``primary.max_batch_size`` is ``primary_max_batch_size``,
``RAMPART_PRIMARY_MAX_BATCH_SIZE``); the few fields whose flat name does not follow the rule
carry it in ``Field(json_schema_extra={"flat": ...})``. ``FLAT_NAMES`` (flat name -> nested
path), derived from the groups once at import, is the only mapping: ``from_env`` reads the
environment through it, ``Settings(flat_name=value)`` folds keyword arguments into their groups
with it (tests and benchmarks construct settings that way; nested groups work too), and
``settings_table`` documents it (docs/configuration.md embeds its output; a unit test keeps
the two equal; ``python -m rampart.config --table`` prints it). Unknown ``RAMPART_*`` variables
are ignored by ``from_env`` (one that nearly spells a setting is named in a warning); unknown keyword
arguments are refused.

Experiments. The ablation's switches (docs/benchmarks.md, "Ablation") are
``experiments.admission`` (``RAMPART_ADMISSION``: ``queue-bound``, ``off``),
``experiments.honour_deadlines`` (``RAMPART_HONOUR_DEADLINES=false``) and the routing
``primary-only`` (``RAMPART_ROUTING``, whose other values are production's). Each works only
with ``RAMPART_EXPERIMENTS=true``; without it a value other than production's refuses to
start, naming the flag, so no server runs an ablation arm by mistake. Production code reads
the switches through ``Settings.admission_mode``, ``Settings.honour_deadlines`` and
``Settings.routing.mode``, which therefore hold production's values unless the flag is on;
nothing outside this module reads the flag.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rampart.inputs.decode_cost import DEFAULT_MAX_CHUNKS, DEFAULT_MAX_JPEG_SCANS
from rampart.overload.admission import ADMISSION_MODES, LOW_ARRIVALS, PREDICTIONS
from rampart.results import CONFIDENCE_KINDS

ENV_PREFIX = "RAMPART_"


def variable_of(flat_name: str) -> str:
    """The environment variable of the setting with flat name ``flat_name``: ``RAMPART_`` + its upper case."""
    return ENV_PREFIX + flat_name.upper()
#: A BentoML model tag, ``name`` or ``name:version`` (BentoML's tag rules: letters, digits, ``-``, ``_``, ``.``; a
#: name lowercased by BentoML with a warning). An empty primary or fallback tag made every worker fail at start, and
#: the server restarted them without end.
MODEL_TAG_PATTERN = r"^[A-Za-z0-9](?:[-._A-Za-z0-9]{0,61}[A-Za-z0-9])?(?::[A-Za-z0-9][-._A-Za-z0-9]{0,127})?$"


def default_cpu_threads(role: str, cores: int, gpu: bool, placement: str = "weight") -> int:
    """Intra-op CPU threads for ``role`` ("primary" or "fallback") on a host with ``cores`` CPUs, under the
    CPU placement ``placement`` (``Settings.cpu_pinning``: "weight", "reserve" or "off").

    CPU-only host: the fallback gets a quarter of the cores (at least 1). The primary gets every core
    under "weight" (nothing is pinned; the API layer, the decoders and the fallback take their share
    by niceness when they need it, ``rampart.cores``): on the shared 2-core host its closed-loop capacity,
    median of 5 rounds, was 11.1 images/s with 2 threads against 10.4 with 1 thread on its reserved core
    (16.5-16.6 against 8.3-11.4 in the quieter first run), and the same at 5x overload (docs/benchmarks.md,
    "CPU placement"). Under "reserve" and "off" it gets the rest
    less one core left to the API layer (at least 1): on 2 cores 1, because one torch thread costs
    35 ms of CPU per image against 49-51 ms with 2 (docs/benchmarks.md, "CPU defaults").
    GPU host: the primary computes on the GPU, so 1 CPU thread feeds it, and the fallback
    (on the GPU too if ONNX Runtime's CUDA provider loads, else on the CPU) may take half
    the cores. Any other role: 1.
    """
    cores = max(1, cores)
    fallback = max(1, cores // 2) if gpu else max(1, cores // 4)
    if role == "fallback":
        return fallback
    if role == "primary":
        if gpu:
            return 1
        return cores if placement == "weight" else max(1, cores - fallback - 1)
    return 1


class _Group(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelRoleSettings(_Group):
    """One model role's settings (``settings.primary``, ``settings.fallback``); defaults differ per role (``ROLE_DEFAULTS``).

    Admission (rampart.overload.admission): concurrent batches per device = runner threads; images
    dispatched at once = (concurrent_batches + 1) x max_batch_size; the wait queue holds throughput x
    queue_delay_ms images. Throughput is measured (warm-up, then every batch) unless throughput_ips > 0
    fixes it. BentoML's dispatcher cancels (503) a request it predicts will exceed max_latency_ms;
    Rampart's own deadlines do the shedding, so the default is the longest deadline and the dispatcher
    never sheds first.
    """

    model: str = Field(pattern=MODEL_TAG_PATTERN, description="the model's tag in the BentoML model store (written by "
                       "`python -m models.import_models`)")
    max_batch_size: int = Field(ge=2, description="BentoML adaptive batching: the largest batch")
    max_latency_ms: int = Field(60_000, gt=0, description="BentoML adaptive batching: the latency the dispatcher "
                                "never predicts past (it would cancel with 503; the longest deadline, so it never does)")
    concurrent_batches: int = Field(1, ge=1, description="batches computed at once (runner threads): the per-GPU bound")
    queue_delay_ms: int = Field(200, gt=0, description="acceptable queueing delay: queue depth = throughput × this")
    throughput_ips: float = Field(0.0, ge=0.0, description="fixes the model's throughput (images/s) instead of "
                                  "measuring it; 0: measured")
    # On a CPU-only host the fallback and the shadow yield the CPU to the primary, whose full answers are worth more,
    # and to the API layer, which must keep answering (and shedding) under overload. The primary shares the API
    # layer's 0: the API layer sleeps most of the time and gets what it needs on waking, and at 5x overload the
    # primary answered 16.1-18.4 images/s in the deadline at 0 against 12.3-16.3 at 5, 429s as cheap (median
    # 2.0-2.2 ms against 1.8-2.2), five rounds alternated (docs/benchmarks.md, "Niceness between BentoML's workers").
    nice: int = Field(ge=0, le=19, description="niceness of the runner process (CPU hosts: the fallback and the "
                      "shadow below the primary and the API layer)")
    # OpenMP's wait policy (OMP_WAIT_POLICY, PASSIVE unless set) is set in service.py.
    cpu_threads: int = Field(0, ge=0, description="intra-op CPU threads of the engine (torch for the primary, ONNX "
                             "Runtime for the fallback); 0: a rule from the cores and GPU "
                             "([CPU defaults](benchmarks.md#cpu-defaults))")


class PrimarySettings(ModelRoleSettings):
    """The primary's settings: a model role's, and the engine it runs on."""

    # "auto" runs a PyTorch primary on the faster of PyTorch and its checked ONNX export, measured per image at
    # each one's compute batch size when the runner starts on a CPU-only host, and on PyTorch on a GPU host. A
    # stored primary without an export runs on PyTorch. Default "torch" for now: with the faster ONNX primary
    # (33 images/s here) the 2-core host's other core saturates at 5x overload and the primary answered only
    # 0.40-0.48 of its capacity in time, against 0.70-0.81 on PyTorch (docs/engines.md). deploy/k8s sets "auto".
    engine: Literal["auto", "torch", "onnx"] = Field("torch", description="`auto`: on a CPU-only host the primary "
                                                     "runs on whichever of PyTorch and its verified ONNX export is "
                                                     "faster per image, timed at start; PyTorch on a GPU host; "
                                                     "`torch` or `onnx` forces one ([engines.md](engines.md))")


#: Per-role defaults of the fields ``ModelRoleSettings`` leaves without one.
ROLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "primary": {"model": "rampart-primary:latest", "max_batch_size": 16, "nice": 0},
    "fallback": {"model": "rampart-fallback:latest", "max_batch_size": 32, "nice": 19},
}


class InputSettings(_Group):
    """Upload and decode limits (checked from the header, before any pixel is decoded) and the image preparation."""

    max_body_bytes: int = Field(20_000_000, gt=0, description="byte cap per image")
    max_pixels: int = Field(50_000_000, gt=0, description="pixel cap, from the header, for every format; a WebP "
                            "may declare a quarter of it, a PNG or TIFF of more than 4 bytes a pixel 4 / its bytes "
                            "a pixel of it ([decoding.md](decoding.md#memory-bounded-by-output-pixels-in-every-mode))")
    min_side_px: int = Field(16, ge=1, description="shape limit: the shortest side")
    max_aspect_ratio: float = Field(10.0, ge=1.0, description="shape limit: long side over short side")
    max_frames: int = Field(100, ge=1, description="shape limit: frames of an animation")
    max_jpeg_scans: int = Field(DEFAULT_MAX_JPEG_SCANS, ge=1, description="decode cost beyond width × height, counted "
                                "before decoding (`rampart/inputs/decode_cost.py`): scans of a progressive JPEG "
                                "(libjpeg writes 6-10; each costs about 4 ms per 50 MP here)")
    max_chunks: int = Field(DEFAULT_MAX_CHUNKS, ge=1, description="chunks a parser steps through one by one (a 20 MB "
                            "GIF of full sub-blocks has about 80,000)")
    alpha_background: tuple[int, int, int] = Field((255, 255, 255), description="colour (RGB, 0..255, written "
                                                   "`255,255,255`) that transparent pixels are composited over")
    crop_margin: float = Field(1.14, ge=1.0, le=2.0, description="resize so the crop covers the bucket × this, then "
                               "centre-crop (1.14 ≈ 1/0.875, the EfficientNet reference crop)")
    max_batch_images: int = Field(16, ge=1, description="images per `/classify_batch`")
    # 512 MiB: two of the largest requests the caps allow (16 x 20 MB) do not fit at once, while a request
    # alone always does. The worker's peak RSS from bodies is up to about twice this (the body, then the
    # images cut from it); measured in docs/api.md, "Bodies held at once".
    max_held_body_bytes: int = Field(512 << 20, gt=0, description="bytes the request bodies of one API worker may "
                                     "hold at once: received, and inflated under `/v2`; a request whose bytes would "
                                     "pass it gets 429 `overloaded` (unless it is the only one holding any), and "
                                     "one larger than a single `/classify` upload may fill only three quarters "
                                     "of it, leaving the rest to single uploads ([api.md](api.md#bodies-held-at-once))")
    held_body_heap_trim_idle_s: float = Field(2.0, ge=0.0, description="an API worker gives the freed C heap that "
                                              "large request bodies (1 MiB or more each) left back to the system "
                                              "once no such request has ended for this long (glibc "
                                              "`malloc_trim`); 0: never")

    @field_validator("alpha_background")
    @classmethod
    def _channels_in_range(cls, colour: tuple[int, int, int]) -> tuple[int, int, int]:
        if not all(0 <= channel <= 255 for channel in colour):
            raise ValueError(f"each channel must be in 0..255, got {','.join(map(str, colour))}")
        return colour


class ConnectionSettings(_Group):
    """Client connections (rampart.compat.uvicorn_httptools.HeadLimitedProtocol) and clients that hang up (rampart.hangup)."""

    # A connection whose request head (request line and headers) is not complete this long after its first byte,
    # or after the connection was opened, is closed. Behind a proxy, keep_alive_timeout_s must exceed the proxy's
    # idle timeout to Rampart (docs/deploy.md, "Connection timeouts").
    request_head_timeout_ms: int = Field(10_000, gt=0, description="a connection whose request line and headers "
                                         "are not complete this long after their first byte (or after the "
                                         "connection was opened) is closed without an answer, on every request of "
                                         "a keep-alive connection ([Connection timeouts]"
                                         "(deploy.md#connection-timeouts))")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed this long "
                                        "after its last response (replaces uvicorn's `timeout_keep_alive`); behind a "
                                        "proxy, longer than the proxy's idle timeout to Rampart ([Connection "
                                        "timeouts](deploy.md#connection-timeouts))")
    # Its A/B arm is false.
    cancel_on_hang_up: bool = Field(True, description="a request whose client closes the connection after its body "
                                    "is stopped where it waits and its places released "
                                    "([overload.md](overload.md#clients-that-hang-up)); false: it runs to the end, "
                                    "and a client that only half-closed gets its answer")
    # Behind nginx (which buffers a body before it sends it on) bodies arrive at loopback speed.
    min_body_bytes_per_s: int = Field(16384, ge=0, description="a request holds an in-flight place only once its "
                                      "body is in; after `BODY_GRACE_MS` its body must arrive at this rate (at t "
                                      "after the head, (t − grace) × rate bytes), else it is cut with 408 "
                                      "`request_timeout` and the connection closed ([overload.md]"
                                      "(overload.md#slow-request-bodies)); 0: no rate check")
    body_grace_ms: int = Field(2000, ge=0, description="how long a body may take before the rate "
                               "`MIN_BODY_BYTES_PER_S` applies")


class DecodeSettings(_Group):
    """The decode pool (workers on the host, shared between the API workers) and the decoder's scale."""

    # Waiting uploads hold only their compressed bytes (already read); decoded pixels exist only in workers.
    mode: Literal["processes", "threads"] = Field("processes", description="`processes`: decode workers are "
                                                  "processes, killed and replaced when a decode overruns; `threads`: "
                                                  "threads of the API process, which keep their slot until an "
                                                  "overrunning decode ends (for comparison: `bench/decode_bench`)")
    workers: int = Field(2, ge=1, description="decode workers on the host (each API worker starts `DECODE_WORKERS // "
                         "API_WORKERS` of them, at least 1)")
    queue: int = Field(512, ge=0, description="uploads allowed to wait for a decode worker")
    # The event loop thread, which answers and sheds, stays ahead of them for the CPU.
    nice: int = Field(5, ge=0, le=19, description="niceness of the decode workers")
    timeout_ms: int = Field(3000, gt=0, description="longest one decode may run (422 `decode_timeout`; the worker is "
                            "killed and replaced)")
    png_decoder: Literal["libspng", "pillow"] = Field("libspng", description="`libspng`: a plain 8-bit RGB PNG "
                                                      "small enough to need no shrink is decoded by libspng, the same "
                                                      "pixels at about 0.6× Pillow's CPU; anything libspng refuses "
                                                      "goes to Pillow ([decoding.md](decoding.md)); `pillow`: always "
                                                      "Pillow")
    # 8 MiB: a decode's own blocks (frames, arrays, the upload) stay below the 4 MiB from which memory is mapped.
    heap_keep_mib: int = Field(8, ge=0, le=1024, description="freed C heap each decode worker keeps for the next "
                               "upload (glibc: trim threshold, blocks under half of it come from the heap); without "
                               "it every frame was mapped fresh, about a tenth of a small PNG's decode CPU "
                               "([decoding.md](decoding.md#the-decode-workers-heap)); 0: glibc's defaults")
    # 1.0: measured top-1 agreement in docs/decoding.md.
    oversample: float = Field(1.0, ge=1.0, le=8.0, description="source pixels per output pixel (each axis) the "
                              "decoder keeps: a JPEG is decoded at 1/2, 1/4 or 1/8 scale and any frame box-reduced "
                              "only as far as the model's bucket still gets this many ([decoding.md](decoding.md))")


class DeadlineSettings(_Group):
    """Deadlines (``X-Deadline-Ms``), end to end."""

    default_deadline_ms: int = Field(1000, gt=0, description="deadline when none is sent")
    # At most an hour: a stopping server waits up to this long for the requests it admitted, and BentoML's traffic
    # timeout is set from it; a value of 1e17 ms was taken and would have made a drain without end.
    max_deadline_ms: int = Field(60_000, gt=0, le=3_600_000, description="the cap on any deadline, and the longest a "
                                 "stopping server waits for the requests it admitted; at most 3600000 (an hour)")
    low_priority_deadline_ms: int = Field(10_000, gt=0, description="default deadline of `X-Priority: low` requests, "
                                          "bulk work that fills idle capacity ([planning.md](planning.md)); at most "
                                          "`MAX_DEADLINE_MS`")
    fallback_reserve_ms: int = Field(250, ge=0, description="part of each deadline kept for the fallback")
    answer_margin_ms: int = Field(20, ge=0, description="the pipeline stops this long (plus the event loop's recent "
                                  "lag) before the deadline")
    # The least time an idle server needs, after the answer margin, to decode one photo and have the fallback
    # classify it: measured 25 ms on the 2-core CI host (decode 5 ms, fallback call 20 ms: 5 transport,
    # 15 inference), 2026-12-01. The loop-lag reserve never cuts an accepted deadline's share below it.
    min_service_ms: int = Field(30, ge=1, description="the least working time every accepted deadline keeps; below "
                                "`ANSWER_MARGIN_MS` + this (50 ms) a deadline is 422 `deadline_too_short` "
                                "([clients.md](clients.md))")


class RunnerSettings(_Group):
    """Calls to the runners and the runners' own dispatch (docs/serving-cost.md)."""

    # Images bound for one bucket of one runner that wait in an API worker go in one call when a call for that
    # bucket returns (rampart.coalesce). One call out per bucket: at 5x overload on the 2-core host the primary's
    # core then sat idle 5-7 s of 20 waiting for round trips (2.2 s with two calls out), but with two, two
    # replicas sharing the host served less than with one and in-flight requests of a draining replica got the
    # static answer (docs/overload.md, "Predicting completion").
    coalescing: bool = Field(True, description="images bound for one bucket of one runner share a call, what arrives "
                             "meanwhile goes in the next ([serving-cost.md](serving-cost.md)); false: one call per image")
    calls_in_flight: int = Field(1, ge=1, description="with coalescing, calls out per bucket at most")
    low_priority_riders: bool = Field(True, description="with coalescing, waiting `X-Priority: low` images ride in a "
                                      "call that a normal or high image forms while no other normal or high image of "
                                      "the API worker is in the runner (`RUNNER_LOW_PRIORITY_RIDERS_AHEAD` relaxes "
                                      "this), up to the runner's compute batch size "
                                      "([planning.md](planning.md#the-low-priority-class-x-priority-low)); false: "
                                      "low images go only one at a time, into an idle runner")
    low_priority_riders_ahead: int = Field(
        0, ge=0, description="with riders, a low image joins a call only while at most this many other normal or high "
        "images of the API worker are in the runner (in calls out before it, which it does not delay) and none waits "
        "to be sent after it; 0: only while the call's images are all such work "
        "([planning.md](planning.md#riders-low-images-in-a-normal-call))")
    transport: Literal["lean", "proxy"] = Field("lean", description="how the entry service sends runner calls: "
                                                "`lean`, BentoML's wire format over Rampart's keep-alive HTTP/1.1 "
                                                "client (`rampart.runner_client`); `proxy`, BentoML's dependency "
                                                "proxy (httpx), also used wherever the runner has no socket address "
                                                "([serving-cost.md](serving-cost.md#the-runner-transport))")
    dispatch_wake: Literal["release", "poll"] = Field("release", description="how a runner's batch dispatcher waits "
                                                      "for its batch slot while a batch computes: `release` waits for "
                                                      "the slot to be released; `poll` is BentoML's own 1 ms poll, "
                                                      "kept for the A/B ([serving-cost.md](serving-cost.md#the-batch-"
                                                      "dispatchers-1-ms-poll))")
    # A traced graph runs its operators without the interpreter between them, so the runner's event loop thread no
    # longer stalls it at each operator waiting for the GIL: on the 2-core host the traced primary answered
    # 1.13-1.30x the closed-loop images/s and 1.38-1.69x the images/s in the deadline at 5x overload, three rounds
    # alternated (docs/engines.md, "The traced graph").
    torch_graph: Literal["traced", "eager"] = Field("traced", description="how a runner runs a PyTorch model on a "
                                                    "CPU: `traced`, a frozen TorchScript graph per input shape, "
                                                    "checked against the module (stored by the import; a shape without "
                                                    "a stored graph is traced and checked at warm-up, and runs "
                                                    "eagerly, with a warning, if it fails); `eager`, op by op from "
                                                    "Python. On a "
                                                    "GPU always eager ([engines.md](engines.md#the-traced-graph-pytorch-on-a-cpu))")
    # glibc keeps what a process frees in its arenas: after a 5x overload on the 2-core host the PyTorch primary held
    # 130 MiB and the fallback 100 MiB more than after warm-up, until trimmed (docs/engines.md, "Memory per process").
    heap_trim_idle_s: float = Field(2.0, ge=0.0, description="a runner gives its freed C heap back to the system once "
                                    "it has computed no batch for this long after computing some (glibc "
                                    "`malloc_trim`); 0: only after warm-up")
    timing_cache_dir: str = Field("", description="where a runner keeps its batch-size timings, so a restart on "
                                  "the same host with the same model, engine, threads and CPU skips measuring them "
                                  "(its warm-up still runs); empty: `$BENTOML_HOME/rampart-timings`; `off`: measure "
                                  "at every start ([engines.md](engines.md#timing-cache))")
    route: Literal["lean", "bentoml"] = Field("bentoml", description="how a runner answers its batch calls: "
                                              "`bentoml`, through BentoML's whole app; `lean`, with BentoML's "
                                              "parse, adaptive batching and answer but none of its per-request "
                                              "middlewares and endpoint glue (`rampart.compat.bentoml_runner_calls`, "
                                              "same bytes; the runners spend about a tenth less, the API worker "
                                              "3-6% more, see [serving-cost.md](serving-cost.md#runner-calls-in-"
                                              "front-of-bentomls-app))")
    access_log: bool = Field(False, description="BentoML's access line for every runner call (off: one log line per "
                             "request; see [Observability](observability.md), Logs)")


class AdmissionSettings(_Group):
    """How the admission gates predict completion (rampart.overload.admission)."""

    # "meter", images ahead x the busy-time meter's time per image; "service", the runner's own compute per image
    # plus a measured travel time (ServiceTime). "meter" by default (docs/overload.md, "Predicting completion").
    prediction: Literal[PREDICTIONS] = Field(  # type: ignore[valid-type]  # "meter" or "service"
        "meter", description="how a gate predicts completion: `meter`, images ahead × the measured time per image; "
        "`service`, a call's measured travel time + images ahead × the runner's own compute per image "
        "([overload.md](overload.md), \"Predicting completion\")")
    throughput_tau_ms: int = Field(5_000, gt=0, json_schema_extra={"flat": "throughput_tau_ms"},
                                   description="time constant of the measured throughput, in busy time (idle time "
                                   "does not count)")
    low_priority_arrival: Literal[LOW_ARRIVALS] = Field(  # type: ignore[valid-type]  # "idle-only" or "queue"
        "queue", description="what an `X-Priority: low` request finds while a normal or high one is queued: "
        "`idle-only`, 429 `higher_priority_waiting`; `queue`, a place behind them, dispatched after them and the "
        "first a full queue evicts ([planning.md](planning.md#the-low-priority-class-x-priority-low))")


class RoutingSettings(_Group):
    """Which model answers first (rampart.pipeline, docs/overload.md, "Cascade")."""

    # Both cascade defaults are the calibration's recommendation (python -m bench.cascade_eval,
    # docs/bench/cascade_eval.json "recommendation", run of 2026-11-30): msp at 0.42 is the lowest threshold with
    # >= 99% top-1 agreement with the primary alone on the 322 bundled photos, leaving 23.0% of them to the
    # fallback (margin: 17.7% at 0.32).
    mode: Literal["primary-first", "cascade", "primary-only"] = Field(
        "primary-first", json_schema_extra={"flat": "routing"},
        description="`primary-first`: the primary answers, the fallback only when the primary cannot; `cascade`: the "
        "fallback answers first and the primary only when the fallback is unsure (see [Cascade](overload.md#cascade)); "
        "`primary-only`: an experiment (see Experiments below)")
    confidence: Literal[CONFIDENCE_KINDS] = Field(  # type: ignore[valid-type]  # "msp" or "margin"
        "msp", description="in cascade mode, the fallback's confidence (`msp`: top-1 probability, `margin`: top-1 "
        "minus top-2)")
    threshold: float = Field(0.42, ge=0.0, le=1.0, description="in cascade mode, the least confidence at which the "
                             "fallback's answer is kept (the calibration's recommendation, "
                             "`docs/bench/cascade_eval.json`)")


class BreakerSettings(_Group):
    """The circuit breaker on the primary (rampart.overload.breaker)."""

    window_ms: int = Field(10_000, gt=0, description="the window the failure rate is counted over")
    min_calls: int = Field(10, ge=1, description="calls in the window before the breaker may open")
    failure_rate: float = Field(0.5, gt=0.0, le=1.0, description="share of failed calls in the window that opens it")
    open_ms: int = Field(5_000, gt=0, description="how long it stays open")
    probes: int = Field(3, ge=1, description="half-open probes (successes in a row) that close it")


class ShadowSettings(_Group):
    """Shadow traffic (rampart.shadow, docs/overload.md, "Shadow traffic").

    A candidate model gets a share of the /classify requests a model answered, after the answer is
    sent, only while the models are not busy (rampart.shadow.models_busy) and no request was shed
    for a second.
    """

    model: str = Field("", pattern=f"^$|{MODEL_TAG_PATTERN}", description="a candidate model's store tag; empty: off "
                       "(no third runner)")
    rate: float = Field(0.1, ge=0.0, le=1.0, description="share of model-answered `/classify` requests mirrored to "
                        "the candidate after the answer is sent (see [Shadow traffic](overload.md#shadow-traffic))")
    deadline_ms: int = Field(1000, gt=0, description="the candidate's own deadline per mirrored request")
    max_inflight: int = Field(2, ge=1, description="the candidate's calls outstanding at most (more are skipped)")
    nice: int = Field(19, ge=0, le=19, description="niceness of the candidate's runner")


class FaultSettings(_Group):
    """Fault injection for drills and tests (rampart.faults): off by default."""

    primary_delay_ms: int = Field(0, ge=0, description="every primary batch takes this much longer")
    primary_error_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of primary calls that fail")
    primary_hang: bool = Field(False, description="every primary call hangs until the fault ends")
    fallback_error_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of fallback calls that fail")
    shadow_delay_ms: int = Field(0, ge=0, description="every candidate (shadow) batch takes this much longer")
    shadow_error_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of candidate (shadow) calls that fail")
    decode_hang: bool = Field(False, description="every decode hangs before it starts, until the fault ends: drills "
                              "`decode_timeout` (the worker is killed and replaced)")
    file: str = Field("", description="a JSON file of `fault_*` keys, re-read while serving, that overrides the "
                      "settings above (a drill can start and stop a fault, including a hang, without a restart)")


class TelemetrySettings(_Group):
    """Tracing and monitoring that stays cheap under a storm of scrapes (rampart.telemetry, docs/observability.md)."""

    # Off: BentoML's tracing middleware costs about 0.3 ms of event-loop CPU per request even with no exporter
    # (bench/middleware_bench.py).
    trace_requests: bool = Field(False, description="OpenTelemetry spans for `/classify`, `/classify_batch` and the "
                                 "monitoring routes `/stats` and `/metrics` (off: see [Overload control]"
                                 "(overload.md#overload-control), BentoML's middlewares)")
    # Off: BentoML's tracing middleware in a runner costs its per-call stack about as much as in the entry
    # service, paid once per runner call (docs/serving-cost.md, "Runner calls without spans").
    trace_runner_calls: bool = Field(False, description="OpenTelemetry spans for the runners' routes (batch calls "
                                     "and `/stats`); also on with `TRACE_REQUESTS` ([serving-cost.md]"
                                     "(serving-cost.md#runner-calls-without-spans))")
    stats_runner_refresh_ms: int = Field(500, ge=0, description="`/stats` shows each runner's counters from a copy in "
                                         "the API worker, asked again when it is older than this, one call in flight "
                                         "per runner (`runner_age_ms` in the body says how old); 0: asked on every "
                                         "`/stats` ([Observability](observability.md), \"Cheap monitoring\")")
    metrics_render_interval_ms: int = Field(500, ge=0, description="`/metrics` is rendered (every process's metric "
                                            "files merged) at most once per this interval, each scrape answered by "
                                            "the next rendering begun after it arrived, shared with every scrape "
                                            "waiting for it; 0: each scrape renders its own")


class ExperimentSettings(_Group):
    """Switches for experiments, not for production (the ablation, bench.ablation, docs/benchmarks.md, "Ablation").

    Read them through ``Settings.admission_mode`` and ``Settings.honour_deadlines``; a value other than
    production's needs ``enabled`` (``RAMPART_EXPERIMENTS=true``), else ``Settings`` refuses to start.
    """

    enabled: bool = Field(False, json_schema_extra={"flat": "experiments"},
                          description="lets the switches below (and `ROUTING=primary-only`) take values other than "
                          "production's; without it such a value refuses to start")
    # rampart.overload.admission.ADMISSION_MODES: "full" sheds on the queue bound and on predicted lateness.
    admission: Literal[ADMISSION_MODES] = Field(  # type: ignore[valid-type]  # "full", "queue-bound" or "off"
        "full", json_schema_extra={"flat": "admission"},
        description="`full` (production) sheds on the queue bound and on predicted lateness; `queue-bound` sheds "
        "only when a gate's queue is full; `off` sheds nothing (unbounded model and decode queues, no in-flight bound)")
    honour_deadlines: bool = Field(True, json_schema_extra={"flat": "honour_deadlines"},
                                   description="false ignores the client's deadline: every request gets "
                                   "`MAX_DEADLINE_MS`, so nothing stops early and runners drop nothing")


#: The groups of ``Settings``: attribute -> (model class, prefix of its fields' flat names).
GROUPS: dict[str, tuple[type[_Group], str]] = {
    "primary": (PrimarySettings, "primary_"),
    "fallback": (ModelRoleSettings, "fallback_"),
    "inputs": (InputSettings, ""),
    "connections": (ConnectionSettings, ""),
    "decoding": (DecodeSettings, "decode_"),
    "deadlines": (DeadlineSettings, ""),
    "runners": (RunnerSettings, "runner_"),
    "admission": (AdmissionSettings, "admission_"),
    "routing": (RoutingSettings, "cascade_"),
    "breaker": (BreakerSettings, "breaker_"),
    "shadow": (ShadowSettings, "shadow_"),
    "faults": (FaultSettings, "fault_"),
    "telemetry": (TelemetrySettings, ""),
    "experiments": (ExperimentSettings, ""),
}

#: The host-wide settings left flat on ``Settings`` (flat name = attribute).
TOP_LEVEL = ("api_workers", "cpu_pinning", "gpu_memory_fraction", "cache_size")


def _flat_names() -> dict[str, tuple[str, str | None]]:
    """Flat name -> (group, field) for grouped settings, (name, None) for the top-level ones."""
    names: dict[str, tuple[str, str | None]] = {}
    for group, (model, prefix) in GROUPS.items():
        for field_name, field in model.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            flat = str(extra.get("flat", prefix + field_name))
            if flat in names:
                raise AssertionError(f"two settings have the flat name {flat}")
            names[flat] = (group, field_name)
    for name in TOP_LEVEL:
        names[name] = (name, None)
    return names


#: Every setting's flat name (``RAMPART_`` + its upper case is its variable) -> (group, field), or (name, None) for
#: a top-level one. The one mapping between the environment's names and the nested settings.
FLAT_NAMES: dict[str, tuple[str, str | None]] = _flat_names()

#: The production value of each experiment switch, by flat name (``RAMPART_ROUTING``: any but ``primary-only``).
_PRODUCTION = {"admission": ("full",), "honour_deadlines": (True,), "routing": ("primary-first", "cascade")}


class Settings(BaseModel):
    """All of Rampart's configuration, grouped (see the module docstring). Units are in each field's name.

    ``Settings(primary_max_batch_size=8)`` (flat names) and ``Settings(primary={"max_batch_size": 8})``
    are the same; each raises ``pydantic.ValidationError`` for a bad or unknown value.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    primary: PrimarySettings = Field(default_factory=lambda: PrimarySettings(**ROLE_DEFAULTS["primary"]))
    fallback: ModelRoleSettings = Field(default_factory=lambda: ModelRoleSettings(**ROLE_DEFAULTS["fallback"]))
    inputs: InputSettings = Field(default_factory=InputSettings)
    connections: ConnectionSettings = Field(default_factory=ConnectionSettings)
    decoding: DecodeSettings = Field(default_factory=DecodeSettings)
    deadlines: DeadlineSettings = Field(default_factory=DeadlineSettings)
    runners: RunnerSettings = Field(default_factory=RunnerSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    shadow: ShadowSettings = Field(default_factory=ShadowSettings)
    faults: FaultSettings = Field(default_factory=FaultSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    experiments: ExperimentSettings = Field(default_factory=ExperimentSettings)

    # Processes of the entry (API) service that accept HTTP requests (`bentoml.service(workers=...)`). Each has its
    # own admission gates, which divide the runners' capacity between the workers (rampart.overload.admission; why:
    # docs/overload.md). At most the smaller max_batch_size, so every worker's gate keeps at least one image of each
    # batch and their shares add up to the runner's.
    api_workers: int = Field(1, ge=1, description="processes of the entry service (HTTP, admission, pipeline); each "
                             "worker's admission gates get 1/N of each runner; at most the smaller `MAX_BATCH_SIZE`. "
                             "1 is the fastest on the 2-core host; the rule for bigger hosts: [Overload control]"
                             "(overload.md#overload-control), several API workers")
    # CPU placement (rampart.cores): replicas sharing one host (deploy.cluster) use "off": under "reserve" each
    # would reserve the same cores, and under "weight" each primary would take every core.
    cpu_pinning: Literal["weight", "reserve", "off"] = Field(
        "weight", description="CPU placement on a CPU-only host. `weight`: nothing is pinned; the primary's engine "
        "gets a thread per core and uses the whole CPU when nothing else needs it, and the API layer and the primary "
        "(niceness 0), the decoders (5), the fallback and the shadow (19) share it by niceness when they do; "
        "`reserve`: the primary runner (and the shadow) is pinned to its own cores (as many as its threads) and "
        "every other process to the rest, none with one core or under a cgroup CPU quota below the visible cores; "
        "`off`: the OS places everything and the primary's threads leave a core to the rest. A GPU host pins "
        "nothing (see [CPU placement](benchmarks.md#cpu-placement-the-primary-keeps-its-capacity-under-overload)). "
        "`deploy.cluster` replicas default to `off`")
    gpu_memory_fraction: float = Field(0.9, gt=0.0, le=1.0, description="share of the GPU's memory the primary may "
                                       "allocate (`torch.cuda.set_per_process_memory_fraction`)")
    cache_size: int = Field(1024, ge=0, description="entries of the content-hash answer cache, used when both models "
                            "fail; 0 turns it off")

    @model_validator(mode="before")
    @classmethod
    def _fold_flat_names(cls, data: Any) -> Any:
        """Moves flat keyword arguments (``primary_max_batch_size=8``) into their groups; other keys stay as given."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        groups: dict[str, dict[str, Any]] = {}
        for key in list(data):
            # ``experiments`` is both a group and the flat name of its flag: a dict or model is the group.
            if key in GROUPS and (isinstance(data[key], (dict, BaseModel))):
                continue
            if key in FLAT_NAMES and FLAT_NAMES[key][1] is not None:
                group, field_name = FLAT_NAMES[key]
                groups.setdefault(group, {})[field_name] = data.pop(key)
        for group in {*groups, *ROLE_DEFAULTS}:
            given = data.get(group)
            if isinstance(given, BaseModel):
                if group not in groups:
                    continue
                given = given.model_dump(exclude_unset=group not in ROLE_DEFAULTS)
            # A model role's own defaults, then what was given nested, then the flat names.
            data[group] = {**ROLE_DEFAULTS.get(group, {}), **(given or {}), **groups.get(group, {})}
        return data

    @model_validator(mode="after")
    def _deadlines_consistent(self) -> "Settings":
        deadlines = self.deadlines
        if deadlines.default_deadline_ms > deadlines.max_deadline_ms:
            raise ValueError(f"default_deadline_ms={deadlines.default_deadline_ms} exceeds "
                             f"max_deadline_ms={deadlines.max_deadline_ms}")
        # Only a low default set on purpose is refused; the built-in 10 s yields to a shorter
        # max_deadline_ms (rampart.api.http.parse_deadline caps it), so such a server still starts.
        if ("low_priority_deadline_ms" in deadlines.model_fields_set
                and deadlines.low_priority_deadline_ms > deadlines.max_deadline_ms):
            raise ValueError(f"low_priority_deadline_ms={deadlines.low_priority_deadline_ms} exceeds "
                             f"max_deadline_ms={deadlines.max_deadline_ms}")
        return self

    @model_validator(mode="after")
    def _workers_fit_the_batches(self) -> "Settings":
        smallest = min(self.primary.max_batch_size, self.fallback.max_batch_size)
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
        return self.deadlines.answer_margin_ms + self.deadlines.min_service_ms

    @model_validator(mode="after")
    def _min_deadline_below_the_default(self) -> "Settings":
        if self.min_deadline_ms > self.deadlines.default_deadline_ms:
            raise ValueError(f"min_deadline_ms (answer_margin_ms + min_service_ms = {self.min_deadline_ms}) exceeds "
                             f"default_deadline_ms={self.deadlines.default_deadline_ms}")
        return self

    @model_validator(mode="after")
    def _experiments_need_the_flag(self) -> "Settings":
        if self.experiments.enabled:
            return self
        values = {"admission": self.experiments.admission, "honour_deadlines": self.experiments.honour_deadlines,
                  "routing": self.routing.mode}
        for flat, value in values.items():
            if value not in _PRODUCTION[flat]:
                shown = str(value).lower() if isinstance(value, bool) else value
                raise ValueError(f"{variable_of(flat)}={shown} is an experiment's setting (the ablation, "
                                 f"docs/configuration.md, \"Experiments\"): set {ENV_PREFIX}EXPERIMENTS=true to use it")
        return self

    @property
    def admission_mode(self) -> str:
        """The admission gates' mode (``rampart.overload.admission.ADMISSION_MODES``): ``full`` unless an experiment says otherwise."""
        return self.experiments.admission if self.experiments.enabled else "full"

    @property
    def honour_deadlines(self) -> bool:
        """Whether the client's deadline is honoured: true unless an experiment says otherwise."""
        return self.experiments.honour_deadlines if self.experiments.enabled else True

    @property
    def decode_workers_per_api_worker(self) -> int:
        """Decode workers each API worker starts: ``decoding.workers // api_workers``, at least 1.

        ``decoding.workers`` counts decoders on the whole host, so adding API workers does
        not multiply the decode processes competing for the same cores (only when there
        are more API workers than ``decoding.workers`` does each still get one).
        """
        return max(1, self.decoding.workers // self.api_workers)

    def flat(self, name: str) -> Any:
        """The value of the setting with flat name ``name`` (``"primary_max_batch_size"``); ``KeyError`` if unknown."""
        group, field_name = FLAT_NAMES[name]
        value = getattr(self, group)
        return value if field_name is None else getattr(value, field_name)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        """Build settings from ``RAMPART_*`` variables (``os.environ`` by default), one per flat name (``FLAT_NAMES``).

        Tuples are written comma-separated (``RAMPART_ALPHA_BACKGROUND=0,0,0``); other ``RAMPART_*``
        variables are ignored. Raises ``pydantic.ValidationError`` for a malformed or out-of-range value, each
        error located at the variable that set it and the setting's nested path
        (``RAMPART_MAX_PIXELS (inputs.max_pixels)``): the operator wrote the variable, not the path.
        """
        environ = os.environ if environ is None else environ
        _warn_of_misspelt_variables(environ)
        values: dict[str, object] = {}
        for name in FLAT_NAMES:
            raw = environ.get(variable_of(name))
            if raw is None:
                continue
            values[name] = raw.split(",") if _field(name).annotation == tuple[int, int, int] else raw
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise _located_at_variables(error) from None


#: (group, field) -> flat name: the inverse of ``FLAT_NAMES``, for locating a validation error at its variable.
_FLAT_NAME_OF = {path: name for name, path in FLAT_NAMES.items()}


def _located_at_variables(error: ValidationError) -> ValidationError:
    """``error`` with each location that is a setting rewritten as ``RAMPART_<NAME> (group.field)`` (the rest of the
    location, such as a tuple's index, kept after it); errors of no one setting (two deadlines that disagree) keep
    theirs. The same ``ValidationError`` type, so callers catch it as before; ``error`` itself if pydantic cannot
    rebuild one of its errors."""
    rebuilt = []
    for detail in error.errors(include_url=False):
        entry = {"type": detail["type"], "loc": _at_variable(tuple(detail["loc"])), "input": detail["input"]}
        if "ctx" in detail:
            entry["ctx"] = detail["ctx"]
        rebuilt.append(entry)
    try:
        return ValidationError.from_exception_data(f"{ENV_PREFIX}* settings", rebuilt)
    except (TypeError, KeyError, ValueError):
        return error


def _at_variable(loc: tuple) -> tuple:
    """A validation error's location ``loc`` with the setting it starts with (``("inputs", "max_pixels", ...)`` or
    the top-level ``("api_workers", ...)``) as ``RAMPART_<NAME> (group.field)``; ``loc`` itself when it names none."""
    for path, rest in ((loc[:2], loc[2:]), ((*loc[:1], None), loc[1:])):
        name = _FLAT_NAME_OF.get(path)
        if name is not None:
            shown = ".".join(str(part) for part in path if part is not None)
            return (f"{variable_of(name)} ({shown})", *rest)
    return loc


def _warn_of_misspelt_variables(environ) -> list[str]:
    """Log a warning for each ``RAMPART_*`` variable that is no setting but nearly spells one
    (``RAMPART_MAX_BODY_BYTE``): it is ignored, as every unknown variable is (scripts have their own, such as
    ``RAMPART_URL``), so a typo would otherwise leave the default in force unnoticed. Returns the warnings."""
    known = [variable_of(name) for name in FLAT_NAMES]
    warnings = []
    for variable in environ:
        if variable.startswith(ENV_PREFIX) and variable not in known:
            close = difflib.get_close_matches(variable.upper(), known, n=1, cutoff=0.85)
            if close:
                warnings.append(f"{variable} is not a setting and is ignored; did you mean {close[0]}?")
                logging.getLogger("rampart.config").warning(warnings[-1])
    return warnings


def _field(name: str):
    """The pydantic ``FieldInfo`` of the setting with flat name ``name``."""
    group, field_name = FLAT_NAMES[name]
    if field_name is None:
        return Settings.model_fields[group]
    return GROUPS[group][0].model_fields[field_name]


def _shown(value: Any) -> str:
    """A default as the table writes it: ``true``, ``255,255,255``, ``empty``, numbers and words as they are."""
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, tuple):
        return "`" + ",".join(str(v) for v in value) + "`"
    if value == "":
        return "empty"
    return f"`{value}`"


def settings_table() -> str:
    """The markdown table of every ``RAMPART_*`` variable: variable, default, nested path, description.

    One row per flat name, in ``FLAT_NAMES`` order (by group); defaults are ``Settings()``'s. Returned
    with a trailing newline; docs/configuration.md embeds it unchanged.
    """
    defaults = Settings()
    rows = ["| variable | default | setting | meaning |", "| --- | --- | --- | --- |"]
    for name, (group, field_name) in FLAT_NAMES.items():
        path = group if field_name is None else f"{group}.{field_name}"
        description = (_field(name).description or "").replace("|", "\\|")
        rows.append(f"| `{variable_of(name)}` | {_shown(defaults.flat(name))} | `{path}` | {description} |")
    return "\n".join(rows) + "\n"


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings, read from the environment on first use."""
    return Settings.from_env()


if __name__ == "__main__":
    if sys.argv[1:] != ["--table"]:
        sys.exit("usage: python -m rampart.config --table  (prints docs/configuration.md's table of settings)")
    sys.stdout.write(settings_table())
