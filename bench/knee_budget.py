"""Knee ratios and the CPU budget: ``python -m bench.knee_budget [--out bench_results] [--quick]`` writes
``knee.json`` (also ``python -m bench.load_bench --knee-only``; about 5 minutes).

The raw ceiling (``bench.raw_ceiling``), then Rampart's ramp up to 64 clients (``bench.ramp``)
and one more step at its primary-path knee's client count with the server's CPU per request
by process (measured) and by stage (py-spy samples, when installed): ``bench.cpu_budget``;
then each baseline's ramp, one server at a time, and, when Rampart's primary chose another engine than
PyTorch (``RAMPART_PRIMARY_ENGINE=auto`` on a CPU host may pick its ONNX export), the naive server once
more on that engine (``naive_onnx``). ``knee_ratios`` divides Rampart's primary-path knee by the raw
primary ceiling at its best batch size, by every baseline's knee that ran, and by the naive knee on the
engine Rampart chose (``naive_on_chosen_engine``). Rampart's ``memory``: the whole process tree's resident memory
by role (``bench.process_cpu.tree_memory``, MiB of RSS and PSS) after warm-up and after its ramp and budget step.
Also step 7 of ``python -m bench.load_bench``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from bench.baselines.common import BASELINE_ENGINE_VARIABLE
from bench.harness import SLO_MS, Service, Sizes, machine, measure_service, ratio, run_scenario
from bench.loadgen import closed_loop, load_bodies, run_sync, summarize
from bench.peers import skipped_peer
from bench.process_cpu import tree_memory
from bench.ramp import ramp
from bench.raw_ceiling import raw_ceiling

__all__ = ["knee_ratios", "naive_on", "measure_naive_on_chosen_engine", "primary_engine", "budget_step", "at_the_knee",
           "knee_comparison",
           "run", "main"]


def knee_ratios(results: dict) -> dict:
    """Rampart's primary-path knee (``primary_knee`` ``full_rps``, req/s) against the raw primary model ceiling at
    its best batch size (images/s, ``raw_ceiling_ips``) and against every baseline in ``results`` (its knee
    throughput, req/s; each baseline answers from the same model only): ``{"raw_ceiling": …, "<baseline>": …,
    "naive_on_chosen_engine": …}``, each also with the two figures it divides. Baselines are the services
    ``Service.COMMANDS`` names, other than Rampart, that ran; ``naive_on_chosen_engine`` is the naive server
    on the engine Rampart's primary chose (``results["rampart"]["primary_engine"]``): the naive run itself
    for torch, else ``results["naive_<engine>"]``."""
    ours = results["rampart"]["ramp"]["primary_knee"]["full_rps"]
    out = {}
    ceiling = results.get("raw_ceiling_ips", {}).get("primary")
    if ceiling:
        best_batch = max(ceiling, key=lambda size: ceiling[size])
        out["raw_ceiling"] = {"ratio": ratio(ours, ceiling[best_batch]), "rampart_primary_knee_rps": ours,
                              "ceiling_ips": ceiling[best_batch], "best_batch": int(best_batch)}
    for name in Service.COMMANDS:
        if name != "rampart" and name in results and "ramp" in results[name]:
            theirs = results[name]["ramp"]["knee"]["throughput_rps"]
            out[name] = {"ratio": ratio(ours, theirs), "rampart_primary_knee_rps": ours, "knee_rps": theirs}
    chosen = results["rampart"].get("primary_engine")
    same_engine = naive_on(chosen) if chosen else None
    if same_engine in results and "ramp" in results[same_engine]:
        theirs = results[same_engine]["ramp"]["knee"]["throughput_rps"]
        out["naive_on_chosen_engine"] = {"engine": chosen, "baseline": same_engine, "ratio": ratio(ours, theirs),
                                         "rampart_primary_knee_rps": ours, "knee_rps": theirs}
    return out


def naive_on(engine: str) -> str:
    """The results key of the naive server on ``engine``: ``naive`` for torch (the model's own engine, which the
    naive server runs by default), else ``naive_<engine>``."""
    return "naive" if engine == "torch" else f"naive_{engine}"


def measure_naive_on_chosen_engine(results: dict, out: Path, bodies: list[bytes],
                                   measure: Callable[[Service], dict]) -> None:
    """When Rampart's primary chose another engine than the naive server's own (``results["rampart"]
    ["primary_engine"]``), ``measure`` the naive server once more on that engine (``RAMPART_BASELINE_ENGINE``)
    into ``results["naive_<engine>"]``; nothing when it chose torch or the naive server did not run."""
    chosen = results["rampart"].get("primary_engine")
    label = naive_on(chosen) if chosen else "naive"
    if label == "naive" or "naive" not in results:
        return
    results[label] = measure_service("naive", out, bodies, measure, env={BASELINE_ENGINE_VARIABLE: chosen}, label=label)
    print(label, json.dumps(results[label]["ramp"]["knee"]), flush=True)


def primary_engine(service: Service) -> str | None:
    """The engine Rampart's primary runs on (``torch`` or ``onnx``), from its ``GET /stats``; None if not said."""
    stats = service.stats() or {}
    return ((stats.get("primary") or {}).get("runner") or {}).get("engine", {}).get("engine")


