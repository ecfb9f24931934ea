"""Rampart's closed-loop sweep: ``python -m bench.closed_loop [--out bench_results] [--sweep-client aiohttp|httpx]
[--quick]`` writes ``closed_loop.json`` (also ``python -m bench.load_bench --sweep-only``).

Rampart at 1, 4, 16, 64 and 256 connections, 10 s rounds with a 1-connection round after each
overload round (64 and 256), so that any after-effect shows; latency and late answers measured
at the client, with the client's own CPU per request (``bench.loadgen.sweep``); about 2 minutes
plus start-up. Also step 4 of ``python -m bench.load_bench``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from bench.harness import SLO_MS, Service, Sizes, machine, scenario_parser
from bench.loadgen import load_bodies, sweep

__all__ = ["closed_loop_sweep", "main"]


def closed_loop_sweep(out: Path, connections: tuple[int, ...], round_s: float, client: str) -> int:
    """Start Rampart, run ``bench.loadgen.sweep`` against it, write ``closed_loop.json`` and print a table."""
    bodies = load_bodies()
    service = Service("rampart", out)
    try:
        service.wait_ready(bodies)
        rounds = [r.summary() for r in sweep(service.url, bodies, connections, round_s, SLO_MS, client)]
        stats = httpx.get(service.url.rsplit("/", 1)[0] + "/stats", timeout=10).json()
    finally:
        service.stop()
    (out / "closed_loop.json").write_text(json.dumps({"machine": machine(), "client": client, "round_s": round_s,
                                                      "deadline_ms": SLO_MS, "rounds": rounds, "stats_after": stats},
                                                     indent=2))
    print("connections  req/s  goodput/s  p50_ms  p99_ms  p50_waiting_ms  shed  degraded  late_200  5xx  failed"
          "  client_cpu_ms/req")
    for r in rounds:
        print(f"{r['connections']:>11}  {r['throughput_rps']:>5}  {r['goodput_rps']:>9}  {r['p50_ms']:>6}  {r['p99_ms']:>6}"
              f"  {r['p50_waiting_ms']:>14}  {r['shed_rate']:>4}  {r['degraded_rate']:>8}  {r['late_200']:>8}"
              f"  {r['errors_5xx']:>3}  {r['failed']:>6}  {r['client_cpu_ms_per_request']:>17}")
    print("breaker:", stats["primary"]["breaker"], "opened", stats["primary"].get("breaker_opened"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The sweep with ``bench.harness.Sizes`` (``--quick``: 1 and 4 connections, 2 s rounds)."""
    parser = scenario_parser("python -m bench.closed_loop", __doc__,
                             quick_help="tiny rounds: proves the command, measures little")
    parser.add_argument("--sweep-client", choices=("aiohttp", "httpx"), default="aiohttp")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = Sizes.of(args.quick)
    return closed_loop_sweep(args.out, sizes.sweep_connections, sizes.sweep_s, args.sweep_client)


if __name__ == "__main__":
    sys.exit(main())
