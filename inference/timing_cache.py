"""Batch-size timings kept on disk, so a runner restarted on the same host skips measuring them again.

At start a runner times its engine at every candidate batch size (``inference.engine_choice``:
``time_batch_sizes`` in process, ``measure_in_child`` for the primary's two engines under
``auto``) to choose its compute batch size and engine. On the 2-core CI host that is most of a
runner's warm-up (about 5 s of the primary's 8 s). The answer depends only on the model, the
engine and its library, the threads, the CPU and GPU, and the shapes and sizes timed, so, like
TensorRT's timing cache or TorchInductor's autotuning cache, it is kept under a key made of
exactly those (``TimingKey``) and read back on the next start with the same key. Any change of
model version, engine, library version, thread count, usable cores, CPU quota, CPU or GPU
model, shape or sizes is another key, so it is measured again. The runner still runs every
bucket at its warm batch sizes (kernel selection and allocation happen before the first
request); only the timing is skipped.

A cached timing is the first start's measurement: a start on a host that was busy then keeps
what it measured. Delete the directory (or set ``RAMPART_RUNNER_TIMING_CACHE_DIR=off``) to
measure at every start (docs/engines.md, "Timing cache").

Files: one JSON file per key, ``<sha256 of the key>.json`` holding ``key``, ``timings`` (ms
per image by engine and batch size) and ``measured_at`` (Unix time, s); written atomically
(a temporary file of the writer's pid, then ``os.replace``), so two runners starting at once never read half a
file. An unreadable file, or one whose key differs, is measured again and rewritten.

No torch, onnxruntime or BentoML import.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

__all__ = ["DIRNAME", "OFF", "TimingCache", "TimingKey", "Timings", "cpu_model", "gpu_models", "library_versions"]

logger = logging.getLogger("rampart.engines")

#: ms per image, by engine name and batch size (``inference.engine_choice.time_engines``).
Timings = dict[str, dict[int, float]]

#: The cache's directory under ``$BENTOML_HOME`` when ``RAMPART_RUNNER_TIMING_CACHE_DIR`` is empty.
DIRNAME = "rampart-timings"

#: The value of ``RAMPART_RUNNER_TIMING_CACHE_DIR`` that turns the cache off.
OFF = "off"

#: The distributions whose versions change an engine's speed (absent ones are recorded as None).
LIBRARIES = ("torch", "onnxruntime", "onnxruntime-gpu", "numpy")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_models(root: Path = Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """The NVIDIA GPUs' model names from the driver's ``/proc`` files (no CUDA library loaded); [] without any."""
    names = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else []:
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                names.append(line.split(":", 1)[1].strip())
    return names


def library_versions() -> dict[str, str | None]:
    """The installed version of each of ``LIBRARIES`` (None when not installed), without importing them."""
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@dataclass(frozen=True)
class TimingKey:
    """What a batch-size timing depends on. ``model``: the store tag with its version ("name:version");
    ``engines``: the engines timed; ``threads``: intra-op threads; ``shape``: H×W×3 of the timed batches;
    ``sizes``: the batch sizes; ``runs``: timed runs per size; ``cores``: usable CPUs (a count);
    ``cpu_quota``: the cgroup's CPU quota in cores (None: unlimited); ``torch_graph``: how torch ran the
    module (``inference.engines.TORCH_GRAPHS``; "" when no torch engine was timed); the host's CPU and GPU
    models, the libraries' versions and the Python version fill in by default."""

    model: str
    engines: tuple[str, ...]
    threads: int
    shape: tuple[int, ...]
    sizes: tuple[int, ...]
    runs: int
    cores: int
    cpu_quota: float | None
    torch_graph: str = ""
    cpu: str = field(default_factory=cpu_model)
    gpus: tuple[str, ...] = field(default_factory=lambda: tuple(gpu_models()))
    libraries: tuple[tuple[str, str | None], ...] = field(default_factory=lambda: tuple(library_versions().items()))
    python: str = field(default_factory=platform.python_version)

    def as_json(self) -> dict:
        """The key as JSON values (tuples as lists): what the file stores and the digest is made of."""
        return json.loads(json.dumps(asdict(self)))

    def digest(self) -> str:
        """The file name's stem: the SHA-256 (hex) of the key's canonical JSON."""
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()


class TimingCache:
    """Timings by ``TimingKey`` in ``directory`` (created when first written); ``directory`` None: off.

    ``source`` after ``timings`` says where the last answer came from: "measured" or "cache";
    ``files`` lists the file of every key asked for, in order (empty when the cache is off).
    """

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory else None
        self.source = "measured"
        self.files: list[Path] = []

    @classmethod
    def from_setting(cls, setting: str, bentoml_home: str | None = None) -> TimingCache:
        """The cache ``RAMPART_RUNNER_TIMING_CACHE_DIR`` names: ``off`` (any case) turns it off; empty is
        ``<bentoml_home>/rampart-timings`` (default: ``$BENTOML_HOME``, else ``~/bentoml``, as BentoML's own)."""
        if setting.strip().lower() == OFF:
            return cls(None)
        if setting:
            return cls(setting)
        home = bentoml_home or os.environ.get("BENTOML_HOME") or str(Path.home() / "bentoml")
        return cls(Path(home) / DIRNAME)

    def path(self, key: TimingKey) -> Path | None:
        """The file holding ``key``'s timings (None when the cache is off)."""
        return None if self.directory is None else self.directory / f"{key.digest()}.json"

    def timings(self, key: TimingKey, measure: Callable[[], Timings]) -> Timings:
        """``key``'s timings from the cache, else ``measure()`` (then stored). A file that cannot be read or
        holds another key is measured again; a cache that cannot be written is logged and left as it is.
        Exceptions of ``measure`` propagate (nothing is stored then)."""
        path = self.path(key)
        if path is not None:
            self.files.append(path)
            cached = self._read(path, key)
            if cached is not None:
                self.source = "cache"
                return cached
        self.source = "measured"
        measured = measure()
        if path is not None:
            self._write(path, key, measured)
        return measured

    @staticmethod
    def _read(path: Path, key: TimingKey) -> Timings | None:
        try:
            stored = json.loads(path.read_text())
            if stored["key"] != key.as_json():
                return None
            return {engine: {int(size): float(ms) for size, ms in by_size.items()}
                    for engine, by_size in stored["timings"].items()}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("timing cache %s unreadable (%s): measuring again", path, exc)
            return None

    @staticmethod
    def _write(path: Path, key: TimingKey, timings: Timings) -> None:
        body = {"key": key.as_json(), "measured_at": round(time.time(), 3),
                "timings": {engine: {str(size): ms for size, ms in by_size.items()} for engine, by_size in timings.items()}}
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(body, indent=1))
            os.replace(temporary, path)
        except OSError as exc:
            logger.warning("timing cache %s not written (%s); the next start measures again", path, exc)
            with contextlib.suppress(OSError):
                temporary.unlink()
