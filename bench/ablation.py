"""The design's own ablation: one overload, repeated with one mechanism added per arm.

``python -m bench.ablation [--out bench_results] [--arms abcde] [--capacity RPS] [--merge] [--quick]``
(also ``python -m bench.load_bench --ablation-only``) writes ``ablation.json`` and
``ablation.png``. Every arm is a fresh Rampart (``bench.harness.Service``) with the
settings of ``ARMS``, warmed up by a short closed loop, then given the same open-loop
Poisson run (``bench.loadgen.open_loop``, same seed, same six photos of
``bench.loadgen.load_bodies``) at ``FACTOR`` × capacity for ``duration_s`` seconds, every
request with ``X-Deadline-Ms: 1000``:

- (a) ``no_admission``: no admission control: unbounded model and decode queues, no
  in-flight bound, the deadline ignored (every request is worked on for up to
  ``max_deadline_ms``), primary only;
- (b) ``queue_bound``: (a) plus the bounded queue (429 when the primary's gate is full);
- (c) ``deadlines``: (b) plus deadlines: shedding on predicted lateness, the pipeline
  stopping at the deadline, the runners' TTL drop;
- (d) ``fallback``: (c) plus the fallback chain: Rampart's defaults (``primary-first``);
- (e) ``cascade``: (d) with ``RAMPART_ROUTING=cascade``.

The switches (``RAMPART_ROUTING=primary-only``, ``RAMPART_ADMISSION``,
``RAMPART_HONOUR_DEADLINES``) are for experiments, not for production, and take effect only with
``RAMPART_EXPERIMENTS=true`` (without it the server refuses to start; docs/configuration.md, "Experiments"),
which arms a-c set.

*Capacity* is the knee of a closed-loop ramp (``bench.ramp.ramp``: the highest
throughput with P99 ≤ 1 s and ≤ 1% refused) of a default Rampart, measured first in the
same run, unless ``--capacity`` gives it (to split the arms across runs, with ``--merge``).

The client waits up to ``CLIENT_PATIENCE_S`` for an answer, so answers after the deadline
are seen and timed; per arm (``outcome_summary``): **availability** (share of requests
answered 200 with a model's labels within the deadline, at the client), **timeouts**
(no answer, or any answer, after the deadline), 429s, 5xx, P50/P99 of every request's
client latency (an unanswered request counts as the client's patience, so a P99 equal to
it means "at least"), and the server's own counters from ``/stats`` after the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


from bench.harness import Service, machine
from bench.loadgen import Sample, closed_loop, load_bodies, open_loop, run_sync, summarize
from bench.ramp import ramp

__all__ = ["Arm", "ARMS", "FACTOR", "DEADLINE_MS", "CLIENT_PATIENCE_S", "outcome_summary", "run_arm",
           "measure_capacity", "main"]

#: Offered load, as a multiple of the measured capacity (5x, as in the overload tests).
FACTOR = 5.0
#: Every request's deadline (ms): 1 s.
DEADLINE_MS = 1000.0
#: How long the client waits for an answer (s): long enough to time the late answers of arms (a) and (b),
#: short enough that the run ends soon after the last arrival.
CLIENT_PATIENCE_S = 5.0
#: Closed loop before each arm's measured run (connections, seconds): every arm starts equally warm.
WARM_UP = (8, 3.0)
#: Connection counts of the capacity ramp (4 s each): around the knee of the 2-core machine (16).
CAPACITY_CLIENTS = [4, 8, 16, 32]


@dataclass(frozen=True)
class Arm:
    """One arm: its ``key`` (a..e), ``name``, what it adds (``adds``) and the ``env`` it runs with."""

    key: str
    name: str
    adds: str
    env: dict[str, str] = field(default_factory=dict)


_PRIMARY_ONLY = {"RAMPART_EXPERIMENTS": "true", "RAMPART_ROUTING": "primary-only"}
ARMS = {arm.key: arm for arm in (
    Arm("a", "no_admission", "no admission control: unbounded queues, deadline ignored",
        {**_PRIMARY_ONLY, "RAMPART_ADMISSION": "off", "RAMPART_HONOUR_DEADLINES": "false"}),
    Arm("b", "queue_bound", "bounded queue only (429 when full)",
        {**_PRIMARY_ONLY, "RAMPART_ADMISSION": "queue-bound", "RAMPART_HONOUR_DEADLINES": "false"}),
    Arm("c", "deadlines", "plus deadlines: predicted-late shedding, stop at the deadline, TTL drop", _PRIMARY_ONLY),
    Arm("d", "fallback", "plus the fallback chain (Rampart's defaults, primary-first)", {}),
    Arm("e", "cascade", "plus the cascade (RAMPART_ROUTING=cascade)", {"RAMPART_ROUTING": "cascade"}),
)}


def outcome_summary(samples: list[Sample], duration_s: float, deadline_ms: float = DEADLINE_MS) -> dict:
    """What the client saw in one arm: ``bench.loadgen.summarize`` plus the ablation's shares.

    ``availability``: 200 answers with a model's labels (``model`` set) within ``deadline_ms``,
    over all requests; ``in_time``: any answer that is not a 5xx within the deadline (labels,
    the static answer, or a 429: the client knows at once where it stands); ``timeouts``: no
    answer, or an answer later than the deadline; ``static``: 200 answers without labels;
    ``degraded_with_labels``: 200 answers with labels and a ``degraded_reason``. Shares are
    of all requests, in [0, 1], rounded to 4 places; latencies in ms.
    """
    n = max(len(samples), 1)
    in_deadline = [s for s in samples if s.status != 0 and s.latency_ms <= deadline_ms]
    labelled = [s for s in samples if s.status == 200 and s.model is not None]

    def share(count: int) -> float:
        return round(count / n, 4)

    return {
        **summarize(samples, duration_s),
        "availability": share(sum(1 for s in labelled if s.latency_ms <= deadline_ms)),
        "in_time": share(sum(1 for s in in_deadline if s.status < 500)),
        "timeouts": share(n - len(in_deadline) if samples else 0),
        "shed_429_share": share(sum(1 for s in samples if s.status == 429)),
        "errors_5xx_share": share(sum(1 for s in samples if s.status >= 500)),
        "static": share(sum(1 for s in samples if s.status == 200 and s.model is None)),
        "degraded_with_labels": share(sum(1 for s in labelled if s.degraded_reason is not None)),
        "answered_by": {name: sum(1 for s in labelled if s.model == name) for name in sorted({s.model for s in labelled})},
    }


def _stop_now(service: Service) -> None:
    """Kill an arm's server at once (SIGKILL to its process group): what it still holds is abandoned, and
    a drain of an unbounded queue would take up to ``max_deadline_ms``."""
    service.kill_group()


def measure_capacity(out: Path, bodies: list[bytes], clients: list[int], step_s: float) -> dict:
    """The knee of a closed-loop ramp of a default Rampart (``bench.ramp.ramp``); returns the ramp."""
    service = Service("rampart", out, label="ablation-capacity")
    try:
        service.wait_ready(bodies)
        return ramp(service, bodies, clients, step_s)
    finally:
        _stop_now(service)


def run_arm(arm: Arm, out: Path, bodies: list[bytes], rate: float, duration_s: float, seed: int = 15) -> dict:
    """Start a Rampart with ``arm.env``, warm it up (``WARM_UP``), run the open loop at ``rate`` requests/s for
    ``duration_s`` s, and return ``outcome_summary`` with the server's ``/stats`` after the run."""
    service = Service("rampart", out, env=arm.env, label=f"ablation-{arm.key}")
    try:
        started = time.monotonic()
        service.wait_ready(bodies)
        start_s = time.monotonic() - started
        run_sync(closed_loop(service.url, bodies, WARM_UP[0], WARM_UP[1], deadline_ms=DEADLINE_MS))
        samples = run_sync(open_loop(service.url, bodies, rate, duration_s, deadline_ms=DEADLINE_MS, seed=seed,
                                     client_timeout_s=CLIENT_PATIENCE_S,
                                     connections=int(rate * CLIENT_PATIENCE_S) + 64))
        stats = service.stats()
    finally:
        _stop_now(service)
    server = None
    if stats is not None:
        server = {role: {key: stats[role].get(key) for key in ("throughput_ips", "queue_limit", "breaker_opened")}
                  | {"ttl_dropped": (stats[role].get("runner") or {}).get("ttl_dropped")}
                  for role in ("primary", "fallback")}
        server["cascade"] = stats.get("cascade")
    return {"key": arm.key, "name": arm.name, "adds": arm.adds, "env": arm.env, "offered_rps": round(rate, 1),
            "duration_s": duration_s, "server_start_s": round(start_s, 1), **outcome_summary(samples, duration_s),
            "server_after": server}


