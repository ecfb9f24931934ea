"""The bucketed, adaptive-batching API shared by both runner services.

Each runner exposes one batchable BentoML API per size bucket (``square``,
``landscape``, ``portrait``). BentoML keeps one adaptive-batching dispatcher per
API, so a batch never mixes shapes; ``BucketedRunner.run_bucket`` asserts that
anyway, drops items whose deadline has already passed before computing (a TTL
drop, counted), stacks the rest into a uint8 N×H×W×3 array and calls the engine.

Lifecycle: ``__init__`` warms the engine up before the process answers anything
(``/readyz`` is 503 until then), and on SIGTERM a runner keeps serving until the
entry service has drained and exited (``rampart.api.lifecycle``), so no admitted
request loses its model.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import threading
import time
from dataclasses import dataclass

import bentoml
import numpy as np
from pydantic import Field


from inference.engine_choice import (CHILD_TIMED_RUNS, IN_PROCESS_TIMED_RUNS, EngineChoice, available_engines, best_size,
                                     candidate_sizes, choose_engine, measure_in_child, time_batch_sizes, warm_up_sizes)
from inference.engine_choice import logger as engine_log
from inference.stored import load_engine
from inference.timing_cache import TimingCache, TimingKey
from rampart.api.lifecycle import RUNNER_EXIT_MARGIN_S, intercept_exit_signals, wait_for_entry_workers
from rampart.api.lifecycle import logger as lifecycle_log
from rampart.compat import check_versions
from rampart.api.arrival import route_at_front
from rampart.compat.bentoml_batching import dispatch_when_free, wake_on_release
from rampart.compat.bentoml_runner_calls import lean_batch_routes, lean_calls
from rampart.compat.bentoml_private import debug_mode, model_store_dir
from rampart.config import Settings, default_cpu_threads, get_settings, variable_of
from rampart.cores import available_cores, cpu_quota_cores, place_this_process, usable_cores
from rampart.faults import FaultInjector, FaultSpec
from rampart.heap import IdleTrim, release_heap
from rampart.inputs.buckets import BUCKET_NAMES, Bucket, buckets_for_resolution
from rampart.telemetry import metrics

__all__ = ["RunnerItem", "RunnerResult", "BucketedRunner", "RunnerSpec", "runner_spec", "load_engine", "define_runner",
           "dispatch_when_free", "pick_engine", "runner_tracing_config"]

check_versions()  # the runner processes run on the pinned BentoML, uvicorn and httptools, or not at all
dispatch_when_free()  # BentoML's batcher learns to hold a lone request back after an overload: see the function
if get_settings().runners.dispatch_wake == "release":
    wake_on_release()  # BentoML's batcher polls every 1 ms for a free batch slot: see the function


class RunnerItem(bentoml.IODescriptor):
    """One image for a runner: uint8 ``pixels`` (H×W×3) and ``deadline_epoch_s``, the end of the calling
    model's share of the request's deadline as ``time.time()`` seconds (``rampart.overload.deadline.Deadline.epoch_s``)."""

    pixels: np.ndarray
    deadline_epoch_s: float
    request_id: str = ""


class RunnerResult(bentoml.IODescriptor):
    """A runner's result for one image: float32 ``probs`` (C,), or ``expired`` (and empty ``probs``) when TTL-dropped.

    ``batch_size`` is how many live items shared the forward pass; ``inference_ms``
    is its duration. This is the wire form; the entry service's pipeline holds it as
    ``rampart.lane.RunnerResult`` (``RunnerResult.from_wire``: ``probs`` None when expired).
    """

    probs: np.ndarray = Field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    expired: bool = False
    batch_size: int = 0
    inference_ms: float = 0.0


class BucketedRunner:
    """Base of a runner service: engine, buckets, TTL drops and fault injection.

    Subclasses set ``self.engine`` (with ``predict(uint8 N×H×W×3) -> float32 N×C``),
    ``self.buckets``, ``self.faults`` and call ``self.warm_up()`` in ``__init__``.
    """

    engine: object
    buckets: dict[str, Bucket]
    faults: FaultInjector
    max_batch_size: int
    engine_choice = EngineChoice("", "auto", "not loaded yet")
    model_tag = ""
    timings_source = "measured"
    timing_cache_files: list[str] = []

    def setup(self, role: str, resolution: int, faults: FaultInjector, max_batch_size: int, nice: int = 0,
              max_deadline_ms: int = 60_000) -> None:
        """Set buckets, faults and counters, lower this process's CPU priority to ``nice`` and pin it to
        its cores (``rampart.cores.place_this_process``).

        Call once from the subclass ``__init__``, before warm-up creates the
        inference threads (they inherit the niceness and cores of the thread creating them).
        ``max_deadline_ms`` bounds how long the runner outlives a SIGTERM (see
        ``outlive_entry_service``).
        """
        place_this_process(role, get_settings(), nice)
        if get_settings().runners.route == "lean":  # batch calls answered in front of BentoML's app, same bytes
            route_at_front(functools.partial(lean_batch_routes,
                                             tracing_excluded=bool(runner_tracing_config(get_settings()))))
        self.max_deadline_ms = max_deadline_ms
        self.role = role
        metrics.init_runner_series(role)
        self.buckets = buckets_for_resolution(resolution)
        self.faults = faults
        self.max_batch_size = max_batch_size
        self.ttl_dropped = 0
        self.warmup_ms_per_image = 0.0
        self.warmup_s = 0.0
        self.compute_batch_size = max_batch_size
        self.warmed_sizes: list[int] = []
        self.size_timings: dict[int, float] = {}
        self.engine_choice = EngineChoice("", "auto", "not loaded yet")
        self.heap_trim = IdleTrim(get_settings().runners.heap_trim_idle_s)
        self._lock = threading.Lock()
        self._ready = False

    def warm_up(self, timings: dict[int, float] | None = None, cache: TimingCache | None = None,
                threads: int = 0) -> None:
        """Find the compute batch size, warm every bucket at the sizes that will be computed, give back memory.

        ``timings`` (ms per image by batch size, ``inference.engine_choice.time_batch_sizes``):
        when None, every size of ``candidate_sizes(max_batch_size)`` is timed here on the
        square bucket (one untimed run, best of ``IN_PROCESS_TIMED_RUNS``), or read from ``cache``
        (``inference.timing_cache``; ``threads``: the engine's intra-op threads, part of the key)
        when an earlier start on this host timed the same thing (``cache.source`` then says
        which). ``compute_batch_size`` is the size with
        the most images per second (the smallest within 10% of it: ``best_size``), and
        ``run_bucket`` computes larger adaptive batches in chunks of it, so only ``warm_up_sizes(compute_batch_size)`` are then run on every
        bucket: the first real request never pays for kernel selection or allocation, and no
        larger batch ever reaches the engine. On a GPU the compute size is normally the
        largest; on a CPU often a small one (on the 2-core CI machine EfficientNet-Lite2 in
        PyTorch does 89 images/s at batch 2 and 51 at 16). ``warmup_ms_per_image`` at that
        size seeds the entry service's throughput estimate
        (``rampart.overload.admission.ThroughputMeter``). Afterwards the C heap is trimmed
        (``release_heap``): what the timing's larger batches left goes back to the system (and a served runner
        then starts ``heap_trim``, which trims it again each time the runner goes idle after computing batches).
        """
        started = time.perf_counter()
        square = self.buckets["square"].shape
        if timings is None:
            name, sizes = self.engine_choice.engine or "engine", candidate_sizes(self.max_batch_size)
            def measure() -> dict[str, dict[int, float]]:
                return {name: time_batch_sizes(self.engine.predict, square, sizes, IN_PROCESS_TIMED_RUNS)}

            if cache is None:
                timings = measure()[name]
            else:
                key = timing_key(self.model_tag, (name,), threads, square, sizes, IN_PROCESS_TIMED_RUNS,
                                 getattr(self.engine, "graph", ""))
                timings = cache.timings(key, measure)[name]
        self.size_timings = timings
        self.compute_batch_size = best_size(timings)
        self.warmup_ms_per_image = timings[self.compute_batch_size]
        self.warmed_sizes = warm_up_sizes(self.compute_batch_size)
        for bucket in self.buckets.values():
            for size in self.warmed_sizes:
                self.engine.predict(np.zeros((size, *bucket.shape), dtype=np.uint8))
        self.warmup_s = time.perf_counter() - started
        # Start-up objects (model, framework) leave the garbage collector's reach, so
        # collections during serving stay short (Python gc.freeze docs).
        gc.collect()
        gc.freeze()
        release_heap()
        self._ready = True

    @bentoml.api(route="/stats")
    async def stats(self) -> dict:
        """Counters of this runner: ``warmup_ms_per_image`` (ms), ``warmup_s`` (duration of ``warm_up``, s),
        ``timings_source`` ("measured" at this start, or "cache": ``inference.timing_cache``), ``timing_cache_files``
        (the cache's files this start read or wrote: the engine choice's, then the warm-up's), ``compute_batch_size``, ``warmed_batch_sizes``, ``ttl_dropped``, ``oom_splits`` and ``heap_trims`` (counts; ``rampart.heap.IdleTrim``),
        ``torch_graph``: how a torch engine runs the model (``inference.engines.TorchClassifier.graphs``: mode, and
        each input shape's "stored", "traced" or why it runs eagerly; None on ONNX),
        ``cores``: the CPU ids this runner may run on (``rampart.cores``), and ``engine``: the engine it
        computes on and why (``inference.engine_choice.EngineChoice.as_stats``: engine, mode, reason,
        and of each engine measured ms_per_image, compute_batch_size and ms_per_image_by_batch_size), and
        ``lean_calls``: batch calls answered in front of BentoML's app, by route (``rampart.compat.bentoml_runner_calls``;
        only with ``RAMPART_RUNNER_ROUTE=lean``)."""
        return {
            "cores": usable_cores(),
            "engine": self.engine_choice.as_stats(),
            "warmed_batch_sizes": self.warmed_sizes,
            "warmup_ms_per_image": self.warmup_ms_per_image,
            "warmup_s": round(self.warmup_s, 3),
            "timings_source": self.timings_source,
            "timing_cache_files": self.timing_cache_files,
            "compute_batch_size": self.compute_batch_size,
            "ttl_dropped": self.ttl_dropped,
            "oom_splits": getattr(self.engine, "oom_splits", 0),
            "heap_trims": self.heap_trim.trims,
            "torch_graph": self.engine.graphs() if hasattr(self.engine, "graphs") else None,
            "lean_calls": lean_calls(),
        }

    def __is_ready__(self) -> bool:
        return self._ready

    @bentoml.on_startup
    def keep_serving_through_the_drain(self) -> None:
        """Under ``bentoml serve``: on SIGTERM, go on serving until the entry service has exited."""
        intercept_exit_signals(self.outlive_entry_service)

    async def outlive_entry_service(self, signum: int) -> None:
        """Wait until no entry-service worker is alive, at most ``max_deadline_ms`` + ``RUNNER_EXIT_MARGIN_S``.

        The entry service drains its admitted requests for up to ``max_deadline_ms``
        and calls this runner meanwhile; a runner that exited at once would leave
        them without a model.
        """
        limit_s = self.max_deadline_ms / 1000 + RUNNER_EXIT_MARGIN_S
        lifecycle_log.info("%s runner: signal %d, serving until the entry service has exited (at most %.0f s)",
                    self.role, signum, limit_s)
        started = time.monotonic()
        if await wait_for_entry_workers(limit_s):
            lifecycle_log.info("%s runner: entry service gone after %.1f s; exiting", self.role, time.monotonic() - started)
        else:
            lifecycle_log.warning("%s runner: entry service still running after %.0f s; exiting anyway", self.role, limit_s)

    def _live(self, items: list[RunnerItem]) -> list[int]:
        """Indices of the items whose deadline (epoch s) is still ahead; the others are counted as TTL drops."""
        now = time.time()
        live = [i for i, item in enumerate(items) if item.deadline_epoch_s > now]
        if len(live) < len(items):
            with self._lock:
                self.ttl_dropped += len(items) - len(live)
            metrics.TTL_DROPPED.labels(self.role).inc(len(items) - len(live))
        return live

    def run_bucket(self, bucket_name: str, items: list[RunnerItem]) -> list[RunnerResult]:
        """Compute one adaptive batch of ``bucket_name`` items; returns one result per item.

        Items whose deadline has passed are not computed (``RunnerResult(expired=True)``): checked after an
        injected delay or hang (``rampart.faults``), so a stalled runner that resumes drops what expired
        meanwhile instead of spending CPU or GPU time on answers nobody waits for.
        """
        bucket = self.buckets[bucket_name]
        inflight = metrics.INFLIGHT_BATCHES.labels(self.role)
        inflight.inc()
        try:
            self.faults.before_batch()
            live = self._live(items)
            if not live:
                return [RunnerResult(expired=True) for _ in items]
            for i in live:
                if items[i].pixels.shape != bucket.shape:
                    raise ValueError(
                        f"bucket {bucket_name!r} expects {bucket.shape}, got {items[i].pixels.shape}: a batch never mixes shapes"
                    )
            batch = np.stack([items[i].pixels for i in live]).astype(np.uint8, copy=False)
            start = time.perf_counter()
            step = self.compute_batch_size
            probs = np.concatenate([self.engine.predict(batch[i:i + step]) for i in range(0, len(batch), step)])
            inference_ms = (time.perf_counter() - start) * 1000.0
        finally:
            inflight.dec()
            self.heap_trim.worked()
        results = [RunnerResult(expired=True) for _ in items]
        metrics.BATCH_SIZE.labels(self.role, bucket_name).observe(len(live))
        metrics.update_process_rss(self.role)
        gpu = getattr(self.engine, "gpu_memory", lambda: None)()
        if gpu is not None:
            metrics.GPU_MEMORY_USED.labels(gpu[0]).set(gpu[1])
            metrics.GPU_MEMORY_TOTAL.labels(gpu[0]).set(gpu[2])
        if probs.shape[0] != len(live):
            raise RuntimeError(f"engine returned {probs.shape[0]} rows for a batch of {len(live)}")
        for row, i in enumerate(live):
            results[i] = RunnerResult(probs=probs[row], batch_size=len(live), inference_ms=inference_ms)
        return results


def runner_access_log_enabled() -> bool:
    """Whether the runners write BentoML's access line for every call (batch and ``/stats``).

    Off by default: the entry service already writes one JSON line per request
    (``rampart.telemetry.accesslog``), and the runners' lines doubled the log. On with
    ``RAMPART_RUNNER_ACCESS_LOG=true`` or BentoML's debug mode (``bentoml serve --debug``
    or ``BENTOML_DEBUG=true``), read when the runner class is defined.
    """
    return get_settings().runners.access_log or debug_mode()


@dataclass(frozen=True)
class RunnerSpec:
    """What one runner service is, from the settings (``runner_spec``).

    ``role`` ("primary", "fallback" or "shadow") names the service ``rampart_<role>``;
    ``tag`` is the model in the store (empty: none, the service is declared but never
    started); ``max_batch_size`` and ``max_latency_ms`` configure BentoML's adaptive
    batching; ``concurrent_batches`` is the runner's thread count; ``nice`` its CPU
    niceness; ``faults`` what to inject; ``memory_fraction`` the share of the GPU's memory
    a PyTorch model may take; ``timeout_s`` BentoML's traffic timeout (s); ``cpu_threads``
    the engine's intra-op CPU threads (0: ``rampart.config.default_cpu_threads`` under ``placement``,
    ``Settings.cpu_pinning``).
    """

    role: str
    tag: str
    max_batch_size: int
    max_latency_ms: int
    concurrent_batches: int
    nice: int
    faults: FaultSpec
    memory_fraction: float
    timeout_s: float
    cpu_threads: int = 0
    placement: str = "weight"


def runner_spec(settings: Settings, role: str) -> RunnerSpec:
    """The ``RunnerSpec`` of ``role`` from ``settings``; raises ``ValueError`` for another role.

    The shadow runner gets batches of at most ``shadow_max_inflight`` (never more are
    sent), what the primary leaves of the GPU's memory, and a timeout from its own deadline.
    """
    longest_s = settings.deadlines.max_deadline_ms / 1000 + 10
    if role in ("primary", "fallback"):
        model = settings.primary if role == "primary" else settings.fallback
        faults = (FaultSpec(settings.faults.primary_delay_ms, settings.faults.primary_error_rate,
                            settings.faults.primary_hang) if role == "primary"
                  else FaultSpec(error_rate=settings.faults.fallback_error_rate))
        return RunnerSpec(role, model.model, model.max_batch_size, model.max_latency_ms, model.concurrent_batches,
                          model.nice, faults, settings.gpu_memory_fraction, longest_s, model.cpu_threads,
                          settings.cpu_pinning)
    if role == "shadow":
        return RunnerSpec(role, settings.shadow.model, max(2, settings.shadow.max_inflight), settings.deadlines.max_deadline_ms,
                          1, settings.shadow.nice,
                          FaultSpec(settings.faults.shadow_delay_ms, settings.faults.shadow_error_rate),
                          max(0.05, 1.0 - settings.gpu_memory_fraction), settings.shadow.deadline_ms / 1000 + 10, 1)
    raise ValueError(f"unknown runner role {role!r}")


def engine_cpu_threads(spec: RunnerSpec) -> int:
    """``spec.cpu_threads``, or when 0 the rule ``default_cpu_threads`` for the cores this process may keep busy
    (``rampart.cores.available_cores``: usable, within the CPU quota) and GPU under ``spec.placement``."""
    if spec.cpu_threads:
        return spec.cpu_threads
    from inference.engines import cuda_present

    return default_cpu_threads(spec.role, available_cores(), cuda_present(), spec.placement)


def timing_key(model_tag: str, engines: tuple[str, ...], threads: int, shape: tuple[int, ...], sizes: list[int],
               runs: int, torch_graph: str = "") -> TimingKey:
    """The ``inference.timing_cache.TimingKey`` of timing ``engines`` of the model ``model_tag`` ("name:version")
    with ``threads`` intra-op threads on batches of ``shape`` at ``sizes`` (best of ``runs``), torch running the
    module as ``torch_graph`` (kept only when "torch" is among ``engines``), in this process's cores and CPU
    quota (``rampart.cores``)."""
    return TimingKey(model_tag, tuple(engines), threads, tuple(shape), tuple(sizes), runs, len(usable_cores()),
                     cpu_quota_cores(), torch_graph if "torch" in engines else "")


def pick_engine(spec: RunnerSpec, model, settings: Settings, threads: int,
                shape: tuple[int, int, int], cache: TimingCache | None = None) -> EngineChoice:
    """The engine ``spec.role``'s runner computes ``model`` (a ``bentoml.Model``) on, logged once.

    The primary follows ``settings.primary.engine`` (``inference.engine_choice.choose_engine``);
    on a CPU-only host under "auto" both engines are timed in one child process under this
    process's pinning (call after ``setup``), with ``threads`` intra-op threads, on ``shape``
    at ``candidate_sizes(spec.max_batch_size)`` (best of ``CHILD_TIMED_RUNS``), or read from ``cache``
    (``inference.timing_cache``) when an earlier start on this host timed the same. Every other runner uses
    its model's own engine.
    A stored primary without an ONNX export runs on torch, with a warning naming the model.
    """
    from inference.engines import cuda_present

    meta = model.info.metadata
    available = available_engines(meta)
    if spec.role != "primary":
        choice = choose_engine("auto", available[:1], cuda_present(), lambda engines: {})
    else:
        sizes = candidate_sizes(spec.max_batch_size)

        def measure(engines: tuple[str, ...]) -> dict[str, dict[int, float]]:
            def in_child() -> dict[str, dict[int, float]]:
                return measure_in_child(model.path, dict(meta), engines, threads, shape, sizes, spec.memory_fraction,
                                        CHILD_TIMED_RUNS, torch_graph=settings.runners.torch_graph)

            if cache is None:
                return in_child()
            return cache.timings(timing_key(str(model.tag), engines, threads, shape, sizes, CHILD_TIMED_RUNS,
                                            settings.runners.torch_graph), in_child)

        choice = choose_engine(settings.primary.engine, available, cuda_present(), measure)
        if "onnx" not in available and meta.get("onnx_export_error"):
            engine_log.warning("primary runner: %s has no ONNX export (it failed at import: %s); running on torch",
                               model.tag, meta["onnx_export_error"])
        elif "onnx" not in available:
            engine_log.warning("primary runner: %s has no ONNX export (imported before the export existed); "
                               "running on torch. `python -m models.import_models` adds it.", model.tag)
    engine_log.info("%s runner: engine %s (%s: %s)", spec.role, choice.engine, choice.mode, choice.reason)
    return choice


def require_stored_model(tag: str, role: str) -> None:
    """Raise ``RuntimeError`` naming the way out when ``tag`` is not in the local BentoML model store.

    BentoML itself resolves a missing model only when a runner starts, in each worker (which the server then
    restarts), and says that it "could not be found locally" nor in a "cloud context". Rampart never downloads a
    model at run time: the default models are imported by ``make models`` (``python -m models.import_models``).
    Called where each runner service is defined, so ``bentoml serve`` (and ``bentoml build``) stop at once.
    """
    from bentoml.exceptions import NotFound

    try:
        bentoml.models.get(tag)
    except NotFound:
        raise RuntimeError(
            f"the {role} model {tag!r} is not in the BentoML model store ({model_store_dir()}); import the default models with "
            f"`make models` (python -m models.import_models), or set {variable_of(role + '_model')} to a "
            f"stored model (bentoml models list)") from None


def define_runner(role: str, name: str, doc: str) -> bentoml.Service:
    """The BentoML service ``rampart_<role>`` whose class is named ``name`` with docstring ``doc``.

    One worker with ``concurrent_batches`` inference threads (they bound the concurrent
    batches per device; the three bucket dispatchers queue behind them), one batchable
    ``bentoml.api`` per size bucket (``/square``, ``/landscape``, ``/portrait``, each
    calling ``run_bucket``), and BentoML's access log (one line per runner call) only when
    ``runner_access_log_enabled()``. ``__init__`` sets up buckets, faults, niceness and cores,
    picks the engine (``pick_engine``), loads it (``load_engine``) and warms up. BentoML finds a dependency's service by
    its name, so the class may be made here once for every runner module.
    """
    settings = get_settings()
    spec = runner_spec(settings, role)

    def api_for(bucket_name: str):
        def predict(self, items: list[RunnerItem]) -> list[RunnerResult]:
            return self.run_bucket(bucket_name, items)

        predict.__name__ = predict.__qualname__ = bucket_name
        predict.__doc__ = f"Classify a batch of {bucket_name} images (adaptive batching)."
        return bentoml.api(predict, route=f"/{bucket_name}", batchable=True,
                           max_batch_size=spec.max_batch_size, max_latency_ms=spec.max_latency_ms)

    def __init__(self) -> None:
        self.setup(role, self.model.info.metadata["resolution"], FaultInjector(role, spec.faults, settings.faults.file),
                   spec.max_batch_size, spec.nice, settings.deadlines.max_deadline_ms)
        threads = engine_cpu_threads(spec)
        cache = TimingCache.from_setting(settings.runners.timing_cache_dir)
        self.model_tag = str(self.model.tag)
        self.engine_choice = pick_engine(spec, self.model, settings, threads, self.buckets["square"].shape, cache)
        self.engine = load_engine(self.model, spec.memory_fraction, threads, engine=self.engine_choice.engine,
                                  torch_graph=settings.runners.torch_graph)
        self.warm_up(self.engine_choice.timings.get(self.engine_choice.engine), cache, threads)
        self.heap_trim.start()
        self.timings_source = cache.source  # of the last timing asked for: the engine choice's, or the warm-up's
        self.timing_cache_files = [str(path) for path in dict.fromkeys(cache.files)]
        if self.timings_source == "cache":
            engine_log.info("%s runner: batch-size timings of %s from the timing cache %s", role, self.model_tag,
                            cache.directory)
        if not self.engine_choice.timings:  # timed in process instead: /stats shows it the same way
            self.engine_choice = dataclasses.replace(self.engine_choice,
                                                     timings={self.engine_choice.engine: self.size_timings})

    body = {"__doc__": doc, "__module__": f"runners.{role}", "__init__": __init__,
            **{bucket: api_for(bucket) for bucket in BUCKET_NAMES}}
    if spec.tag:  # no model to pack or load for a runner that is off (an empty shadow_model)
        require_stored_model(spec.tag, role)
        body["model"] = bentoml.models.BentoModel(spec.tag)
    cls = type(name, (BucketedRunner,), body)
    return bentoml.service(name=f"rampart_{role}", workers=1, threads=spec.concurrent_batches,
                           traffic={"timeout": spec.timeout_s},
                           logging={"access": {"enabled": runner_access_log_enabled()}},
                           **runner_tracing_config(settings))(cls)


def runner_tracing_config(settings: Settings) -> dict:
    """BentoML service configuration for a runner's tracing: every route excluded from OpenTelemetry
    (``excluded_urls``, regular expressions searched in the URL: each bucket's batch route and ``/stats``)
    unless ``telemetry.trace_runner_calls`` or ``telemetry.trace_requests``; empty (BentoML's default) then."""
    if settings.telemetry.trace_runner_calls or settings.telemetry.trace_requests:
        return {}
    return {"tracing": {"excluded_urls": [f"/{bucket}" for bucket in BUCKET_NAMES] + ["/stats"]}}