def budget_step(service: Service, bodies: list[bytes], clients: int, step_s: float) -> dict:
    """One more closed-loop step of ``clients`` (normally the primary-path knee's) with the server's per-request
    CPU budget measured during it (``bench.cpu_budget.measure``: by process exactly, by stage from py-spy samples
    when py-spy is installed); also the step's throughput, full answers per second and P99."""
    from bench.cpu_budget import measure

    def step() -> list:
        return run_sync(closed_loop(service.url, bodies, clients, step_s, deadline_ms=SLO_MS))

    captured: list = []
    report = measure(service.process.pid, lambda: captured.extend(step()) or captured, step_s)
    summary = summarize(captured, step_s)
    return {"clients": clients, "step_s": step_s, "throughput_rps": summary["throughput_rps"],
            "full_rps": round(summary["full"] / step_s, 2), "p99_ms": summary["p99_ms"], **report}


def at_the_knee(service: Service, bodies: list[bytes], measured: dict, budget_s: float, warm_memory: dict) -> dict:
    """What Rampart's report adds once its ramp (``measured["ramp"]``) found the primary-path knee: ``cpu_budget``
    (``budget_step`` at the knee's client count, ``budget_s`` seconds), ``primary_engine`` and ``memory``: the whole
    tree's resident memory (``bench.process_cpu.tree_memory``) ``after_warm_up`` (``warm_memory``, read before the
    ramp) and ``after_ramp`` (now, after the budget step)."""
    return {"cpu_budget": budget_step(service, bodies, measured["ramp"]["primary_knee"]["clients"], budget_s),
            "primary_engine": primary_engine(service),
            "memory": {"after_warm_up": warm_memory, "after_ramp": tree_memory(service.process.pid)}}


def knee_comparison(out: Path, batch_sizes: list[int], repeats: int, clients: list[int], step_s: float,
                    budget_s: float, command: str) -> int:
    """The raw ceiling, then Rampart's ramp and CPU budget (a ``budget_s`` step) at its primary-path knee, then each
    baseline's ramp, one server at a time; writes ``knee.json`` (``command`` recorded) with ``knee_ratios`` and
    prints the ratios."""
    bodies = load_bodies()
    results: dict = {"machine": machine(), "slo_ms": SLO_MS, "command": command,
                     "raw_ceiling_ips": raw_ceiling(batch_sizes, repeats)}
    def measure(service: Service) -> dict:
        if service.name != "rampart":
            return {"ramp": ramp(service, bodies, clients, step_s)}
        warm = tree_memory(service.process.pid)
        measured = {"ramp": ramp(service, bodies, clients, step_s)}
        return measured | at_the_knee(service, bodies, measured, budget_s, warm)

    for name in Service.COMMANDS:
        if skipped_peer(name, results):
            continue
        results[name] = measure_service(name, out, bodies, measure)
        print(name, json.dumps(results[name]["ramp"]["primary_knee"]), flush=True)
    measure_naive_on_chosen_engine(results, out, bodies, measure)
    results["knee_ratios"] = knee_ratios(results)
    (out / "knee.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({"knee_ratios": results["knee_ratios"], "cpu_budget": results["rampart"]["cpu_budget"],
                      "rss_mib": {when: memory["rss_mb"] for when, memory in results["rampart"]["memory"].items()}},
                     indent=2))
    return 0


def run(out: Path, quick: bool, command: str) -> int:
    """``knee_comparison`` with ``bench.harness.Sizes`` (the ramp cut at 64 clients)."""
    sizes = Sizes.of(quick)
    return knee_comparison(out, sizes.batch_sizes, sizes.repeats, [n for n in sizes.clients if n <= 64], sizes.step_s,
                           sizes.budget_s, command)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.knee_budget [--out DIR] [--quick]``: ``run`` with this command recorded."""
    return run_scenario("python -m bench.knee_budget", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
