"""Peer baselines against the naive one: ``python -m bench.peers [--out bench_results] [--quick]`` writes
``peers.json`` (also ``python -m bench.load_bench --peers-only``; about 3 minutes).

The optional *peers* (``PEERS``: NVIDIA Triton through PyTriton with dynamic batching,
``bench.baselines.triton_pytriton``) run when ``make bench-peers`` has installed them in
``.venv-peers``, and are otherwise recorded as ``{"skipped": reason}``. Each, and the naive
baseline as the same-run reference (the seed's FastAPI service: one asyncio queue, 5 ms
window, max batch 8, no admission control), gets the closed-loop ramp (``bench.ramp``) and an
open-loop run at 5× its own knee (``bench.overload``); ``ratios_to_naive`` gives, per peer that
ran, knee throughput, goodput at 5× and P99 at 5× over the naive baseline's. Also the
baselines of step 5 of ``python -m bench.load_bench``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.baselines import triton_pytriton
from bench.harness import SLO_MS, Sizes, machine, measure_service, ratio, run_scenario
from bench.loadgen import load_bodies
from bench.overload import ramp_and_overload

__all__ = ["PEERS", "skipped_peer", "service_ratios", "peers_report", "run", "main"]

#: Optional baselines in a venv of their own (``make bench-peers``), each with its module's ``skip_reason``.
PEERS = {"triton": triton_pytriton.skip_reason}


def skipped_peer(name: str, results: dict) -> bool:
    """True (and ``results[name]`` says why, printed too) when ``name`` is an optional peer baseline
    (``PEERS``) that is not installed; False for every other service."""
    if name in PEERS and (reason := PEERS[name]()):
        results[name] = {"skipped": reason}
        print(name, "skipped:", reason, flush=True)
        return True
    return False


def service_ratios(ours: dict, theirs: dict) -> dict:
    """Ratios ``ours``/``theirs`` of two services' results (``ramp`` and ``overload`` with a 5× run):
    ``knee_throughput``, ``goodput_at_5x``, ``p99_at_5x`` (P99 of accepted requests); None where undefined."""
    return {
        "knee_throughput": ratio(ours["ramp"]["knee"]["throughput_rps"], theirs["ramp"]["knee"]["throughput_rps"]),
        "goodput_at_5x": ratio(ours["overload"]["5.0"]["goodput_rps"], theirs["overload"]["5.0"]["goodput_rps"]),
        "p99_at_5x": ratio(ours["overload"]["5.0"]["p99_accepted_ms"], theirs["overload"]["5.0"]["p99_accepted_ms"]),
    }


def peers_report(results: dict, out: Path) -> int:
    """Write ``peers.json`` (``results`` plus, per peer that ran, its ratios to the naive baseline of the same
    run: knee throughput, goodput at 5×, P99 at 5×) and print the ratios."""
    results["ratios_to_naive"] = {name: service_ratios(results[name], results["naive"])
                                  for name in PEERS if "skipped" not in results[name]}
    (out / "peers.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["ratios_to_naive"], indent=2))
    return 0


def run(out: Path, quick: bool, command: str) -> int:
    """The naive baseline and every peer, one server at a time, each ramped then overloaded at 5× its knee
    (``bench.harness.Sizes``); ``peers_report`` with ``command`` recorded."""
    sizes, bodies = Sizes.of(quick), load_bodies()
    results: dict = {"machine": machine(), "slo_ms": SLO_MS, "command": command}
    for name in ("naive", *PEERS):
        if skipped_peer(name, results):
            continue
        results[name] = measure_service(name, out, bodies,
                                        lambda service: ramp_and_overload(service, bodies, sizes, [5.0]))
        print(name, json.dumps(results[name]["ramp"]["knee"]), flush=True)
    return peers_report(results, out)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.peers [--out DIR] [--quick]``: ``run`` with this command recorded."""
    return run_scenario("python -m bench.peers", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
