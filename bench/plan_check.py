"""Check the capacity planner against reality: plan two replicas from one replica's measurement, then run them.

``python -m bench.plan_check [--p99-ms 1000] [--deadline-ms 1000] [--run-s 30] [--out bench_results] [--quick]``

1. **Measure one replica** as the planner does (``rampart.plan.planner.measure``: knee, C_p, the goodput
   with the fallback at 5× overload, CPU per request), on a replica confined to one core
   (``taskset``), so that a replica here has what a replica of a two-core-per-replica fleet would
   have: one core of this two-core host.
2. **Plan** (``rampart.plan.planner.plan``) for the peak two such replicas should hold by the planner's
   own headroom rule: ``2 × (1 − HEADROOM) × min(knee, C_p)``, and read what it predicts there and at
   1.5× that peak (``outcomes``: the shares answered by the primary and the fallback, and shed).
3. **Run it**: two replicas, one core each, behind nginx (``deploy.cluster.Cluster``), each rate open
   loop for ``--run-s`` seconds (Poisson arrivals, the planner's bodies and deadline), and measure the
   same figures at the client: goodput (answers by a model within the deadline, per second), the
   shares by primary, fallback and shed, and P99.

The report (``plan_check.json``, ``plan_check.png``) gives, per rate, each figure predicted and measured
and the error ``(measured − predicted) / predicted`` for goodput, and the absolute difference for the
shares; ``within_20_percent`` is whether goodput is within ±20% at every rate. The P99 predicted is the
target itself at the planned peak (the plan keeps each replica at 80% of its knee, whose P99 met the
target); at 1.5× the planner predicts no latency, only shares. The client runs on the same host and
takes some of its CPU in step 3 as in step 1. ``--quick``: the planner's quick steps and 5 s runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.harness import Replica, free_port, machine, scenario_parser
from bench.loadgen import load_bodies, open_loop, run_sync, summarize
from deploy.cluster import Cluster
from rampart.config import Settings
from rampart.plan import formulas
from rampart.plan.planner import FALLBACK, PRIMARY, measure, plan

__all__ = ["check", "compare", "main"]

#: The planned peak as a multiple of the peak two replicas hold by the headroom rule, and 1.5× it.
FACTORS = (1.0, 1.5)
TOLERANCE = 0.2


def measured_outcome(samples: list, duration_s: float) -> dict:
    """Goodput (req/s), P99 (ms) and the shares of requests answered in time by the primary, the fallback, or
    shed (429, any other error and late answers count as shed) of one open-loop run."""
    summary = summarize(samples, duration_s)
    n = max(len(samples), 1)
    in_time = [s for s in samples if s.status == 200 and s.model and s.latency_ms <= s.deadline_ms]
    primary = sum(1 for s in in_time if s.model == PRIMARY)
    fallback = sum(1 for s in in_time if s.model == FALLBACK)
    return {"offered_rps": round(len(samples) / duration_s, 2), "goodput_rps": round(len(in_time) / duration_s, 2),
            "primary_share": round(primary / n, 4), "fallback_share": round(fallback / n, 4),
            "shed_share": round(1 - (primary + fallback) / n, 4), "p99_ms": summary["p99_ms"],
            "errors_5xx": summary["errors_5xx"], "late": summary["late"]}


def compare(predicted: dict, measured: dict) -> dict:
    """Per figure, the prediction, the measurement and the error: relative for goodput, absolute for shares."""
    goodput = predicted["offered_rps"] * (predicted["primary_share"] + predicted["fallback_share"])
    out = {"goodput_rps": {"predicted": round(goodput, 2), "measured": measured["goodput_rps"],
                           "error": round((measured["goodput_rps"] - goodput) / goodput, 3) if goodput else None}}
    for share in ("primary_share", "fallback_share", "shed_share"):
        out[share] = {"predicted": predicted[share], "measured": measured[share],
                      "difference": round(measured[share] - predicted[share], 3)}
    return out


def check(out: Path, p99_ms: float, deadline_ms: float, run_s: float, quick: bool) -> dict:
    """Steps 1-3 of the module doc; returns the report."""
    settings = Settings()
    env = {"RAMPART_CPU_PINNING": "off"}
    started = time.monotonic()
    single = Replica("plan-check-single", out, env, cores=[0])
    try:
        single.wait_ready()
        measured = measure(f"{single.url}/classify", single.pid, p99_ms, deadline_ms, quick)
    finally:
        single.stop()
    per_replica = min(measured["knee"]["goodput_rps"], measured["primary_capacity_rps"])
    peak = 2 * (1 - formulas.HEADROOM) * per_replica
    planned = plan(measured, peak, p99_ms, deadline_ms, 0.0, settings)
    predictions = {}
    for factor in FACTORS:
        predicted = formulas.outcome(factor * peak, 2, measured["primary_capacity_rps"],
                                     max(measured["overload"]["goodput_rps"], measured["primary_capacity_rps"]))
        predictions[f"{factor}x"] = {"offered_rps": predicted.offered_rps, "primary_share": predicted.primary,
                                     "fallback_share": predicted.fallback, "shed_share": predicted.shed}
    (out / "plan_check_single.json").write_text(json.dumps({"measured": measured, "predicted": predictions}, indent=2))
    cluster = Cluster(out / "plan-check-cluster", replicas=2, port=free_port(), env=env, cores=[[0], [1]])
    runs = {}
    try:
        cluster.start()
        bodies = load_bodies()
        run_sync(open_loop(f"{cluster.url}/classify", bodies, peak / 2, 3.0, deadline_ms=deadline_ms, seed=1))  # warm
        for index, factor in enumerate(FACTORS):
            samples = run_sync(open_loop(f"{cluster.url}/classify", bodies, factor * peak, run_s,
                                         deadline_ms=deadline_ms, seed=11 + index))
            runs[f"{factor}x"] = measured_outcome(samples, run_s)
    finally:
        cluster.stop()
        (out / "plan_check_runs.json").write_text(json.dumps(runs, indent=2))
    comparison = {rate: compare(predictions[rate], runs[rate]) for rate in predictions}
    return {
        "command": "python -m bench.plan_check" + (" --quick" if quick else ""),
        "machine": machine(),
        "settings": {"p99_ms": p99_ms, "deadline_ms": deadline_ms, "run_s": run_s, "cores_per_replica": 1},
        "single_replica": {key: measured[key] for key in ("service_ms", "knee", "primary_capacity_rps",
                                                          "cpu_ms_per_request")}
        | {"overload_goodput_rps": measured["overload"]["goodput_rps"]},
        "planned_peak_rps": round(peak, 2),
        "plan": {"replicas": planned["fleet"]["replicas"], "settings": planned["settings"]},
        "predicted": predictions,
        "measured": runs,
        "comparison": comparison,
        "predicted_p99_ms_at_peak": p99_ms,
        "within_20_percent": all(c["goodput_rps"]["error"] is not None and abs(c["goodput_rps"]["error"]) <= TOLERANCE
                                 for c in comparison.values()),
        "wall_s": round(time.monotonic() - started, 1),
    }


def plot(report: dict, path: Path) -> None:
    """Goodput and shares, predicted beside measured, per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(report["comparison"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for offset, kind in ((-0.2, "predicted"), (0.2, "measured")):
        left.bar([i + offset for i in range(len(rates))],
                 [report["comparison"][r]["goodput_rps"][kind] for r in rates], 0.4, label=kind)
    left.set(xticks=range(len(rates)), xticklabels=[f"{r} ({report['measured'][r]['offered_rps']} req/s)" for r in rates],
             ylabel="goodput, req/s", title="two replicas: goodput")
    left.legend()
    shares = ("primary_share", "fallback_share", "shed_share")
    for offset, kind, hatch in ((-0.2, "predicted", ""), (0.2, "measured", "//")):
        bottom = [0.0] * len(rates)
        for share, colour in zip(shares, ("tab:green", "tab:orange", "tab:red")):
            values = [report["comparison"][r][share][kind] for r in rates]
            right.bar([i + offset for i in range(len(rates))], values, 0.4, bottom=bottom, color=colour,
                      hatch=hatch, label=f"{share.split('_')[0]} ({kind})")
            bottom = [b + v for b, v in zip(bottom, values)]
    right.set(xticks=range(len(rates)), xticklabels=rates, ylabel="share of requests", title="who answered")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = scenario_parser("bench.plan_check", __doc__)
    parser.add_argument("--p99-ms", type=float, default=1000.0, help="the P99 target the plan is made for (ms)")
    parser.add_argument("--deadline-ms", type=float, default=1000.0, help="the clients' deadline (ms)")
    parser.add_argument("--run-s", type=float, default=30.0, help="seconds of open loop per rate")
    args = parser.parse_args(argv)
    run_s = 5.0 if args.quick else args.run_s
    args.out.mkdir(parents=True, exist_ok=True)
    report = check(args.out.resolve(), args.p99_ms, args.deadline_ms, run_s, args.quick)
    (args.out / "plan_check.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "plan_check.png")
    print(json.dumps(report["comparison"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
