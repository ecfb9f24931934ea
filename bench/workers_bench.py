"""Rampart with 1 and with 2 API workers (``RAMPART_API_WORKERS``), same machine, same photos, one run each.

``python -m bench.workers_bench [--workers 1 2] [--out bench_results]`` writes
``workers.json``: for each worker count, a fresh server gets

1. a closed-loop ramp (``bench.load_bench.ramp``: 1, 2, 4 … 64 clients, 1 s deadline),
   its *knee* (highest throughput with P99 ≤ 1 s and ≤ 1% refused) and *full knee*
   (the same with ≤ 1% degraded answers: the primary answering alone), with the CPU
   the API workers and their decoders spent per answered request at each step;
2. open-loop Poisson overload at 5 × C for 20 s, C being the throughput of the ramp's
   32-client step: 5xx, late answers (after deadline + ``DEADLINE_SLACK_MS``), goodput (200s within
   the deadline, per second) and its ratio to C.

Run it under ``flock /tmp/rampart-load.lock`` on a shared machine: every figure is timing.
README "Overload control" (several API workers) reports its figures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import psutil

from bench.load_bench import FULL_KNEE_DEGRADED_RATE, SLO_MS, Service, knee, machine, ramp
from bench.loadgen import DEADLINE_SLACK_MS, load_bodies, open_loop, run_sync, summarize
from rampart.api.lifecycle import ENTRY_SERVICE_NAME

CLIENTS = [1, 2, 4, 8, 16, 32, 64]
STEP_S = 8.0
OVERLOAD_FACTOR = 5.0
OVERLOAD_S = 20.0


def api_processes(root_pid: int) -> list[psutil.Process]:
    """The entry service's worker processes under ``bentoml serve`` (pid ``root_pid``) and their children
    (the decode pool's forkserver and workers)."""
    found = []
    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            args = process.cmdline()
        except psutil.Error:
            continue
        if any(a == "--service-name" and b == ENTRY_SERVICE_NAME for a, b in zip(args, args[1:])):
            found.append(process)
            found.extend(process.children(recursive=True))
    return found


def cpu_s(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``processes`` (those still alive)."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def measure(workers: int, bodies: list[bytes], log_dir: Path) -> dict:
    """Ramp and 5x overload of one fresh server with ``workers`` API workers."""
    service = Service("rampart", log_dir, env={"RAMPART_API_WORKERS": str(workers)}, label=f"rampart-{workers}w")
    try:
        service.wait_ready(bodies)
        time.sleep(2.0)  # every worker past its warm-up, not only the one that answered
        processes = api_processes(service.process.pid)
        steps = []
        for clients in CLIENTS:
            before = cpu_s(processes)
            step = ramp(service, bodies, [clients], STEP_S)["steps"][0]
            answered = step["throughput_rps"] * STEP_S
            step["api_cpu_ms_per_answer"] = round((cpu_s(processes) - before) * 1000 / max(answered, 1), 2)
            steps.append(step)
            print(workers, json.dumps(step), flush=True)
        c = next(s["throughput_rps"] for s in steps if s["clients"] == 32)
        samples = run_sync(open_loop(service.url, bodies, OVERLOAD_FACTOR * c, OVERLOAD_S, deadline_ms=SLO_MS, seed=1))
        summary = summarize(samples, OVERLOAD_S, slack_ms=DEADLINE_SLACK_MS)
        served = [s for s in samples if s.status == 200 and s.latency_ms <= s.deadline_ms]
        labelled = [s for s in served if s.model is not None]
        overload = {"capacity_rps": c, "offered_rps": round(OVERLOAD_FACTOR * c, 1), **summary,
                    "goodput_ratio": round(len(served) / OVERLOAD_S / c, 3),
                    "model_goodput_ratio": round(len(labelled) / OVERLOAD_S / c, 3)}
        print(workers, json.dumps(overload), flush=True)
        return {"workers": workers, "steps": steps, "knee": knee(steps),
                "full_knee": knee(steps, FULL_KNEE_DEGRADED_RATE), "overload_5x": overload}
    finally:
        service.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bodies = load_bodies()
    runs = [measure(n, bodies, args.out) for n in args.workers]
    path = args.out / f"workers-{'-'.join(map(str, args.workers))}.json"
    path.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
