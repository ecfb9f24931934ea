"""A same-run A/B of one setting on the near-free-model server: CPU per request by process role, arms alternated.

``python -m bench.ab --setting RAMPART_RUNNER_COALESCING --arms true,false [--rounds 2] [--body png_260]
[--connections 16] [--round-s 8] [--api-workers 1] [--out bench_results] [--quick]`` imports the
near-free model (``bench.ceiling``: a model that costs almost nothing, so what is measured is
serving), then, ``--rounds`` times, starts one Rampart server per arm in turn (A, B, B, A, A, B, …:
drift of a shared host falls on both arms alike, and neither arm is always the first of its round) with the setting at that arm's value, warms it
up and measures one closed-loop round (``bench.ceiling.measure_round``: the CPU of every server
process by role over the round, divided by the answered requests).

Writes ``ab-<setting>.json`` (every round, and per arm the median over rounds of each role's CPU
µs per request, the requests per second and P99; and ``paired``: each later arm's CPU per request
divided by the first arm's in the same round, per role, with the median, least and greatest ratio
over rounds) and ``ab-<setting>.png`` (bars per role and arm). Read the paired ratios when the host
drifts: two servers started one after the other share its state, rounds minutes apart may not (on
the 2-core host the total moved by 15% from the first round to the last of one run). A round that is not clean (an answer that is not a full 200) is marked; its CPU still
counts what the server spent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.ceiling import NEAR_FREE_NAME, ROLES, finish_import, measure_round, near_free_onnx, phone_jpeg, small_png, \
    start_import
from bench.loadgen import closed_loop_round, run_sync

__all__ = ["ab_runs", "main"]

BODIES = {"png_260": small_png, "phone_jpeg": phone_jpeg}
DEADLINE_MS = 10_000.0


def runner_calls(service) -> dict:
    """Each model's ``runner_calls`` from the server's ``/stats`` (calls, images per call, transport), by role;
    empty when ``/stats`` does not answer."""
    stats = service.stats() or {}
    return {role: stats[role]["runner_calls"] for role in ("primary", "fallback")
            if isinstance(stats.get(role, {}).get("runner_calls"), dict)}


def ab_runs(out: Path, setting: str, arms: list[str], rounds: int, body_name: str, connections: int,
            round_s: float, warm_s: float, api_workers: int, extra_env: dict[str, str] | None = None) -> dict:
    """Every round of every arm (module doc) and the per-arm medians; see ``main`` for the arguments."""
    from bench.harness import Service, alternated, private_bentoml_home

    directory = out / "near-free"
    onnx_path = near_free_onnx(directory / "near_free.onnx")
    finish_import(start_import(onnx_path, directory / "store"))
    store, tag = directory / "store" / "models", f"{NEAR_FREE_NAME}:latest"
    body, _ = BODIES[body_name]()
    runs: list[dict] = []
    for index, arm in alternated(arms, rounds):  # A, B, then B, A: neither arm always starts
        label = f"ab-{setting.lower()}-{arm}-{index}"
        env = {**private_bentoml_home(out / f"{label}-home", store), "RAMPART_PRIMARY_MODEL": tag,
               "RAMPART_FALLBACK_MODEL": tag, "RAMPART_API_WORKERS": str(api_workers),
               "RAMPART_CPU_PINNING": "off", **(extra_env or {}), setting: arm}
        service = Service("rampart", out, env=env, label=label)
        try:
            service.wait_ready([body])
            run_sync(closed_loop_round(service.url, [body], connections, warm_s, DEADLINE_MS))
            run = measure_round(service, body, connections, round_s, DEADLINE_MS, "supervisor")
            run["runner_calls"] = runner_calls(service)
        finally:
            service.stop()
        runs.append({"arm": arm, "round": index, **run})
        print(json.dumps({"arm": arm, "round": index, "rps": run["throughput_rps"],
                          "cpu_us": run["cpu_us_per_request"],
                          "items_per_call": {role: calls.get("items_per_call")
                                             for role, calls in run["runner_calls"].items()}}), flush=True)
    summary = {}
    for arm in arms:
        mine = [run for run in runs if run["arm"] == arm]
        summary[arm] = {
            "cpu_us_per_request": {role: round(statistics.median(r["cpu_us_per_request"][role] for r in mine), 1)
                                   for role in (*ROLES, "total")},
            "throughput_rps": round(statistics.median(r["throughput_rps"] for r in mine), 1),
            "p99_ms": round(statistics.median(r["p99_ms"] for r in mine), 1),
            "clean_rounds": sum(r["clean"] for r in mine),
        }
    return {"setting": setting, "arms": arms, "rounds": rounds, "body": body_name, "connections": connections,
            "round_s": round_s, "api_workers": api_workers, "runs": runs, "summary": summary,
            "paired": paired_ratios(runs, arms)}


def paired_ratios(runs: list[dict], arms: list[str]) -> dict[str, dict[str, dict[str, float | list[float]]]]:
    """Per arm after the first: ``{role: {"ratios": [...], "median", "min", "max"}}`` of its CPU µs per request
    over the first arm's in the same round (``runs``: ``ab_runs``' rounds, each with ``arm``, ``round`` and
    ``cpu_us_per_request``), for every role and ``total``; a round where the first arm spent nothing in a
    role gives no ratio for it. Rounds that lack either arm are skipped."""
    by_round: dict[int, dict[str, dict]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["arm"]] = run["cpu_us_per_request"]
    out: dict[str, dict] = {}
    for arm in arms[1:]:
        roles: dict[str, dict] = {}
        for role in (*ROLES, "total"):
            ratios = [round(rounds[arm][role] / rounds[arms[0]][role], 3) for _, rounds in sorted(by_round.items())
                      if arm in rounds and arms[0] in rounds and rounds[arms[0]][role] > 0]
            if ratios:
                roles[role] = {"ratios": ratios, "median": round(statistics.median(ratios), 3),
                               "min": min(ratios), "max": max(ratios)}
        out[arm] = roles
    return out


def plot(report: dict, path: Path) -> None:
    """Bars: median CPU µs per request of each role, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = [*ROLES, "total"]
    arms = report["arms"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(arms)
    for index, arm in enumerate(arms):
        values = [report["summary"][arm]["cpu_us_per_request"][role] / 1000 for role in roles]
        ax.bar([x + index * width for x in range(len(roles))], values, width,
               label=f"{arm} ({report['summary'][arm]['throughput_rps']} req/s)")
    ax.set(xticks=[x + 0.4 - width / 2 for x in range(len(roles))], xticklabels=roles, ylabel="CPU ms per request",
           title=f"{report['setting']}: {report['body']}, {report['connections']} connections, "
                 f"median of {report['rounds']} rounds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", required=True, help="the environment variable the arms set, e.g. RAMPART_RUNNER_COALESCING")
    parser.add_argument("--arms", required=True, help="comma-separated values, one arm each, e.g. true,false")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per arm, alternated (default 2)")
    parser.add_argument("--body", choices=sorted(BODIES), default="png_260", help="the upload (default png_260)")
    parser.add_argument("--connections", type=int, default=16, help="closed-loop clients (default 16)")
    parser.add_argument("--round-s", type=float, default=8.0, help="seconds measured per round (default 8)")
    parser.add_argument("--api-workers", type=int, default=1, help="RAMPART_API_WORKERS (default 1)")
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON, PNG and logs")
    parser.add_argument("--quick", action="store_true", help="1 round of 1 s with 4 connections, no warm-up")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    rounds, round_s, warm_s, connections = (1, 1.0, 0.0, 4) if args.quick else (args.rounds, args.round_s, 2.0,
                                                                                args.connections)
    started = time.monotonic()
    report = ab_runs(args.out, args.setting, args.arms.split(","), rounds, args.body, connections, round_s, warm_s,
                     args.api_workers)
    report["date"] = time.strftime("%Y-%m-%d")
    report["wall_s"] = round(time.monotonic() - started, 1)
    name = f"ab-{args.setting.lower()}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / f"{name}.png")
    print(json.dumps({"summary": report["summary"], "paired": report["paired"]}, indent=2))
    return report


if __name__ == "__main__":
    main()
