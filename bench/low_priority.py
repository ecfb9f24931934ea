"""The low priority class beside normal traffic, with the real models; one arm per value of a setting, same run.

``python -m bench.low_priority [--setting RAMPART_RUNNER_LOW_PRIORITY_RIDERS] [--arms true,false]
[--rounds 3] [--out bench_results] [--quick]`` starts one fresh server per arm and round, the setting's
variable set to the arm's value, arms alternated (A, B, then B, A, ...) so that drift of a shared host falls
on both, and runs on each the scenario of ``tests/server/test_low_priority.py`` (``beside_normal``):

1. the primary's closed-loop capacity C_p (``CAPACITY_CLIENTS`` clients);
2. one uncounted phase of the scenario (``WARM_BESIDE_S``): normal traffic beside the low stream;
3. ``PHASE_ROUNDS`` rounds of: C_p again (``CAPACITY_ROUND_S``), normal open-loop traffic at
   ``NORMAL_SHARE`` × C_p (every capacity phase so far, this round's included) alone and the same beside
   ``LOW_CLIENTS`` closed-loop low-priority connections
   (``PHASE_S`` each; the same arrival times in both, alone first in even rounds and beside first in odd ones);

and reports the low stream's answers within the phases as a share of the idle capacity (C_p in the rounds
less the normal rate), normal P99 beside over alone, the share of normal requests the primary answered,
and the low images that rode in normal calls (``/stats``, primary ``runner_calls.riders``). It writes
``low_priority-<setting>.json`` and ``.png``. docs/planning.md ("Riders") reports it. Run it under
``flock /tmp/rampart-load.lock`` on a shared machine: every figure is timing.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import httpx

from bench.harness import Replica, alternated, plot_arm_bars, ratio, run_setting_arms, write_arms_report
from bench.loadgen import Sample, closed_loop, load_bodies, open_loop, run_sync, summarize

SETTING, ARMS = "RAMPART_RUNNER_LOW_PRIORITY_RIDERS", ("true", "false")
ROUNDS = 3
NORMAL_DEADLINE_MS = 1000
#: The low stream's deadline: the server's default ``low_priority_deadline_ms``, sent explicitly.
LOW_DEADLINE_MS = 10_000
#: Closed-loop connections of the primary's capacity (tests/server/test_overload.py: its knee on 2 cores).
CAPACITY_CLIENTS = 8
CAPACITY_S = 4.0
#: Seconds of the capacity phase in each round: the idle capacity the low stream is held to is C_p measured
#: between the phases it is compared with, not once before them. In a CI run the host slowed after the first
#: measurement (normal traffic alone then went 6% to the fallback, 0% on the quiet host), and the low stream was
#: held to the idle capacity of the faster host it no longer was (low_over_idle 0.67; 1.16-1.67 on the quiet host).
CAPACITY_ROUND_S = 2.0
#: Normal traffic at this share of C_p, with and without the low stream.
NORMAL_SHARE = 0.8
#: Seconds per phase, and rounds of (without, with) the low stream: five, so each side's P99 is over about 250
#: normal samples (with two rounds, about 60, P99 was nearly the slowest one).
PHASE_S = 4.0
PHASE_ROUNDS = 5
#: Seconds of the uncounted phase with the low stream before the rounds (``beside_normal``).
WARM_BESIDE_S = 2.0
#: Low-priority closed-loop connections: more than a dispatch window's worth of the primary is waiting.
LOW_CLIENTS = 24
PRIMARY = "rampart-primary"


async def side_by_side(url: str, bodies: list[bytes], rate: float, duration_s: float, seed: int,
                       low: bool) -> tuple[list[Sample], list[Sample]]:
    """Normal open-loop Poisson traffic at ``rate`` requests/s for ``duration_s`` s, with (``low``) the low stream
    of ``LOW_CLIENTS`` closed-loop connections beside it: (normal samples, low samples)."""
    normal = open_loop(url, bodies, rate, duration_s, deadline_ms=NORMAL_DEADLINE_MS, seed=seed)
    if not low:
        return await normal, []
    return tuple(await asyncio.gather(normal, closed_loop(url, bodies, LOW_CLIENTS, duration_s, LOW_DEADLINE_MS,
                                                          priority="low")))


def in_time_by_primary(samples: list[Sample], within_s: float | None = None) -> int:
    """Answers by the primary within their deadline; with ``within_s``, only those that came back within that many
    seconds of the phase's start: a closed loop's requests still in flight when its phase ends are answered after
    it, by a model that the phase's other streams no longer use (the low stream's, up to 4 s after a phase)."""
    return sum(1 for s in samples if s.status == 200 and s.model == PRIMARY and s.latency_ms <= s.deadline_ms
               and (within_s is None or s.sent_s + s.latency_ms / 1000 <= within_s))


def _riders(base_url: str) -> int | None:
    """Low images that have ridden in normal calls so far (``/stats``, primary ``runner_calls.riders``)."""
    calls = httpx.get(f"{base_url}/stats", timeout=10).json()["primary"].get("runner_calls") or {}
    return calls.get("riders")


def _median(values: list[float | None]) -> float | None:
    """The median of the values that are not None, or None when there is none."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def beside_normal(base_url: str, bodies: list[bytes], phase_rounds: int = PHASE_ROUNDS, phase_s: float = PHASE_S,
                  capacity_s: float = CAPACITY_S, capacity_round_s: float = CAPACITY_ROUND_S) -> tuple[dict, dict]:
    """The scenario (module doc) on the server at ``base_url``: ``(report, samples)``, ``samples`` the normal
    samples ``alone`` and ``beside`` and the ``low`` samples of every round, and ``c_p`` (images/s: every capacity
    phase's answers together)."""
    url = f"{base_url}/classify"
    run_sync(closed_loop(url, bodies, CAPACITY_CLIENTS, 2.0))  # warm: meters, decoders, cold code paths
    capacity = run_sync(closed_loop(url, bodies, CAPACITY_CLIENTS, capacity_s))
    capacity_answers = in_time_by_primary(capacity, capacity_s)
    c_p = capacity_answers / capacity_s
    rate = NORMAL_SHARE * c_p
    # Warm the scenario itself, uncounted: the first phase with the low stream ran slower than the later ones (the
    # first round's P99 ratio had a median of 1.21 over 69 runs, 1.04-1.14 for each later round; with this phase
    # still 1.20 over 26 runs, against 1.02-1.08: docs/planning.md, "Measuring it at 0.8 C_p").
    run_sync(side_by_side(url, bodies, max(rate, 0.5), min(phase_s, WARM_BESIDE_S), seed=-1, low=True))
    alone, beside, low, round_ratios, round_rates = [], [], [], [], []
    capacity_in_rounds = low_in_phase = low_with_drain = 0
    c_p_so_far = c_p
    riders_before = _riders(base_url)
    for i in range(phase_rounds):
        capacity_round = run_sync(closed_loop(url, bodies, CAPACITY_CLIENTS, capacity_round_s))
        capacity_in_rounds += in_time_by_primary(capacity_round, capacity_round_s)
        # Normal traffic at NORMAL_SHARE of C_p measured so far, this round's included: on the shared host the
        # first measurement alone was 20-25% off the rounds' own C_p in some runs, which put normal traffic
        # anywhere from 0.64 to 0.97 C_p, and both goals' figures with it.
        c_p_so_far = (capacity_answers + capacity_in_rounds) / (capacity_s + (i + 1) * capacity_round_s)
        rate = NORMAL_SHARE * c_p_so_far
        round_rates.append(round(rate, 1))
        phases = (False, True) if i % 2 == 0 else (True, False)  # without the low stream first, then with it first
        measured = {low_stream: run_sync(side_by_side(url, bodies, max(rate, 0.5), phase_s, seed=i, low=low_stream))
                    for low_stream in phases}
        round_alone, (normal, low_samples) = measured[False][0], measured[True]
        low_in_phase += in_time_by_primary(low_samples, phase_s)
        low_with_drain += in_time_by_primary(low_samples)
        round_ratios.append(ratio(summarize(normal, phase_s)["p99_ms"], summarize(round_alone, phase_s)["p99_ms"]))
        alone += round_alone
        beside += normal
        low += low_samples
    riders_after = _riders(base_url)
    seconds = phase_rounds * phase_s
    p99_alone = summarize(alone, seconds)["p99_ms"]
    p99_beside = summarize(beside, seconds)["p99_ms"]
    c_p_in_rounds = capacity_in_rounds / (phase_rounds * capacity_round_s)
    normal_rate = in_time_by_primary(beside) / seconds
    low_rate = low_in_phase / seconds
    idle = max(c_p_in_rounds - normal_rate, 1e-9)
    report = {"c_p": round(c_p, 1), "c_p_in_rounds": round(c_p_in_rounds, 1), "c_p_all": round(c_p_so_far, 1),
              "normal_rate": round(normal_rate, 1), "normal_rate_offered_by_round": round_rates,
              "low_rps": round(low_rate, 1), "low_over_idle": round(low_rate / idle, 2),
              "low_over_idle_with_drain": round(low_with_drain / seconds / idle, 2),
              "normal_by_primary_alone": round(in_time_by_primary(alone) / max(len(alone), 1), 2),
              "normal_by_primary_beside": round(in_time_by_primary(beside) / max(len(beside), 1), 2),
              "p99_alone_ms": p99_alone, "p99_beside_ms": p99_beside,
              "p99_ratio": ratio(p99_beside, p99_alone), "p99_ratio_by_round": round_ratios,
              "p99_ratio_median_of_rounds": _median(round_ratios),
              "low_riders": None if riders_before is None else riders_after - riders_before,
              "normal_alone": summarize(alone, seconds), "normal_beside": summarize(beside, seconds),
              "low": summarize(low, seconds)}
    return report, {"alone": alone, "beside": beside, "low": low, "c_p": c_p_so_far}


