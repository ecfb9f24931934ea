"""The benchmark commands run end to end and write their JSON and PNG (small settings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import ROOT


def test_decode_bench_writes_json_and_plot_draft_beats_naive_and_processes_free_slots(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.decode_bench", "--repeats", "2", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    results = json.loads((tmp_path / "decode.json").read_text())
    assert (tmp_path / "decode.png").stat().st_size > 0
    assert set(results) == {"jpeg_7680x4320", "png_4000x3000", "workers"}
    jpeg = results["jpeg_7680x4320"]
    assert jpeg["speedup"] > 1.0 and jpeg["rss_ratio"] > 1.2, jpeg  # same-run ratios: draft decoding pays
    threads, processes = results["workers"]["threads"], results["workers"]["processes"]
    # Same-run ratio: killed bombs free their workers, threads keep running them.
    behind = "photos_behind_slow_bombs"
    assert processes[behind]["ips"] > 1.5 * threads[behind]["ips"], results["workers"]


def test_load_bench_quick_runs_end_to_end_with_both_baselines(tmp_path):
    """``--quick``: every service starts, is ramped and overloaded, and the report and plot are written.
    The Triton peer is skipped with its message: its interpreter here is this one, without PyTriton."""
    subprocess.run([sys.executable, "-m", "bench.load_bench", "--quick", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=900,
                   env={**os.environ, "RAMPART_PEERS_PYTHON": sys.executable})
    results = json.loads((tmp_path / "load.json").read_text())
    assert "make bench-peers" in results["triton"]["skipped"]
    assert (tmp_path / "load.png").stat().st_size > 0
    assert set(results["raw_ceiling_ips"]) == {"primary", "fallback"}
    for name in ("rampart", "naive", "plain_bentoml"):
        assert results[name]["ramp"]["steps"] and "5.0" in results[name]["overload"], name
    ours = results["rampart"]["overload"]["5.0"]
    assert ours["errors_5xx"] == 0 and ours["late"] == 0, ours
    sweep = results["rampart"]["closed_loop_sweep"]
    assert [r["connections"] for r in sweep] == [1, 4] and all(r["client_cpu_ms_per_request"] > 0 for r in sweep)
    assert set(results["ratios"]) == {"naive", "plain_bentoml"}
    # The primary-path knee against the raw ceiling and each baseline; the CPU budget at that knee.
    assert set(results["knee_ratios"]) == {"raw_ceiling", "naive", "plain_bentoml", "naive_on_chosen_engine"}, \
        results["knee_ratios"]
    # The default primary runs on PyTorch, as the naive server does: the naive knee is the same-engine one.
    assert results["rampart"]["primary_engine"] == "torch"
    assert results["knee_ratios"]["naive_on_chosen_engine"]["baseline"] == "naive"
    budget = results["rampart"]["cpu_budget"]
    assert budget["requests"] > 0 and all(budget["cpu_us_per_request"][role] > 0 for role in ("api", "primary")), budget
    # The whole tree's resident memory by role, after warm-up, after the ramp and after the overloads.
    memory = results["rampart"]["memory"]
    assert set(memory) == {"after_warm_up", "after_ramp", "after_overload"}, memory
    for when, figures in memory.items():
        rss = figures["rss_mb"]
        assert {"supervisor", "api", "decode", "primary", "fallback"} <= set(rss), (when, rss)
        assert abs(rss["total"] - sum(v for role, v in rss.items() if role != "total")) < 1 and rss["primary"] > 100, rss
    # Cascade against primary-first on the 24 quick evaluation images: every image compared, routes as asked.
    cascade = results["cascade"]
    assert cascade["images"] == cascade["compared"] == 24 and 0 <= cascade["agreement"] <= 1, cascade
    assert sum(cascade["routes_one_at_a_time"].values()) == 24
    assert set(cascade["routes_one_at_a_time"]) <= {"cascade_confident", "cascade_escalated"}
    arms = cascade["arms"]
    assert {answer["route"] for answer in arms["primary-first"]["answers"].values()} == {"primary_first"}
    assert arms["cascade"]["stats_cascade"]["routing"] == "cascade" and arms["cascade"]["full_knee"]["clients"] in (1, 8)
    assert cascade["knee_ratio"] is not None
    assert all(value is not None for ratios in results["ratios"].values() for value in ratios.values())
    # Near-free-model ceiling: Rampart with 2 API workers (two entry processes, each with its decode pool)
    # and the naive baseline serve the imported model; every answer a full 200, so no worker's gate shaped it.
    ceiling = results["near_free_ceiling"]
    assert 450_000 <= ceiling["bodies"]["phone_jpeg"]["bytes"] <= 550_000, ceiling["bodies"]
    assert set(ceiling["runs"]) == {"rampart_2_workers", "naive"}
    for label, runs in ceiling["runs"].items():
        assert set(runs) == {"phone_jpeg", "png_260"}, label
        for body, run in runs.items():
            assert run["clean"] and run["cpu_us_per_request"]["api"] > 0, (label, body, run)
    processes = ceiling["runs"]["rampart_2_workers"]["png_260"]["processes"]
    assert processes["api"] == 2 and processes["runners"] == 2 and processes["decode_pool"] >= 4, processes
    assert ceiling["runs"]["rampart_2_workers"]["png_260"]["cpu_us_per_request"]["decode_pool"] > 0
    assert set(ceiling["ratios"]["rampart_2_workers"]) == {"phone_jpeg", "png_260"}
    # Total CPU per request over the naive server's in the same round: the figure the cost target is judged by.
    for body, paired in ceiling["cpu_vs_naive"]["rampart_2_workers"].items():
        assert len(paired["rounds"]) == ceiling["settings"]["rounds"] == 1 and paired["median"] > 0, (body, paired)
    # Decode beside the naive server's whole decode and the lean reference, measured in the same run.
    for body in ("phone_jpeg", "png_260"):
        run = ceiling["runs"]["rampart_2_workers"][body]
        assert run["decode_vs_naive"] > 0 and run["decode_vs_lean"] > 0, run
        assert ceiling["in_process_us"][body]["lean_decode"] > 0
        # and beside the naive server's decode measured where it is served (its /stats)
        assert ceiling["runs"]["naive"][body]["naive_decode_served_us"] > 0 and run["decode_vs_naive_served"] > 0
    costs = ceiling["in_process_us"]["phone_jpeg"]  # the phone photo is decoded at the bucket's scale, not the file's
    assert costs["rampart_decode"] < 0.6 * costs["naive_decode"], costs
    assert (tmp_path / "ceiling.png").stat().st_size > 0