def plot(report: dict, path: Path) -> None:
    """Outcome shares per arm (stacked) and P50/P99 client latency per arm, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [report["arms"][key] for key in sorted(report["arms"])]
    names = [f"({a['key']}) {a['name']}" for a in arms]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    parts = [("labels in time", lambda a: a["availability"], "tab:green"),
             ("static answer in time", lambda a: max(a["in_time"] - a["availability"] - a["shed_429_share"], 0.0),
              "tab:olive"),
             ("429 in time", lambda a: a["shed_429_share"], "tab:blue"),
             ("timeout (late or none)", lambda a: a["timeouts"], "tab:red")]
    bottom = [0.0] * len(arms)
    for label, value, colour in parts:
        heights = [value(a) for a in arms]
        left.bar(names, heights, bottom=bottom, label=label, color=colour)
        bottom = [b + h for b, h in zip(bottom, heights)]
    left.set(ylabel="share of requests", ylim=(0, 1.05),
             title=f"{FACTOR:g}x capacity ({report['capacity_rps']} req/s), {DEADLINE_MS:.0f} ms deadline")
    left.legend(loc="upper left", fontsize=8)
    left.tick_params(axis="x", rotation=20)
    x = range(len(arms))
    right.bar([i - 0.2 for i in x], [a["p50_ms"] or 0 for a in arms], width=0.4, label="P50")
    right.bar([i + 0.2 for i in x], [a["p99_ms"] or 0 for a in arms], width=0.4, label="P99")
    right.axhline(DEADLINE_MS, color="grey", linestyle="--", label="deadline")
    right.set_xticks(list(x), names, rotation=20)
    right.set(ylabel="client latency (ms; unanswered = client's patience)", yscale="log", title="Latency per arm")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--arms", default="abcde", help="which arms, e.g. 'ab' (default all five)")
    parser.add_argument("--capacity", type=float, default=None, help="capacity in req/s (default: measure it)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of open-loop load per arm")
    parser.add_argument("--merge", action="store_true", help="add the arms to an existing ablation.json")
    parser.add_argument("--quick", action="store_true", help="tiny runs: proves the command, measures little")
    args = parser.parse_args(argv)
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {''.join(ARMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "ablation.json"
    report = json.loads(path.read_text()) if args.merge and path.exists() else {"arms": {}}
    duration_s = 2.0 if args.quick else args.duration
    bodies = load_bodies()
    if args.capacity is not None:
        capacity, source = args.capacity, "given (--capacity)"
        if report.get("capacity_rps") == capacity:  # the arms before measured it (--merge)
            source = report.get("capacity_source", source)
    else:
        clients, step_s = ([4], 2.0) if args.quick else (CAPACITY_CLIENTS, 4.0)
        capacity_ramp = measure_capacity(args.out, bodies, clients, step_s)
        capacity, source = max(capacity_ramp["knee"]["throughput_rps"], 1.0), "closed-loop knee of a default Rampart"
        report["capacity_ramp"] = capacity_ramp
        print("capacity", json.dumps(capacity_ramp["knee"]), flush=True)
    if report.get("capacity_rps") not in (None, capacity):
        print(f"note: arms from another run used capacity {report['capacity_rps']} req/s", flush=True)
    report.update({"machine": machine(), "capacity_rps": capacity, "capacity_source": source, "factor": FACTOR,
                   "deadline_ms": DEADLINE_MS, "client_patience_s": CLIENT_PATIENCE_S, "duration_s": duration_s})
    report.setdefault("commands", []).append(
        "python -m bench.ablation " + " ".join(argv if argv is not None else sys.argv[1:]))
    for key in args.arms:
        result = run_arm(ARMS[key], args.out, bodies, FACTOR * capacity, duration_s)
        result["capacity_rps"] = capacity
        report["arms"][key] = result
        print(key, json.dumps({k: result[k] for k in ("availability", "timeouts", "shed_429", "errors_5xx", "p99_ms",
                                                      "in_time", "static", "requests")}), flush=True)
        path.write_text(json.dumps(report, indent=2))
    plot(report, args.out / "ablation.png")
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    """The table of docs/benchmarks.md ("Ablation"): one line per arm."""
    print("arm  availability  in_time  timeouts  429s  5xx  P50_ms  P99_ms  static  degraded")
    for key in sorted(report["arms"]):
        a = report["arms"][key]
        print(f"({key}) {a['availability']:>11.1%}  {a['in_time']:>7.1%}  {a['timeouts']:>8.1%}  {a['shed_429']:>4}"
              f"  {a['errors_5xx']:>3}  {a['p50_ms']:>6}  {a['p99_ms']:>6}  {a['static']:>6.1%}"
              f"  {a['degraded_with_labels']:>8.1%}")


if __name__ == "__main__":
    sys.exit(main())