def plot(rows: list[dict], path: Path, setting: str = SETTING) -> None:
    """Bars per arm and round: the low stream's share of the idle capacity and normal P99 beside over alone."""
    plot_arm_bars(rows, path, setting,
                  {"low answers / idle capacity (goal ≥ 0.8)": [r["report"]["low_over_idle"] for r in rows],
                   "normal P99 beside / alone (goal ≤ 1.2)": [r["report"]["p99_ratio"] or 0 for r in rows]}, "ratio")


def run(out: Path, quick: bool, command: str, setting: str = SETTING, arms: tuple[str, ...] = ARMS,
        rounds: int = ROUNDS) -> int:
    """``rounds`` rounds of every arm of ``setting``, alternated; writes the JSON and the PNG under ``out``."""
    bodies = load_bodies()
    phases = {"phase_rounds": 1, "phase_s": 1.0, "capacity_s": 1.0, "capacity_round_s": 1.0} if quick else {}
    rows = []
    for r, arm in alternated(arms, 1 if quick else rounds):
        server = Replica(f"low-priority-{setting.lower()}-{arm}-{r}", out, {setting: arm})
        try:
            server.wait_ready()
            report, _ = beside_normal(server.url, bodies, **phases)
        finally:
            server.stop()
        rows.append({"arm": arm, "round": r, "report": report})
        print(json.dumps({"arm": arm, "round": r, **{k: v for k, v in report.items()
                                                   if not isinstance(v, dict)}}), flush=True)
    medians = {arm: {key: _median([r["report"][key] for r in rows if r["arm"] == arm])
                     for key in ("low_over_idle", "low_rps", "p99_ratio", "p99_ratio_median_of_rounds",
                                 "normal_by_primary_beside", "low_riders")}
               for arm in arms}
    name = f"low_priority-{setting.lower()}"
    return write_arms_report(out, name, command, setting, rows, medians, plot)


def main(argv: list[str] | None = None) -> int:
    return run_setting_arms("python -m bench.low_priority", __doc__.split("\n\n")[0], run, SETTING, ARMS, ROUNDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
