"""Which engine a runner computes on, and the timing of batch sizes it is chosen by.

A PyTorch model imported by ``python -m models.import_models`` carries an ONNX export
checked against it (metadata ``onnx_file``), so it can run on two engines: ``torch``
(``inference.engines.TorchClassifier``) and ``onnx`` (``inference.engines.OnnxClassifier``).
``choose_engine`` decides between them (``RAMPART_PRIMARY_ENGINE``, docs/engines.md):

- ``torch`` or ``onnx``: that engine (``onnx`` without an export: torch, with a warning);
- ``auto`` on a host with a CUDA GPU: torch (PyTorch is the GPU default);
- ``auto`` on a CPU-only host: each engine's ms per image at its own fastest batch size
  (``time_batch_sizes``) is measured, and the faster engine wins.

The measurement runs both engines in one child process of the runner (``measure_in_child``,
``python -m inference.engine_choice``), taking turns run by run: it inherits the runner's
cores, niceness and environment, so both engines are timed under the same CPU pinning and
the same load from elsewhere, and the runner itself then imports only the engine it serves
(importing torch costs a process about 670 MB of resident memory).

No torch or BentoML import at module level.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CHILD_TIMED_RUNS", "ENGINE_MODES", "IN_PROCESS_TIMED_RUNS", "EngineChoice", "available_engines", "best_size", "candidate_sizes", "choose_engine",
           "measure_in_child", "time_batch_sizes", "time_engines", "warm_up_sizes"]

logger = logging.getLogger("rampart.engines")
logger.setLevel(logging.INFO)  # BentoML's server logging passes only WARNING and up from others' loggers otherwise

#: Values of ``RAMPART_PRIMARY_ENGINE``.
ENGINE_MODES = ("auto", "torch", "onnx")
#: Batch sizes within this fraction of the fewest ms per image count as equally fast (``best_size``).
SIZE_TOLERANCE = 0.10
#: Timed runs per batch size (after one untimed run) when a runner times its own engine in process
#: (``time_batch_sizes``), and when the primary's child times both engines (``measure_in_child``).
IN_PROCESS_TIMED_RUNS = 2
CHILD_TIMED_RUNS = 3
#: Longest a child process may take to load and time one engine (s); past it that engine is not chosen.
MEASURE_TIMEOUT_S = 240.0


def candidate_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes timed to find the fastest: every power of two up to ``max_batch_size``, and it."""
    sizes = {1 << i for i in range(max_batch_size.bit_length())} | {max_batch_size}
    return sorted(size for size in sizes if size <= max_batch_size)


def warm_up_sizes(compute_batch_size: int) -> list[int]:
    """The batch sizes warmed on every bucket: the powers of two below ``compute_batch_size``, and it.

    A runner computes every adaptive batch in chunks of ``compute_batch_size`` (the last
    chunk smaller), so no larger batch ever reaches the engine and none is warmed.
    """
    return candidate_sizes(compute_batch_size)


def time_engines(predicts: dict[str, Callable[[np.ndarray], np.ndarray]], shape: tuple[int, int, int],
                 sizes: list[int], runs: int = 2) -> dict[str, dict[int, float]]:
    """ms per image of each engine at each batch size: one untimed run, then the best of ``runs``.

    ``predicts`` maps a name to a ``predict`` that takes uint8 N×H×W×3 (``shape`` is H×W×3);
    the batches are zeros. After one untimed run of every size, each timed round runs every
    size on every engine in turn, so a burst of load from elsewhere on the host slows them alike. The cost is bounded: (1 + ``runs``) ×
    sum(``sizes``) images per engine.
    """
    out: dict[str, dict[int, float]] = {name: {} for name in predicts}
    batches = {size: np.zeros((size, *shape), dtype=np.uint8) for size in sizes}
    for size in sizes:
        for predict in predicts.values():
            predict(batches[size])
    for _ in range(runs):  # sizes and engines in turns, so a burst of load elsewhere lands on no one of them alone
        for size in sizes:
            for name, predict in predicts.items():
                start = time.perf_counter()
                predict(batches[size])
                ms = (time.perf_counter() - start) * 1000.0 / size
                out[name][size] = min(out[name].get(size, ms), ms)
    return out


