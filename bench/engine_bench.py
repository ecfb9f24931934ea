"""The primary's engines and a replica's memory: ``python -m bench.engine_bench``.

Starts one ``bentoml serve service:Rampart`` (default settings plus ``--env``) and writes
``docs/bench/engines.json`` and ``docs/bench/engines.png`` with:

- ``engine``: what the primary runner chose and why, from its ``/stats``: ms per image of
  each engine at its compute batch size, measured by the runner under its own CPU pinning
  (``inference.engine_choice``), and the compute batch sizes;
- ``rss_mb``: the resident memory (MiB) of every role of the process tree
  (``bench.process_cpu.process_role``) and the whole tree, after warm-up
  (``after_warm_up``), the highest seen while a 5× open-loop overload runs
  (``overload_peak``) and after it (``after_overload``: once the runners' idle heap trim has
  run, ``RAMPART_RUNNER_HEAP_TRIM_IDLE_S``); ``pss_mb`` the same as
  proportional set size (shared pages split between the processes that map them);
- ``overload``: the closed-loop capacity C (32 clients, 6 s) and the 5×C open-loop burst's
  summary (``bench.loadgen.summarize``);
- ``arena``: with ``--arena-ab``, ms per batch of each ONNX model with ONNX Runtime's CPU
  memory arena on and off, in this process, pinned to one core, one thread, 9 runs in turns
  (min and median).

Run it on a quiet host: the figures in docs/engines.md come from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.loadgen import closed_loop, load_bodies, open_loop, summarize
from bench.process_cpu import tree_memory

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "bench"


class PeakSampler:
    """The highest whole-tree RSS (and its breakdown) seen while running, sampled every ``every_s`` s."""

    def __init__(self, root_pid: int, every_s: float = 0.5) -> None:
        self.root_pid, self.every_s = root_pid, every_s
        self.peak: dict = {"rss_mb": {"total": 0.0}}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            sample = tree_memory(self.root_pid)
            if sample["rss_mb"]["total"] > self.peak["rss_mb"]["total"]:
                self.peak = sample

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def arena_ab(repeats: int = 9) -> dict:
    """ms per batch of each stored ONNX model (the fallback, the primary's export) with the CPU arena on and off."""
    import bentoml
    import numpy as np
    import onnxruntime as ort

    from inference.engines import session_options

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    out = {}
    for name, filename in (("rampart-fallback", "model.onnx"), ("rampart-primary", "model.onnx")):
        model = bentoml.models.get(f"{name}:latest")
        if not os.path.exists(model.path_of(filename)):
            continue
        side = model.info.metadata["resolution"]
        sessions = {}
        for label, arena in (("arena_on", True), ("arena_off", False)):
            options = session_options(ort)
            options.intra_op_num_threads = 1
            options.enable_cpu_mem_arena = arena
            sessions[label] = ort.InferenceSession(model.path_of(filename), sess_options=options,
                                                   providers=["CPUExecutionProvider"])
        for size in (1, 2, 4, 8, 16):
            x = {"input": np.zeros((size, 3, side, side), np.float32)}
            runs: dict[str, list[float]] = {label: [] for label in sessions}
            for session in sessions.values():
                session.run(None, x)
            for _ in range(repeats):
                for label, session in sessions.items():
                    start = time.perf_counter()
                    session.run(None, x)
                    runs[label].append((time.perf_counter() - start) * 1000)
            out[f"{name} batch {size}"] = {f"{label}_{stat}": round(float(fn(ms)), 2) for label, ms in runs.items()
                                           for stat, fn in (("min_ms", min), ("median_ms", np.median))}
    return out


def plot(results: dict, path: Path) -> None:
    """Two panels: ms per image of each engine; whole-tree RSS by role after warm-up and after the overload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    engine = results["engine"] or {}
    ms = engine.get("ms_per_image", {})
    batch = engine.get("compute_batch_size", {})
    names = sorted(ms)
    left.bar(names, [ms[n] for n in names], color=["tab:green" if n == engine.get("engine") else "tab:gray" for n in names])
    left.set_xticks(range(len(names)), [f"{n}\n(batch {batch.get(n)})" for n in names])
    left.set_ylabel("ms per image (primary runner, its cores)")
    left.set_title(f"primary engine: {engine.get('engine')} ({engine.get('mode')})")
    phases = [p for p in ("after_warm_up", "overload_peak", "after_overload") if p in results["memory"]]
    roles = sorted({r for p in phases for r in results["memory"][p]["rss_mb"] if r != "total"})
    bottom = [0.0] * len(phases)
    for role in roles:
        heights = [results["memory"][p]["rss_mb"].get(role, 0.0) for p in phases]
        right.bar(phases, heights, bottom=bottom, label=role)
        bottom = [b + h for b, h in zip(bottom, heights)]
    right.axhline(1536, color="red", linestyle="--", linewidth=1, label="1.5 GiB")
    right.set_ylabel("RSS (MiB), whole process tree")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT_DIR / "engines.json")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server (repeatable)")
    parser.add_argument("--overload-s", type=float, default=20.0, help="duration of the 5x open-loop overload (s)")
    parser.add_argument("--arena-ab", action="store_true", help="also time the ONNX models with the arena on and off")
    args = parser.parse_args(argv)
    from bench.harness import Replica
    from rampart.config import Settings

    env = dict(item.split("=", 1) for item in args.env)
    results: dict = {"command": "python -m bench.engine_bench " + " ".join(argv if argv is not None else
                                                                           __import__("sys").argv[1:]),
                     "env": env, "host": {"cpus": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0))},
                     "memory": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = Replica("engine-bench", Path(tmp), env)
        try:
            server.wait_ready()
            time.sleep(2)  # the decode workers' first round and the runners' trims settle
            stats = httpx.get(f"{server.url}/stats", timeout=10).json()
            results["engine"] = (stats["primary"]["runner"] or {}).get("engine")
            results["runners"] = {role: {k: (stats[role]["runner"] or {}).get(k) for k in
                                         ("engine", "compute_batch_size", "warmed_batch_sizes", "warmup_s", "cores")}
                                  for role in ("primary", "fallback")}
            results["memory"]["after_warm_up"] = tree_memory(server.pid)
            bodies = load_bodies()
            url = f"{server.url}/classify"
            capacity = summarize(asyncio.run(closed_loop(url, bodies, 32, 6.0)), 6.0)
            rate = 5 * capacity["throughput_rps"]
            with PeakSampler(server.pid) as sampler:
                samples = asyncio.run(open_loop(url, bodies, rate, args.overload_s, deadline_ms=1000, seed=1))
            results["memory"]["overload_peak"] = sampler.peak
            idle_s = float(env.get("RAMPART_RUNNER_HEAP_TRIM_IDLE_S", Settings().runners.heap_trim_idle_s))
            time.sleep(2 + 1.5 * idle_s)  # each runner's trim once idle (rampart.heap.IdleTrim)
            results["memory"]["after_overload"] = tree_memory(server.pid)
            results["overload"] = {"capacity_rps": capacity["throughput_rps"], "rate_rps": rate,
                                   **summarize(samples, args.overload_s)}
        finally:
            server.stop()
    if args.arena_ab:
        results["arena"] = arena_ab()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps({"engine": results["engine"], "memory": {p: m["rss_mb"] for p, m in results["memory"].items()},
                      "arena": results.get("arena")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
