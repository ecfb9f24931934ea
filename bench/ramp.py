"""Closed-loop ramp of one service and its knees: ``python -m bench.ramp [--service rampart] [--out bench_results]
[--quick]`` writes ``ramp.json``.

Closed-loop steps of 1, 2, 4 … 256 clients (``bench.harness.Sizes``), every request with the 1 s
deadline (``bench.harness.SLO_MS``): throughput, P50/P90/P99, error rate, degraded rate and
*full* answers per second (``full_rps``: from the primary, not degraded). The *knee* is the
highest throughput whose P99 stays within the SLO with at most 1% of requests refused; the
*primary-path knee* is the step with the most full answers under the same rule. Also step 2
of ``python -m bench.load_bench``.
"""

from __future__ import annotations

import json
import sys

from bench.harness import SLO_MS, Service, Sizes, machine, measure_service, scenario_parser
from bench.loadgen import closed_loop, load_bodies, run_sync, summarize

__all__ = ["FULL_KNEE_DEGRADED_RATE", "ramp", "knee", "primary_knee", "main"]

#: Most degraded answers a ramp step may have to count for the *full knee* (the highest throughput at full quality).
FULL_KNEE_DEGRADED_RATE = 0.01


def ramp(service: Service, bodies: list[bytes], clients: list[int], step_s: float) -> dict:
    """Closed-loop steps; the knee is the highest throughput with P99 ≤ SLO and ≤ 1% errors (or 429s)."""
    steps = []
    for n in clients:
        samples = run_sync(closed_loop(service.url, bodies, n, step_s, deadline_ms=SLO_MS,
                                       form_field=service.form_field, oip=service.oip))
        summary = summarize(samples, step_s)
        steps.append({"clients": n, **{k: summary[k] for k in ("throughput_rps", "p50_ms", "p90_ms", "p99_ms",
                                                                "degraded_rate")},
                      "full_rps": round(summary["full"] / step_s, 2),
                      "error_rate": round(1 - summary["ok"] / max(summary["requests"], 1), 4)})
    return {"steps": steps, "knee": knee(steps), "primary_knee": primary_knee(steps)}


def primary_knee(steps: list[dict]) -> dict:
    """The ramp step with the most *full* answers per second (``full_rps``: answers from the primary model,
    not degraded; every answer of a baseline) among those with P99 ≤ SLO and ≤ 1% errors (or 429s): the
    primary-path knee, where degraded answers do not count. When none qualifies, the step with
    the lowest P99."""
    within = [s for s in steps if s["p99_ms"] is not None and s["p99_ms"] <= SLO_MS and s["error_rate"] <= 0.01]
    return max(within, key=lambda s: s["full_rps"]) if within else min(steps, key=lambda s: s["p99_ms"] or 1e9)


def knee(steps: list[dict], max_degraded_rate: float = 1.0) -> dict:
    """The ramp step with the highest throughput whose P99 ≤ SLO, ≤ 1% errors (or 429s) and at most
    ``max_degraded_rate`` degraded answers; when none qualifies, the step with the lowest P99."""
    within = [s for s in steps if s["p99_ms"] is not None and s["p99_ms"] <= SLO_MS and s["error_rate"] <= 0.01
              and s["degraded_rate"] <= max_degraded_rate]
    return max(within, key=lambda s: s["throughput_rps"]) if within else min(steps, key=lambda s: s["p99_ms"] or 1e9)


def main(argv: list[str] | None = None) -> int:
    """Ramp one service (``--service``, one of ``bench.harness.Service.COMMANDS``); writes ``ramp.json``."""
    args = scenario_parser("python -m bench.ramp", __doc__, service=True).parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes, bodies = Sizes.of(args.quick), load_bodies()
    result = measure_service(args.service, args.out, bodies,
                             lambda service: ramp(service, bodies, sizes.clients, sizes.step_s))
    report = {"machine": machine(), "slo_ms": SLO_MS, "service": args.service,
              "command": "python -m bench.ramp " + " ".join(argv if argv is not None else sys.argv[1:]), **result}
    (args.out / "ramp.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({"knee": result["knee"], "primary_knee": result["primary_knee"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