def time_batch_sizes(predict: Callable[[np.ndarray], np.ndarray], shape: tuple[int, int, int],
                     sizes: list[int], runs: int = IN_PROCESS_TIMED_RUNS) -> dict[int, float]:
    """``time_engines`` of one engine: ms per image by batch size."""
    return time_engines({"engine": predict}, shape, sizes, runs)["engine"]


def best_size(timings: dict[int, float], tolerance: float = SIZE_TOLERANCE) -> int:
    """The compute batch size from ``timings`` (ms per image by size, ``time_batch_sizes``): the smallest
    size within ``tolerance`` (a fraction) of the fewest ms per image.

    Sizes within a few percent of each other per image are a tie on a host shared with other
    work (their order changes from one start to the next); the smallest of them answers
    sooner and needs the least memory (ONNX Runtime's arena keeps the peak of the largest
    batch computed).
    """
    fastest = min(timings.values())
    return min(size for size, ms in timings.items() if ms <= fastest * (1.0 + tolerance))


def available_engines(metadata: dict) -> tuple[str, ...]:
    """The engines a stored model can run on, its own first: ("onnx",) for an ONNX model,
    ("torch", "onnx") for a PyTorch model with an ONNX export (``onnx_file``), else ("torch",)."""
    if metadata.get("framework") == "onnx":
        return ("onnx",)
    return ("torch", "onnx") if metadata.get("onnx_file") else ("torch",)


@dataclass(frozen=True)
class EngineChoice:
    """The engine a runner computes on and why.

    ``engine``: "torch" or "onnx"; ``mode``: the setting it was chosen under; ``reason``:
    one sentence; ``timings``: ms per image by batch size of each engine measured
    (``time_batch_sizes``; empty when nothing was measured before loading).
    """

    engine: str
    mode: str
    reason: str
    timings: dict[str, dict[int, float]] = field(default_factory=dict)

    def ms_per_image(self) -> dict[str, float]:
        """Each measured engine's ms per image at its compute (fastest) batch size."""
        return {name: round(t[best_size(t)], 3) for name, t in self.timings.items()}

    def compute_batch_size(self) -> dict[str, int]:
        """Each measured engine's compute (fastest) batch size."""
        return {name: best_size(t) for name, t in self.timings.items()}

    def as_stats(self) -> dict:
        """The choice for ``/stats``: engine, mode, reason, and per engine measured its ms_per_image and
        compute_batch_size, and ms_per_image_by_batch_size (keys: batch sizes as strings)."""
        return {"engine": self.engine, "mode": self.mode, "reason": self.reason,
                "ms_per_image": self.ms_per_image(), "compute_batch_size": self.compute_batch_size(),
                "ms_per_image_by_batch_size": {name: {str(size): round(ms, 3) for size, ms in t.items()}
                                               for name, t in self.timings.items()}}


