"""Capacity planner: measure this host, derive the settings and the fleet for a peak, write the plan.

``python -m rampart.plan --peak-rps N --p99-ms M [--deadline-ms D] [--degraded-share F] [--out DIR] [--quick]
[--url URL --pid PID]`` starts Rampart with the configured models (``bench.harness.Service``; or measures
the running server at ``URL`` whose ``bentoml serve`` process is ``PID``) and measures, with the benchmark's
load generators (``bench.loadgen``) and CPU accounting (``bench.process_cpu``):

- the 1-client service time (P50 of one connection);
- a closed-loop ramp and its *knee*: the highest throughput whose P99 is within ``--p99-ms`` with at most
  1% of requests refused or failed;
- the primary's capacity C_p: primary answers per second, closed loop at 8 connections with a long deadline;
- the capacity with the fallback: answers by a model in time per second, open loop at 5× the knee;
- CPU per request by process role, during the C_p step, and the server's resident memory (all processes).

Then the rules of ``rampart.plan.formulas`` (docs/planning.md) give the settings, the replicas and what
happens at 1×, 1.5× and 3× the peak, written to ``DIR`` (default ``plan_results``): ``plan.json``,
``plan.png`` (throughput and P99 against clients, the knee and the planned rate per replica marked) and
``overlay/``, a kustomize overlay of deploy/k8s (base + KEDA component) that ``kubectl kustomize`` renders.
``--quick`` shortens every step (the test suite uses it); its figures are rough.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

from bench.loadgen import closed_loop, load_bodies, open_loop, run_sync, summarize
from bench.process_cpu import ServerCpu, server_processes
from rampart.config import Settings
from rampart.plan import formulas

__all__ = ["measure", "plan", "write_overlay", "plot", "main"]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
PRIMARY = "rampart-primary"
FALLBACK = "rampart-fallback"
#: Closed-loop connections of C_p (tests/server/test_overload.py: the primary-path knee on 2 cores).
CAPACITY_CLIENTS = 8
#: A deadline long enough that the primary answers everything it is sent (C_p, the service time).
LONG_DEADLINE_MS = 10_000
OVERLOAD_FACTOR = 5.0
FULL = {"clients": [1, 2, 4, 8, 16, 32, 64], "step_s": 8.0, "capacity_s": 10.0, "overload_s": 15.0}
QUICK = {"clients": [1, 4, 16], "step_s": 2.0, "capacity_s": 3.0, "overload_s": 3.0}


def _p(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def _by_model(samples, model: str, deadline: bool = True) -> int:
    return sum(1 for s in samples if s.status == 200 and s.model == model and (not deadline or s.latency_ms <= s.deadline_ms))


def _rss_bytes(pid: int, root_role: str = "supervisor") -> int:
    total = 0
    for _, (_, process) in server_processes(pid, root_role).items():
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


def knee_of(steps: list[dict], p99_ms: float) -> dict:
    """The ramp step with the most goodput among those with P99 <= ``p99_ms`` (ms) and at most 1% errors, with
    ``meets_target`` true; when none qualifies, the step with the lowest P99 and ``meets_target`` false (the plan
    is then refused: no step supports it). ``steps``: dicts with ``goodput_rps``, ``p99_ms`` (None: no answer),
    ``error_rate``."""
    within = [s for s in steps if s["p99_ms"] is not None and s["p99_ms"] <= p99_ms and s["error_rate"] <= 0.01]
    knee = max(within, key=lambda s: s["goodput_rps"]) if within else min(steps, key=lambda s: s["p99_ms"] or 1e9)
    return {**knee, "meets_target": bool(within)}


def measure(url: str, pid: int, p99_ms: float, deadline_ms: float, quick: bool) -> dict:
    """Measure the server at ``url`` (``.../classify``; its process tree under ``pid``): see the module doc.
    Times in ms, rates in requests/s, memory in bytes."""
    steps_cfg = QUICK if quick else FULL
    bodies = load_bodies()
    run_sync(closed_loop(url, bodies, 2, 1.0))  # warm: meters, decoders, cold code paths
    single = run_sync(closed_loop(url, bodies, 1, steps_cfg["step_s"], LONG_DEADLINE_MS))
    service_ms = _p([s.latency_ms for s in single if s.status == 200], 50)

    steps = []
    for clients in steps_cfg["clients"]:
        samples = run_sync(closed_loop(url, bodies, clients, steps_cfg["step_s"], deadline_ms))
        summary = summarize(samples, steps_cfg["step_s"])
        steps.append({"clients": clients, "throughput_rps": summary["throughput_rps"],
                      "goodput_rps": summary["goodput_rps"], "p50_ms": summary["p50_ms"], "p99_ms": summary["p99_ms"],
                      "primary_rps": round(_by_model(samples, PRIMARY) / steps_cfg["step_s"], 2),
                      "error_rate": round(1 - summary["ok"] / max(summary["requests"], 1), 4)})
    knee = knee_of(steps, p99_ms)

    cpu = ServerCpu(pid)
    cpu.start()
    capacity = run_sync(closed_loop(url, bodies, CAPACITY_CLIENTS, steps_cfg["capacity_s"], LONG_DEADLINE_MS))
    by_role = cpu.stop()
    c_p = _by_model(capacity, PRIMARY) / steps_cfg["capacity_s"]
    answered = max(sum(1 for s in capacity if s.status == 200), 1)
    cpu_ms = {role: round(entry["cpu_s"] * 1000.0 / answered, 2) for role, entry in by_role.items()}

    rate = OVERLOAD_FACTOR * max(knee["goodput_rps"], c_p, 1.0)
    overload = run_sync(open_loop(url, bodies, rate, steps_cfg["overload_s"], deadline_ms=deadline_ms, seed=5))
    in_time = [s for s in overload if s.status == 200 and s.model and s.latency_ms <= s.deadline_ms]
    fallback_inference = [s.inference_ms for s in overload if s.status == 200 and s.model == FALLBACK and s.inference_ms]
    return {
        "service_ms": service_ms,
        "ramp": steps,
        "knee": knee,
        "primary_capacity_rps": round(c_p, 2),
        "overload": {"offered_rps": round(rate, 1), **summarize(overload, steps_cfg["overload_s"]),
                     "goodput_rps": round(len(in_time) / steps_cfg["overload_s"], 2),
                     "primary_rps": round(_by_model(overload, PRIMARY) / steps_cfg["overload_s"], 2),
                     "fallback_rps": round(_by_model(overload, FALLBACK) / steps_cfg["overload_s"], 2),
                     "fallback_inference_p99_ms": _p(fallback_inference, 99)},
        "cpu_ms_per_request": {**cpu_ms, "total": round(sum(cpu_ms.values()), 2)},
        "rss_bytes": _rss_bytes(pid),
        "gpu": None,  # GPU time per request is not measured: the primary's compute time is in the answers' timings
        "cores": os.cpu_count(),
        "quick": quick,
    }


def plan(measured: dict, peak_rps: float, p99_ms: float, deadline_ms: float, degraded_share: float,
         settings: Settings) -> dict:
    """Settings, fleet and outcomes from ``measured`` (``measure``'s dict) by the rules of ``rampart.plan.formulas``."""
    knee_rps = max(measured["knee"]["goodput_rps"], 0.1)
    c_p = max(measured["primary_capacity_rps"], 0.1)
    total = max(measured["overload"]["goodput_rps"], c_p)
    reserve = formulas.fallback_reserve_ms(measured["overload"]["fallback_inference_p99_ms"], deadline_ms,
                                           settings.deadlines.fallback_reserve_ms)
    delay = formulas.queue_delay_ms(p99_ms, max(measured["service_ms"] or 1.0, 1.0), deadline_ms, reserve,
                                    settings.deadlines.answer_margin_ms)
    count = formulas.replicas(peak_rps, knee_rps, c_p, degraded_share)
    per_replica = peak_rps / count
    workers = formulas.api_workers(measured["cpu_ms_per_request"].get("api", 0.0), per_replica,
                                   most=min(settings.primary.max_batch_size, settings.fallback.max_batch_size, 4))
    least, most = formulas.keda_bounds(count, peak_rps, knee_rps)
    memory = formulas.memory_request_bytes(max(measured["rss_bytes"], 1))
    cpu = formulas.cpu_request_cores(measured["cpu_ms_per_request"]["total"], per_replica)
    return {
        "settings": {
            "RAMPART_DEFAULT_DEADLINE_MS": int(deadline_ms),
            "RAMPART_FALLBACK_RESERVE_MS": reserve,
            "RAMPART_PRIMARY_QUEUE_DELAY_MS": delay,
            "RAMPART_FALLBACK_QUEUE_DELAY_MS": delay,
            "RAMPART_API_WORKERS": workers,
        },
        "queue_places": {"primary": formulas.queue_places(c_p, delay, settings.primary.max_batch_size),
                         "fallback": formulas.queue_places(max(total - c_p, 0.1), delay,
                                                           settings.fallback.max_batch_size)},
        "fleet": {"replicas": count, "headroom": formulas.HEADROOM, "rps_per_replica": round(per_replica, 2),
                  "keda_min": least, "keda_max": most,
                  "queue_wait_threshold_s": round(0.5 * delay / 1000, 3),
                  "queue_wait_activation_s": round(0.25 * delay / 1000, 3)},
        "resources": {"memory_request_bytes": memory, "memory_limit_bytes": memory * 4 // 3, "cpu_request": cpu},
        "outcomes": {f"{factor}x": formulas.outcome(factor * peak_rps, count, c_p, total).__dict__
                     for factor in (1.0, 1.5, 3.0)},
    }


def _mib(value: int) -> str:
    return f"{value // 2 ** 20}Mi"


def write_overlay(planned: dict, directory: Path) -> Path:
    """A kustomize overlay in ``directory``: deploy/k8s/base with the KEDA component, the planned replicas,
    settings and resource requests (a strategic-merge patch of the Deployment) and KEDA's bounds and queue-wait
    thresholds (a JSON 6902 patch of the ScaledObject). Returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    resources, fleet = planned["resources"], planned["fleet"]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "base", directory)],
        "components": [os.path.relpath(K8S / "autoscaling" / "keda", directory)],
        "patches": [
            {"path": "patch-deployment.yaml"},
            {"path": "patch-scaledobject.yaml",
             "target": {"group": "keda.sh", "version": "v1alpha1", "kind": "ScaledObject", "name": "rampart"}},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "rampart", "namespace": "rampart"},
        "spec": {"replicas": fleet["replicas"], "template": {"spec": {"containers": [{
            "name": "rampart",
            "env": [{"name": name, "value": str(value)} for name, value in planned["settings"].items()],
            "resources": {"requests": {"cpu": str(resources["cpu_request"]),
                                       "memory": _mib(resources["memory_request_bytes"])},
                          "limits": {"cpu": str(resources["cpu_request"]),
                                     "memory": _mib(resources["memory_limit_bytes"])}},
        }]}}},
    }
    scaled = [
        {"op": "replace", "path": "/spec/minReplicaCount", "value": fleet["keda_min"]},
        {"op": "replace", "path": "/spec/maxReplicaCount", "value": fleet["keda_max"]},
        {"op": "replace", "path": "/spec/triggers/0/metadata/threshold", "value": str(fleet["queue_wait_threshold_s"])},
        {"op": "replace", "path": "/spec/triggers/0/metadata/activationThreshold",
         "value": str(fleet["queue_wait_activation_s"])},
    ]
    header = "# Written by `python -m rampart.plan` (docs/planning.md); edit the inputs, not this file.\n"
    for name, doc in (("kustomization.yaml", kustomization), ("patch-deployment.yaml", deployment),
                      ("patch-scaledobject.yaml", scaled)):
        (directory / name).write_text(header + yaml.safe_dump(doc, sort_keys=False))
    return directory


def plot(measured: dict, planned: dict, p99_ms: float, path: Path) -> None:
    """Throughput (goodput and primary answers) and P99 against closed-loop clients; the knee and the planned
    rate per replica marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = measured["ramp"]
    clients = [s["clients"] for s in steps]
    fig, left = plt.subplots(figsize=(8, 4.5))
    left.plot(clients, [s["goodput_rps"] for s in steps], "o-", label="goodput (req/s)")
    left.plot(clients, [s["primary_rps"] for s in steps], "s--", label="answered by the primary (req/s)")
    left.axhline(planned["fleet"]["rps_per_replica"], color="green", linestyle=":",
                 label=f"plan: {planned['fleet']['rps_per_replica']} req/s per replica")
    left.axvline(measured["knee"]["clients"], color="grey", linestyle="--", label=f"knee ({measured['knee']['clients']} clients)")
    left.set_xscale("log", base=2)
    left.set_xlabel("closed-loop clients")
    left.set_ylabel("req/s")
    right = left.twinx()
    right.plot(clients, [s["p99_ms"] or 0 for s in steps], "r^-", label="P99 (ms)")
    right.axhline(p99_ms, color="red", linestyle=":", label=f"P99 target {p99_ms:.0f} ms")
    right.set_ylabel("P99 latency (ms)")
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = left.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    left.legend(handles, labels, loc="upper left", fontsize=8)
    left.set_title(f"{planned['fleet']['replicas']} replicas planned")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(prog="python -m rampart.plan", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--peak-rps", type=float, required=True, help="planned peak, requests (images) per second")
    out.add_argument("--p99-ms", type=float, required=True, help="P99 latency target, ms")
    out.add_argument("--deadline-ms", type=float, default=None, help="the clients' deadline, ms (default: the "
                     "default_deadline_ms setting)")
    out.add_argument("--degraded-share", type=float, default=0.0,
                     help="share of the peak that may be answered by the fallback (0..1, default 0)")
    out.add_argument("--out", type=Path, default=Path("plan_results"), help="output folder (default plan_results)")
    out.add_argument("--quick", action="store_true", help="short measurement steps (rough figures)")
    out.add_argument("--url", default=None, help="measure this running server instead of starting one")
    out.add_argument("--pid", type=int, default=None, help="with --url: the server's bentoml serve process")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    finite = all(math.isfinite(value) for value in (args.peak_rps, args.p99_ms, args.degraded_share))
    if not finite or args.peak_rps <= 0 or args.p99_ms <= 0 or not 0 <= args.degraded_share < 1:
        print("--peak-rps and --p99-ms must be positive finite numbers, --degraded-share in [0, 1)", file=sys.stderr)
        return 2
    if (args.url is None) != (args.pid is None):
        print("--url and --pid go together", file=sys.stderr)
        return 2
    settings = Settings.from_env()
    deadline_ms = settings.deadlines.default_deadline_ms if args.deadline_ms is None else args.deadline_ms
    if not settings.min_deadline_ms <= deadline_ms <= settings.deadlines.max_deadline_ms:
        print(f"--deadline-ms must be in {settings.min_deadline_ms}..{settings.deadlines.max_deadline_ms} (the server's "
              f"min_deadline_ms and max_deadline_ms), got {deadline_ms:g}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    service = None
    if args.url is None:
        from bench.harness import Service, exit_on_sigterm

        exit_on_sigterm()  # a job's timeout stops the server this command starts
        service = Service("rampart", Path(tempfile.mkdtemp(prefix="rampart-plan-")))
        service.wait_ready(load_bodies())
        url, pid = service.url, service.process.pid
    else:
        url, pid = args.url.rstrip("/") + "/classify", args.pid
    try:
        started = time.time()
        measured = measure(url, pid, args.p99_ms, deadline_ms, args.quick)
    finally:
        if service is not None:
            service.stop()
    planned = plan(measured, args.peak_rps, args.p99_ms, deadline_ms, args.degraded_share, settings)
    met = measured["knee"]["meets_target"]
    overlay = write_overlay(planned, args.out / "overlay") if met else None
    plot(measured, planned, args.p99_ms, args.out / "plan.png")
    report = {"inputs": {"peak_rps": args.peak_rps, "p99_ms": args.p99_ms, "deadline_ms": deadline_ms,
                         "degraded_share": args.degraded_share, "quick": args.quick},
              "target_met": met, "measured": measured, **planned, "overlay": str(overlay) if met else None,
              "measured_s": round(time.time() - started, 1)}
    (args.out / "plan.json").write_text(json.dumps(report, indent=2))
    if not met:
        knee = measured["knee"]
        print(f"no measured step met P99 <= {args.p99_ms:g} ms with at most 1% errors (the best: P99 {knee['p99_ms']} ms, "
              f"errors {knee['error_rate']:.0%}, at {knee['clients']} clients): no plan; wrote {args.out}/plan.json "
              "and plan.png, no overlay", file=sys.stderr)
        return 1
    fleet = planned["fleet"]
    print(f"{fleet['replicas']} replicas ({fleet['rps_per_replica']} req/s each; knee {measured['knee']['goodput_rps']} "
          f"req/s, C_p {measured['primary_capacity_rps']} req/s); wrote {args.out}/plan.json, plan.png, overlay/")
    return 0
