"""Baseline (c): NVIDIA Triton Inference Server through PyTriton, the server most users would pick instead.

The same model (``bench.baselines.common.load_primary``: ``rampart-primary:latest``) and the
same naive preprocessing as the other baselines, bound to Triton's dynamic batcher with the
naive service's policy: at most ``MAX_BATCH`` images, waiting at most ``BATCH_WINDOW_US``
for more. Triton's HTTP front end (C++) takes the requests and batches them; PyTriton
hands each batch to ``infer`` in this Python process, which decodes every image, runs
the model and returns the top 5. No admission control, no deadlines, an unbounded queue
(Triton's defaults).

Wire format (KServe v2 / Open Inference Protocol, the tensor names of Rampart's own
``/v2`` endpoint, ``rampart.api.oip``): model ``MODEL_NAME``; input ``IMAGE``, BYTES,
shape ``[1, 1]``: the encoded image, raw, in the binary tensor data extension;
outputs ``LABELS`` (BYTES), ``SCORES`` (FP32) and ``CLASS_INDICES`` (INT64), each
``[1, 5]``, best first, as JSON. ``bench.loadgen.oip_request`` builds the body and
``bench.loadgen.oip_answer`` reads the answer.

PyTriton (``nvidia-pytriton``, requirements-peers.txt) needs numpy < 2, so it lives in its
own venv, ``.venv-peers`` (``make bench-peers``); a ``.pth`` file there adds the main venv's
site-packages after its own, so torch, timm, BentoML and Pillow are the main venv's.
Run: ``.venv-peers/bin/python -m bench.baselines.triton_pytriton --port P`` (``command``); ready when
``GET /v2/models/classifier/ready`` answers 200. gRPC and metrics are off (one port).
``RAMPART_PEERS_PYTHON`` names another interpreter with PyTriton installed; ``skip_reason``
says why the baseline cannot run, if it cannot.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sysconfig
from pathlib import Path

import numpy as np

from bench.baselines.common import load_primary, naive_pixels
from rampart.api.oip import CLASS_INDICES, IMAGE, LABELS, SCORES
from rampart.results import top_classes

ROOT = Path(__file__).resolve().parents[2]

#: Triton's name for the served model; the infer URL is ``/v2/models/classifier/infer``.
MODEL_NAME = "classifier"
#: The peers venv's interpreter (``make bench-peers``), unless ``RAMPART_PEERS_PYTHON`` names another.
DEFAULT_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PACKAGE = "nvidia-pytriton"
#: Dynamic batching, the naive FastAPI baseline's policy (``naive_fastapi.MAX_BATCH``, ``BATCH_WINDOW_S``).
MAX_BATCH = 8
BATCH_WINDOW_US = 5000
TOP_K = 5


def python() -> Path:
    """The interpreter that runs this baseline: ``$RAMPART_PEERS_PYTHON``, else ``DEFAULT_PYTHON``."""
    return Path(os.environ.get("RAMPART_PEERS_PYTHON") or DEFAULT_PYTHON)


def skip_reason() -> str | None:
    """Why this baseline cannot run here (no peers interpreter, or no ``nvidia-pytriton`` in its
    environment), as a message that says how to install it; None when it can."""
    interpreter = python()
    if not interpreter.exists():
        return f"{interpreter} does not exist; `make bench-peers` creates it with {PACKAGE}"
    probe = subprocess.run([str(interpreter), "-c", f"import importlib.metadata as m; print(m.version({PACKAGE!r}))"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"{PACKAGE} is not installed for {interpreter}; `make bench-peers` installs it"
    return None


def command(port: int) -> list[str]:
    """The command line that serves this baseline on 127.0.0.1:``port`` (run from the repository root)."""
    return [str(python()), "-m", "bench.baselines.triton_pytriton", "--port", str(port)]


def infer_url(port: int) -> str:
    """The model's Open Inference Protocol ``/infer`` URL on 127.0.0.1:``port``."""
    return f"http://127.0.0.1:{port}/v2/models/{MODEL_NAME}/infer"


def make_infer(engine, labels: list[str], resolution: int):
    """The batched inference callable: ``IMAGE`` object array (B, 1) of encoded images in;
    ``LABELS`` bytes (B, TOP_K), ``SCORES`` float32 (B, TOP_K), ``CLASS_INDICES`` int64 (B, TOP_K) out."""
    from pytriton.decorators import batch

    names = np.array([label.encode() for label in labels], dtype=object)

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        pixels = np.stack([naive_pixels(bytes(row[0]), resolution) for row in inputs[IMAGE]])
        tops = [top_classes(row, TOP_K) for row in engine.predict(pixels)]
        indices = np.stack([index for index, _ in tops]).astype(np.int64)
        return {LABELS: names[indices], SCORES: np.stack([score for _, score in tops]), CLASS_INDICES: indices}

    return infer


def stub_library_path(current: str | None) -> str:
    """``LD_LIBRARY_PATH`` for Triton's Python backend stub: this interpreter's ``LIBDIR`` first.

    The stub (``triton_python_backend_stub``) links ``libpython3.X.so`` by name. With a
    non-system Python (pyenv, conda, a source build) the dynamic linker would otherwise find
    the system's libpython of another patch release, which then runs this interpreter's
    standard library and fails (on this machine: Debian's 3.11.2 under pyenv's 3.11.7,
    ``AttributeError: '_thread.RLock' object has no attribute '_recursion_count'``).
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    return ":".join(part for part in (libdir, current) if part)


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Start Triton on ``host:port`` (HTTP only) with the model bound, and block until SIGINT/SIGTERM."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    os.environ["LD_LIBRARY_PATH"] = stub_library_path(os.environ.get("LD_LIBRARY_PATH"))
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM (bench.load_bench stops its services so) stops like Ctrl-C
    engine, labels, resolution = load_primary()
    config = TritonConfig(http_address=host, http_port=port, allow_grpc=False, allow_metrics=False,
                          exit_on_error=True)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=MODEL_NAME,
            infer_func=make_infer(engine, labels, resolution),
            inputs=[Tensor(name=IMAGE, dtype=np.bytes_, shape=(1,))],
            outputs=[Tensor(name=LABELS, dtype=np.bytes_, shape=(TOP_K,)),
                     Tensor(name=SCORES, dtype=np.float32, shape=(TOP_K,)),
                     Tensor(name=CLASS_INDICES, dtype=np.int64, shape=(TOP_K,))],
            config=ModelConfig(max_batch_size=MAX_BATCH,
                               batcher=DynamicBatcher(max_queue_delay_microseconds=BATCH_WINDOW_US)),
            strict=True,
        )
        triton.serve()


def _interrupt(signum, frame) -> None:
    """SIGTERM handler: raise KeyboardInterrupt, on which ``Triton.serve`` stops the server and removes its workspace."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Triton (PyTriton) baseline for bench.load_bench")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(args.port, args.host)


if __name__ == "__main__":
    main()