def choose_engine(mode: str, available: tuple[str, ...], gpu: bool,
                  measure: Callable[[tuple[str, ...]], dict[str, dict[int, float]]]) -> EngineChoice:
    """The engine to run among ``available`` (``available_engines``) under ``mode`` (``ENGINE_MODES``).

    ``gpu``: whether a CUDA GPU is usable; ``measure(engines)`` returns each engine's ms per
    image by batch size (``time_engines``) and is only called for ``auto`` on a CPU-only host
    with two engines. When it raises, the model's own engine runs (the reason says why).
    Raises ``ValueError`` for an unknown mode or when nothing is available.
    """
    if mode not in ENGINE_MODES:
        raise ValueError(f"engine mode {mode!r} is none of {ENGINE_MODES}")
    if not available:
        raise ValueError("no engine available")
    native = available[0]
    if len(available) == 1:
        if mode not in ("auto", native):
            return EngineChoice(native, mode, f"{mode} was asked for, but the stored model has no {mode} engine "
                                              f"(no ONNX export: import it again with python -m models.import_models)")
        return EngineChoice(native, mode, f"the stored model runs only on {native}")
    if mode != "auto":
        return EngineChoice(mode, mode, f"RAMPART_PRIMARY_ENGINE={mode}")
    if gpu:
        return EngineChoice("torch", mode, "a CUDA GPU is present: PyTorch is the GPU default")
    try:
        timings = measure(available)
    except Exception as error:  # noqa: BLE001 - a failed measurement leaves the model's own engine
        return EngineChoice(native, mode, f"the engines could not be timed ({type(error).__name__}: "
                                          f"{str(error)[:200]}); running on {native}")
    choice = EngineChoice("", mode, "", timings)
    ms, batch = choice.ms_per_image(), choice.compute_batch_size()
    winner = min(ms, key=ms.get)
    measured = ", ".join(f"{name} {ms[name]:.1f} ms/image at batch {batch[name]}" for name in sorted(ms))
    return EngineChoice(winner, mode, f"faster per image at its compute batch size, measured on this host: {measured}",
                        timings)


def measure_in_child(model_path: str, metadata: dict, engines: tuple[str, ...], threads: int,
                     shape: tuple[int, int, int], sizes: list[int], memory_fraction: float = 0.9,
                     runs: int = CHILD_TIMED_RUNS, timeout_s: float = MEASURE_TIMEOUT_S,
                     torch_graph: str = "eager") -> dict[str, dict[int, float]]:
    """``time_engines`` of ``engines`` on the stored model at ``model_path``, in one child process.

    The child (``python -m inference.engine_choice``) inherits this process's CPU
    affinity, niceness and environment, loads each engine with ``threads`` intra-op
    threads and torch's ``torch_graph`` (``inference.stored.load_engine``), times them in turns at ``sizes`` on
    ``shape`` (best of ``runs``) and exits, taking their memory and libraries with it.
    Raises ``RuntimeError`` when it fails or runs past ``timeout_s``.
    """
    request = {"model_path": model_path, "metadata": metadata, "engines": list(engines), "threads": threads,
               "shape": list(shape), "sizes": sizes, "memory_fraction": memory_fraction, "runs": runs,
               "torch_graph": torch_graph}
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)  # the directory holding the ``inference`` package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        out = subprocess.run([sys.executable, "-m", "inference.engine_choice"], input=json.dumps(request),
                             capture_output=True, text=True, timeout=timeout_s, cwd=root, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timing took over {timeout_s:.0f} s") from None
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or [f"exit status {out.returncode}"]
        raise RuntimeError(tail[0][:300])
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    return {name: {int(size): float(ms) for size, ms in t.items()} for name, t in measured.items()}


class _StoredFiles:
    """The part of a ``bentoml.Model`` that ``inference.stored.load_engine`` reads: metadata and file paths."""

    def __init__(self, path: str, metadata: dict) -> None:
        from types import SimpleNamespace

        self.path, self.info, self.tag = path, SimpleNamespace(metadata=metadata), path

    def path_of(self, name: str) -> str:
        import os

        return os.path.join(self.path, name)


def _child_main() -> int:
    from inference.stored import load_engine

    request = json.loads(sys.stdin.read())
    model = _StoredFiles(request["model_path"], request["metadata"])
    predicts = {name: load_engine(model, request["memory_fraction"], request["threads"], engine=name,
                                  torch_graph=request["torch_graph"]).predict
                for name in request["engines"]}
    timings = time_engines(predicts, tuple(request["shape"]), [int(s) for s in request["sizes"]], request["runs"])
    print(json.dumps(timings))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
