"""Rampart with 1 and with 2 API workers (``RAMPART_API_WORKERS``), same machine, same photos, one run each.

``python -m bench.workers_bench [--workers 1 2] [--out bench_results]`` writes
``workers-1-2.json``: for each worker count, a fresh server (all started together,
measured in turns: see ``measure``) gets

1. a closed-loop ramp (``bench.ramp.ramp``: 1, 4, 8 … 64 clients, 1 s deadline),
   its *knee* (highest throughput with P99 ≤ 1 s and ≤ 1% refused) and *full knee*
   (the same with ≤ 1% degraded answers: the primary answering alone), with the CPU
   the API workers (``api_cpu_ms_per_answer``: event loop, HTTP, admission, transfer
   to the runners) and their decode processes (``decode_cpu_ms_per_answer``) spent per
   answered request at each step (a request shed with 429 costs CPU but is not an answer);
2. open-loop Poisson overload at 5 × C for 20 s, C being the throughput of the ramp's
   32-client step: 5xx, late answers (after deadline + ``DEADLINE_SLACK_MS``), goodput (200s within
   the deadline, per second) and its ratio to C.

Run it under ``flock /tmp/rampart-load.lock`` on a shared machine: every figure is timing.
docs/overload.md (several API workers) reports its figures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness import SLO_MS, ServerCpu, Service, machine
from bench.loadgen import DEADLINE_SLACK_MS, load_bodies, open_loop, run_sync, summarize
from bench.ramp import FULL_KNEE_DEGRADED_RATE, knee, ramp

CLIENTS = [1, 4, 8, 16, 32, 64]
STEP_S = 8.0
OVERLOAD_FACTOR = 5.0
OVERLOAD_S = 20.0


def step(service: Service, bodies: list[bytes], clients: int) -> dict:
    """One closed-loop ramp step of ``STEP_S`` at ``clients``, with the API layer's CPU per answer
    (``bench.process_cpu`` roles ``api`` and ``decode``)."""
    meter = ServerCpu(service.process.pid)
    meter.start()
    result = ramp(service, bodies, [clients], STEP_S)["steps"][0]
    spent = meter.stop()
    answered = max(result["throughput_rps"] * STEP_S, 1)
    result["api_cpu_ms_per_answer"] = round(spent["api"]["cpu_s"] * 1000 / answered, 2)
    result["decode_cpu_ms_per_answer"] = round(spent["decode"]["cpu_s"] * 1000 / answered, 2)
    return result


def mean_step(pair: list[dict]) -> dict:
    """The two rounds of one step, averaged (P99: the worse), each round kept under ``rounds``."""
    out = {"clients": pair[0]["clients"], "rounds": pair}
    for key in ("throughput_rps", "p50_ms", "p90_ms", "degraded_rate", "error_rate", "api_cpu_ms_per_answer",
                "decode_cpu_ms_per_answer"):
        out[key] = round(sum(r[key] for r in pair) / len(pair), 3)
    out["p99_ms"] = max(r["p99_ms"] for r in pair)
    return out


def overload(service: Service, bodies: list[bytes], c: float) -> dict:
    """Open-loop Poisson arrivals at ``OVERLOAD_FACTOR`` × ``c`` for ``OVERLOAD_S`` s, 1 s deadline."""
    samples = run_sync(open_loop(service.url, bodies, OVERLOAD_FACTOR * c, OVERLOAD_S, deadline_ms=SLO_MS, seed=1))
    summary = summarize(samples, OVERLOAD_S, slack_ms=DEADLINE_SLACK_MS)
    served = [s for s in samples if s.status == 200 and s.latency_ms <= s.deadline_ms]
    labelled = [s for s in served if s.model is not None]
    return {"capacity_rps": c, "offered_rps": round(OVERLOAD_FACTOR * c, 1), **summary,
            "goodput_ratio": round(len(served) / OVERLOAD_S / c, 3),
            "model_goodput_ratio": round(len(labelled) / OVERLOAD_S / c, 3)}


def measure(worker_counts: list[int], bodies: list[bytes], log_dir: Path) -> list[dict]:
    """Ramp and 5x overload of one fresh server per worker count, all running at once.

    The host is shared, so the servers take turns step by step, in A B B A order at each
    client count, and each step's figures are the mean of its two rounds: both see the
    same background load. Only the server being measured gets requests.
    """
    services = [Service("rampart", log_dir, env={"RAMPART_API_WORKERS": str(n)}, label=f"rampart-{n}w")
                for n in worker_counts]
    try:
        for service in services:
            service.wait_ready(bodies)
        time.sleep(2.0)  # every worker past its warm-up
        rounds: list[list[dict]] = [[] for _ in services]
        for clients in CLIENTS:
            order = list(range(len(services)))
            for i in order + order[::-1]:
                rounds[i].append(step(services[i], bodies, clients))
                print(worker_counts[i], json.dumps(rounds[i][-1]), flush=True)
        runs = []
        for i, (n, service) in enumerate(zip(worker_counts, services)):
            steps = [mean_step(rounds[i][2 * k:2 * k + 2]) for k in range(len(CLIENTS))]
            c = next(s["throughput_rps"] for s in steps if s["clients"] == 32)
            result = overload(service, bodies, c)
            print(n, json.dumps(result), flush=True)
            runs.append({"workers": n, "steps": steps, "knee": knee(steps),
                         "full_knee": knee(steps, FULL_KNEE_DEGRADED_RATE), "overload_5x": result})
        return runs
    finally:
        for service in services:
            service.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bodies = load_bodies()
    runs = measure(args.workers, bodies, args.out)
    path = args.out / f"workers-{'-'.join(map(str, args.workers))}.json"
    path.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
