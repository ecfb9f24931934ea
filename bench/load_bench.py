"""Load benchmark: Rampart against the usual ways of serving the same model, same machine, same run.

``python -m bench.load_bench [--out bench_results] [--quick]`` writes ``load.json``
and ``load.png``. The load comes from this process (aiohttp, ``bench.loadgen``);
each service runs in its own subprocess on 127.0.0.1.

1. **Raw model ceiling**: primary (PyTorch) and fallback (ONNX Runtime) images/s at
   batch sizes 1..64, in this process, no serving: the machine's physical limit.
2. **Closed-loop ramp**, 1, 2, 4 … 256 clients: throughput, P50/P90/P99, error rate.
   The *knee* is the highest throughput whose P99 stays within the SLO (the 1 s
   deadline) with at most 1% of requests refused.
3. **Open-loop overload** (Poisson) at 1×, 2×, 5× and 10× Rampart's knee: goodput
   (answers within their deadline that carry a model's labels), shed rate,
   degraded rate, P99 of accepted requests, late answers.
4. **Closed-loop sweep** of Rampart at 1, 4, 16, 64 and 256 connections, 10 s
   rounds with a 1-connection round after each overload round (64 and 256), so
   that any after-effect shows; latency and late answers measured at the client,
   with the client's own CPU per request (``bench.loadgen.sweep``).
   ``--sweep-only`` runs just this (about 2 minutes plus start-up) and writes
   ``closed_loop.json``; ``--sweep-client httpx`` drives it with httpx instead.
5. **Baselines** with the same model and images: (a) ``naive``, the seed's FastAPI
   service (one asyncio queue, 5 ms window, max batch 8, no admission control);
   (b) ``plain_bentoml``, one batchable BentoML API with default settings; (c) ``triton``,
   NVIDIA Triton through PyTriton with dynamic batching (``bench.baselines.triton_pytriton``),
   an optional *peer*: it runs when ``make bench-peers`` has installed it in ``.venv-peers``
   and is otherwise recorded as ``{"skipped": reason}``. Each gets the ramp and 5× its own
   knee; the ratios Rampart/baseline are reported for knee throughput, goodput at 5× and
   P99 at 5×. ``--peers-only`` runs just the peers and the naive baseline as the same-run
   reference (about 3 minutes) and writes ``peers.json`` with the ratios peer/naive.

6. **Cascade against primary-first** (``cascade_scenario``), on the calibration's
   evaluation set (``bench.cascade_eval.evaluation_set``, each image re-encoded as JPEG
   quality 90 like the other bodies): a second Rampart with ``RAMPART_ROUTING=cascade``
   (default threshold) gets the same ramp as primary-first Rampart on the same bodies.
   Reported per arm: the knee, the *full knee* (the knee rule plus at most 1% degraded
   answers: the highest throughput at full quality), their P99, and the answers'
   routes; and the cascade's top-1 agreement with the primary-only answers on every
   image (both servers asked one image at a time with a 10 s deadline, so nothing is
   degraded). ``--cascade-only`` runs just this scenario and writes ``cascade.json``.

7. **Knee ratios and CPU budget**. Each ramp step also counts *full* answers
   per second (``full_rps``: from the primary, not degraded); Rampart's *primary-path
   knee* (``primary_knee``) is the step with the most of them at P99 ≤ SLO and ≤ 1%
   errors. ``knee_ratios`` divides it by the raw primary ceiling at its best batch size,
   by every baseline's knee that ran and by the naive knee on the engine Rampart's primary
   chose (``naive_on_chosen_engine``: the naive server once more on that engine,
   ``naive_onnx``, when it is not PyTorch). ``cpu_budget`` is one more step at the
   primary-path knee's client count with the server's CPU per request by process
   (measured) and by stage (py-spy samples, when installed): ``bench.cpu_budget``.
   ``memory``: Rampart's whole process tree's resident memory by role (MiB of RSS and PSS,
   ``bench.process_cpu.tree_memory``) after warm-up, after the ramp and budget step, and (full
   run) after the overloads and the drain.
   ``--knee-only`` runs just steps 1, 2 (up to 64 clients), the budget and the baselines'
   ramps, about 5 minutes, and writes ``knee.json``.

8. **Near-free-model ceiling** (``bench.ceiling``): a model that costs almost nothing, imported
   through the "your own model" path, served by Rampart with 1 and 2 API workers and by the
   naive baseline; requests/s and CPU µs per request by process role, for a ~500 KB phone
   JPEG and a 260×260 PNG. ``--ceiling-only`` runs just this and writes ``ceiling.json``.

9. **Ablation** (``bench.ablation``, not part of the full run): one open-loop overload at 5x
   capacity, repeated with one overload mechanism added per arm; ``--ablation-only`` runs it
   and writes ``ablation.json`` and ``ablation.png``.

``--quick`` shrinks every step (the test suite uses it to prove the command works) and starts the baselines and
the cascade arm's server at once, beside the first steps (``full_run``).

This module only composes the scenarios: each is its own module with a ``main()``, run alone
as ``python -m bench.<name>`` (docs/benchmarks.md, "Harness"), and every ``--*-only`` flag
delegates to one: ``--sweep-only`` to ``bench.closed_loop``, ``--peers-only`` to ``bench.peers``,
``--cascade-only`` to ``bench.cascade``, ``--knee-only`` to ``bench.knee_budget``,
``--ceiling-only`` to ``bench.ceiling``, ``--ablation-only`` to ``bench.ablation``. Steps 1-3
are ``bench.raw_ceiling``, ``bench.ramp`` and ``bench.overload``; servers start and stop through
``bench.harness``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import ablation, cascade, ceiling, closed_loop, knee_budget, peers
from bench.cascade import cascade_arm, cascade_scenario, scenario_bodies
from bench.ceiling import ceiling_scenario, plot_ceiling
from bench.harness import SLO_MS, Service, Sizes, machine
from bench.knee_budget import at_the_knee, knee_ratios, measure_naive_on_chosen_engine
from bench.process_cpu import tree_memory
from bench.loadgen import load_bodies, sweep
from bench.overload import drain, ramp_and_overload
from bench.peers import PEERS, service_ratios, skipped_peer
from bench.ramp import ramp
from bench.raw_ceiling import raw_ceiling

__all__ = ["main", "full_run", "plot"]


def main(argv: list[str] | None = None) -> int:
    """The command line of the module doc: a ``--*-only`` flag delegates to its scenario, else ``full_run``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--quick", action="store_true", help="tiny steps: proves the command, measures little")
    parser.add_argument("--sweep-only", action="store_true", help="only Rampart's closed-loop sweep (closed_loop.json)")
    parser.add_argument("--sweep-client", choices=("aiohttp", "httpx"), default="aiohttp")
    parser.add_argument("--cascade-only", action="store_true",
                        help="only the cascade against primary-first scenario (cascade.json)")
    parser.add_argument("--peers-only", action="store_true",
                        help="only the peer baselines and the naive one as reference (peers.json)")
    parser.add_argument("--ablation-only", action="store_true",
                        help="only the ablation of bench.ablation (ablation.json), all five arms")
    parser.add_argument("--ceiling-only", action="store_true", help="only the near-free-model ceiling (ceiling.json)")
    parser.add_argument("--knee-only", action="store_true",
                        help="only the raw ceiling, the ramps of Rampart (with its CPU budget) and of the baselines, "
                             "and the knee ratios (knee.json; about 5 minutes)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    quick = " --quick" if args.quick else ""
    if args.ablation_only:
        return ablation.main(["--out", str(args.out), *(["--quick"] if args.quick else [])])
    if args.sweep_only:
        sizes = Sizes.of(args.quick)
        return closed_loop.closed_loop_sweep(args.out, sizes.sweep_connections, sizes.sweep_s, args.sweep_client)
    if args.ceiling_only:
        return ceiling.run(args.out, args.quick, "python -m bench.load_bench --ceiling-only" + quick)
    if args.cascade_only:
        return cascade.run(args.out, args.quick, "python -m bench.load_bench --cascade-only" + quick)
    if args.knee_only:
        return knee_budget.run(args.out, args.quick, "python -m bench.load_bench --knee-only" + quick)
    if args.peers_only:
        return peers.run(args.out, args.quick, "python -m bench.load_bench" + quick + " --peers-only")
    return full_run(args.out, args.quick, args.sweep_client, "python -m bench.load_bench" + quick)


def full_run(out: Path, quick: bool, sweep_client: str, command: str) -> int:
    """Steps 1-8 of the module doc, one server at a time: the raw ceiling; per service its ramp and
    overload (Rampart at every factor, with its CPU budget after the ramp, then its closed-loop sweep and
    the primary-first arm of the cascade scenario on the same server; each baseline at 5×); the
    cascade arm; the near-free ceiling; the ratios. Writes ``load.json`` (``command`` recorded),
    ``load.png`` and ``ceiling.png``."""
    sizes = Sizes.of(quick)
    # --quick proves the command and measures little: the baselines and the cascade arm's server start at once,
    # beside the first steps, and wait idle for their turn; a full run starts each server when its turn comes.
    started = {name: Service(name, out) for name in ("naive", "plain_bentoml")} if quick else {}
    if quick:
        started["cascade"] = Service("rampart", out, env={"RAMPART_ROUTING": "cascade"}, label="rampart-cascade")
    try:
        return _measure_all(out, quick, sweep_client, command, sizes, started)
    finally:
        for service in started.values():
            service.stop()


def _measure_all(out: Path, quick: bool, sweep_client: str, command: str, sizes: Sizes,
                 started: dict[str, Service]) -> int:
    """``full_run``'s steps with the servers in ``started`` already launched (each used, then stopped, at its turn)."""
    bodies, named = load_bodies(), scenario_bodies(quick)
    primary_first_arm = None
    results: dict = {"machine": machine(), "slo_ms": SLO_MS, "command": command}
    results["raw_ceiling_ips"] = raw_ceiling(sizes.batch_sizes, sizes.repeats)
    unready = list(started.values())
    for name in ("rampart", "naive", "plain_bentoml", *PEERS):
        if skipped_peer(name, results):
            continue
        service = started.pop(name, None) or Service(name, out)
        try:
            service.wait_ready(bodies)
            while unready:  # every server is up before anything is measured (each waited for once)
                unready.pop().wait_ready(bodies)
            if name == "rampart":
                warm = tree_memory(service.process.pid)

                def budget(measured: dict, service: Service = service) -> dict:
                    return at_the_knee(service, bodies, measured, sizes.budget_s, warm)

                results[name] = ramp_and_overload(service, bodies, sizes, sizes.factors, after_ramp=budget)
                drain(service, bodies)
                results[name]["memory"]["after_overload"] = tree_memory(service.process.pid)
                results[name]["closed_loop_sweep"] = [r.summary() for r in sweep(
                    service.url, bodies, sizes.sweep_connections, sizes.sweep_s, SLO_MS, sweep_client)]
                drain(service, bodies)
                primary_first_arm = cascade_arm(service, named, sizes.clients, sizes.step_s)  # this Rampart is primary-first
            else:
                results[name] = ramp_and_overload(service, bodies, sizes, [5.0])
        finally:
            service.stop()
        print(name, json.dumps(results[name]["ramp"]["knee"]), flush=True)

    measure_naive_on_chosen_engine(results, out, bodies,
                                   lambda service: {"ramp": ramp(service, bodies, sizes.clients, sizes.step_s)})

    results["cascade"] = cascade_scenario(out, named, sizes.clients, sizes.step_s, {"primary-first": primary_first_arm},
                                          started=started)
    print("cascade", json.dumps({k: v for k, v in results["cascade"].items() if k != "arms"}), flush=True)
    results["near_free_ceiling"] = ceiling_scenario(out, quick)
    plot_ceiling({**results["near_free_ceiling"], "machine": results.get("machine", {})}, out / "ceiling.png")
    results["ratios"] = {}
    ours = results["rampart"]
    for name in ("naive", "plain_bentoml", *PEERS):
        theirs = results[name]
        if "skipped" in theirs:
            continue
        results["ratios"][name] = service_ratios(ours, theirs)
    results["knee_ratios"] = knee_ratios(results)
    (out / "load.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "load.png")
    print(json.dumps(results["ratios"], indent=2))
    return 0


def plot(results: dict, path: Path) -> None:
    """The full run's four panels (raw ceiling, ramp P99 against throughput, Rampart's overload, P99 at 5×) to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    services = ("rampart", "naive", "plain_bentoml", *(name for name in PEERS if "skipped" not in results[name]))
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ax = axes[0][0]
    for name, curve in results["raw_ceiling_ips"].items():
        sizes = sorted(curve, key=int)
        ax.plot([int(s) for s in sizes], [curve[s] for s in sizes], marker="o", label=name)
    ax.set(xscale="log", xlabel="batch size", ylabel="images/s", title="Raw model ceiling (no serving)")
    ax.legend()
    ax = axes[0][1]
    for name in services:
        steps = results[name]["ramp"]["steps"]
        ax.plot([s["throughput_rps"] for s in steps], [s["p99_ms"] for s in steps], marker="o", label=name)
    ax.axhline(results["slo_ms"], color="grey", linestyle="--", label="SLO")
    ax.set(xlabel="throughput (requests/s)", ylabel="P99 (ms)", yscale="log", title="Closed-loop ramp: P99 vs throughput")
    ax.legend()
    ax = axes[1][0]
    runs = results["rampart"]["overload"]
    factors = sorted(runs, key=float)
    for key, label in (("goodput_rps", "goodput"), ("throughput_rps", "200 answers"),):
        ax.plot([float(f) for f in factors], [runs[f][key] for f in factors], marker="o", label=f"Rampart {label}")
    for name in services[1:]:
        ax.scatter([5.0], [results[name]["overload"]["5.0"]["goodput_rps"]], label=f"{name} goodput", zorder=3)
    ax.set(xlabel="offered load (× knee)", ylabel="requests/s", title="Open-loop overload")
    ax.legend()
    ax = axes[1][1]
    p99 = [results[name]["overload"]["5.0"]["p99_accepted_ms"] or 0 for name in services]
    ax.bar(services, p99)
    ax.axhline(results["slo_ms"], color="grey", linestyle="--")
    ax.set(ylabel="P99 of accepted requests (ms)", title="At 5× each service's knee", yscale="log")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
