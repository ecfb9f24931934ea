"""The primary's capacity and its share at 5x overload, same run, one arm per value of a setting, with the real models.

``python -m bench.placement [--setting RAMPART_CPU_PINNING] [--arms weight,reserve] [--rounds 3]
[--out bench_results] [--quick]`` starts one fresh server per arm and round, the setting's variable
set to the arm's value (by default CPU placement: ``RAMPART_CPU_PINNING=weight``, the default, against
``reserve``; also ``--setting RAMPART_RUNNER_TORCH_GRAPH --arms traced,eager``), arms alternated
(A, B, then B, A, ...) so that drift of a shared host falls on both, and measures each:

1. the primary's closed-loop capacity C_p: answers from the primary within the 1 s deadline per
   second, the better of 4 and 8 clients (``KNEE_CLIENTS``, ``KNEE_S`` each; the primary-path knee
   of the 2-core host is at 4-8 clients);
2. open-loop Poisson arrivals at 5 × that arm's C_p for ``OVERLOAD_S``: the primary's and the
   whole server's answers within the deadline per second, as such and as shares of C_p, late
   answers, 5xx, 429s;

with the CPU each process role spent in each phase (``bench.process_cpu``) and the resident memory of each
role's processes after the overload (MiB, summed RSS). It writes ``placement.json`` and ``placement.png``
(``placement-<setting>.json`` and ``.png`` for another setting). docs/benchmarks.md ("CPU placement") and
docs/engines.md ("The traced graph") report it.
Run it under ``flock /tmp/rampart-load.lock`` on a shared machine: every figure is timing.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.harness import SLO_MS, Replica, ServerCpu, alternated, plot_arm_bars, run_setting_arms, write_arms_report
from bench.loadgen import Sample, closed_loop, load_bodies, open_loop, run_sync, summarize
from bench.process_cpu import server_processes

SETTING, ARMS = "RAMPART_CPU_PINNING", ("weight", "reserve")
ROUNDS = 3
KNEE_CLIENTS = (4, 8)
KNEE_S = 8.0
OVERLOAD_FACTOR = 5.0
OVERLOAD_S = 15.0
WARM_S = 3.0
PRIMARY = "rampart-primary"


def in_time(samples: list[Sample], model: str | None = None) -> int:
    """200 answers within their deadline (from ``model`` only, when given)."""
    return sum(1 for s in samples if s.status == 200 and s.latency_ms <= s.deadline_ms
               and (model is None or s.model == model))


def arm_figures(knee: dict[int, list[Sample]], knee_s: float, overload: list[Sample], overload_s: float) -> dict:
    """The figures of one arm's round from its samples: ``knee`` maps clients to that step's samples
    (``knee_s`` seconds each), ``overload`` the 5x run's (``overload_s``). Rates are per second."""
    steps = {clients: {"primary_rps": round(in_time(samples, PRIMARY) / knee_s, 2),
                       "p99_ms": summarize(samples, knee_s)["p99_ms"]} for clients, samples in knee.items()}
    c_p = max(step["primary_rps"] for step in steps.values())
    primary, total = in_time(overload, PRIMARY) / overload_s, in_time(overload) / overload_s
    summary = summarize(overload, overload_s)
    return {"c_p": c_p, "knee_steps": steps,
            "overload_5x": {"primary_rps": round(primary, 2), "total_rps": round(total, 2),
                            "primary_share_of_c_p": round(primary / c_p, 3) if c_p else None,
                            "total_share_of_c_p": round(total / c_p, 3) if c_p else None,
                            "late": summary["late"], "errors_5xx": summary["errors_5xx"],
                            "shed_429": summary["shed_429"]}}


def measure_arm(arm: str, round_index: int, out: Path, bodies: list[bytes], knee_s: float, overload_s: float,
                setting: str = SETTING) -> dict:
    """One fresh server with ``setting=arm``: warm-up, the knee steps, then 5 × its C_p."""
    server = Replica(f"placement-{setting.lower()}-{arm}-{round_index}", out, {setting: arm})
    try:
        server.wait_ready()
        url = f"{server.url}/classify"
        run_sync(closed_loop(url, bodies, max(KNEE_CLIENTS), WARM_S, deadline_ms=SLO_MS))
        knee, cpu = {}, {}
        for clients in KNEE_CLIENTS:
            meter = ServerCpu(server.process.pid)
            meter.start()
            knee[clients] = run_sync(closed_loop(url, bodies, clients, knee_s, deadline_ms=SLO_MS))
            cpu[f"knee_{clients}"] = {role: round(v["cpu_s"], 2) for role, v in meter.stop().items()}
        c_p = max(in_time(samples, PRIMARY) for samples in knee.values()) / knee_s
        meter = ServerCpu(server.process.pid)
        meter.start()
        overload = run_sync(open_loop(url, bodies, OVERLOAD_FACTOR * max(c_p, 0.5), overload_s,
                                      deadline_ms=SLO_MS, seed=round_index))
        cpu["overload_5x"] = {role: round(v["cpu_s"], 2) for role, v in meter.stop().items()}
        rss_mib: dict[str, int] = {}
        for role, process in server_processes(server.process.pid).values():
            rss_mib[role] = rss_mib.get(role, 0) + round(process.memory_info().rss / 2**20)
        return {"arm": arm, "round": round_index, **arm_figures(knee, knee_s, overload, overload_s), "cpu_s": cpu,
                "rss_mib_after_5x": rss_mib}
    finally:
        server.stop()


def plot(rows: list[dict], path: Path, setting: str = SETTING) -> None:
    """Bars per arm and round: C_p, and the primary's and the total's in-time answers per second at 5x."""
    plot_arm_bars(rows, path, setting, {"C_p (closed loop)": [r["c_p"] for r in rows],
                                        "primary at 5x": [r["overload_5x"]["primary_rps"] for r in rows],
                                        "total at 5x": [r["overload_5x"]["total_rps"] for r in rows]},
                  "answers within 1 s per second")


def run(out: Path, quick: bool, command: str, setting: str = SETTING, arms: tuple[str, ...] = ARMS,
        rounds: int = ROUNDS) -> int:
    """``rounds`` rounds of every arm of ``setting``, alternated; writes the JSON and the PNG under ``out``."""
    bodies = load_bodies()
    knee_s, overload_s = (1.0, 2.0) if quick else (KNEE_S, OVERLOAD_S)
    rows = []
    for r, arm in alternated(arms, 1 if quick else rounds):
        rows.append(measure_arm(arm, r, out, bodies, knee_s, overload_s, setting))
        print(json.dumps(rows[-1]), flush=True)
    medians = {}
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        medians[arm] = {key: statistics.median(values) for key, values in (
            ("c_p", [r["c_p"] for r in mine]),
            ("primary_rps_at_5x", [r["overload_5x"]["primary_rps"] for r in mine]),
            ("total_rps_at_5x", [r["overload_5x"]["total_rps"] for r in mine]))}
    name = "placement" if setting == SETTING else f"placement-{setting.lower()}"
    return write_arms_report(out, name, command, setting, rows, medians, plot)


def main(argv: list[str] | None = None) -> int:
    return run_setting_arms("python -m bench.placement", __doc__.split("\n\n")[0], run, SETTING, ARMS, ROUNDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
