"""Open-loop overload of one service at multiples of its knee: ``python -m bench.overload [--service rampart]
[--out bench_results] [--quick]`` writes ``overload.json``.

The service's closed-loop ramp (``bench.ramp``) gives its knee; then open-loop Poisson runs at
1×, 2×, 5× and 10× that knee (``bench.harness.Sizes``), every request with the 1 s deadline:
goodput (answers within their deadline that carry a model's labels), shed rate, degraded
rate, P99 of accepted requests, late answers. Before each run after the first the service is
drained (one request answered within the SLO). Also step 3 of ``python -m bench.load_bench``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from bench.harness import SLO_MS, Service, Sizes, machine, measure_service, scenario_parser
from bench.loadgen import closed_loop, load_bodies, open_loop, run_sync, summarize
from bench.ramp import ramp

__all__ = ["overload", "drain", "ramp_and_overload", "main"]


def overload(service: Service, bodies: list[bytes], capacity: float, factors: list[float], duration_s: float) -> dict:
    """Open-loop runs at ``factor`` × ``capacity``; goodput counts answers with a model's labels.

    The service is drained (``drain``) before each run after the first, not after the last: a caller
    that goes on loading the service drains it first (an unshed baseline may still be queueing)."""
    runs = {}
    for i, factor in enumerate(factors):
        if i:
            drain(service, bodies)
        samples = run_sync(open_loop(service.url, bodies, factor * capacity, duration_s, deadline_ms=SLO_MS,
                                     seed=int(factor * 10), form_field=service.form_field, oip=service.oip))
        summary = summarize(samples, duration_s)
        served = [s for s in samples if s.status == 200 and s.model is not None and s.latency_ms <= s.deadline_ms]
        runs[str(factor)] = {"offered_rps": round(factor * capacity, 1), **summary,
                             "goodput_rps": round(len(served) / duration_s, 2)}
    return runs


def drain(service: Service, bodies: list[bytes], timeout_s: float = 120) -> None:
    """Wait until the service answers a request within the SLO again (a baseline may still be queueing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = run_sync(closed_loop(service.url, bodies, 1, 0.5, form_field=service.form_field, oip=service.oip))
        if samples and all(s.status == 200 and s.latency_ms <= SLO_MS for s in samples):
            return
        time.sleep(1)


def ramp_and_overload(service: Service, bodies: list[bytes], sizes: Sizes, factors: list[float],
                      after_ramp: Callable[[dict], dict] | None = None) -> dict:
    """``{"ramp", "overload"}`` of a ready ``service``: its ramp (``sizes.clients``, ``sizes.step_s``), then
    ``overload`` at ``factors`` × its knee (at least 1 req/s). ``after_ramp(results)``, when given, runs between
    the two and its entries are added to the results (the load benchmark's CPU-budget step)."""
    results = {"ramp": ramp(service, bodies, sizes.clients, sizes.step_s)}
    if after_ramp is not None:
        results.update(after_ramp(results))
    capacity = max(results["ramp"]["knee"]["throughput_rps"], 1.0)
    results["overload"] = overload(service, bodies, capacity, factors, sizes.overload_s)
    return results


def main(argv: list[str] | None = None) -> int:
    """Ramp then overload one service (``--service``); writes ``overload.json``."""
    args = scenario_parser("python -m bench.overload", __doc__, service=True).parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes, bodies = Sizes.of(args.quick), load_bodies()
    result = measure_service(args.service, args.out, bodies,
                             lambda service: ramp_and_overload(service, bodies, sizes, sizes.factors))
    report = {"machine": machine(), "slo_ms": SLO_MS, "service": args.service,
              "command": "python -m bench.overload " + " ".join(argv if argv is not None else sys.argv[1:]), **result}
    (args.out / "overload.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(result["overload"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
