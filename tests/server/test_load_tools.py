"""The load tools of docs/clients.md against a real server, run exactly as documented: locust with
``bench/locustfile.py`` (headless, a few seconds) and ``python -m bench.loadgen``."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

from tests.support import ROOT


def test_locust_headless_reports_full_and_degraded_answers_apart_by_priority(server, tmp_path):
    prefix = tmp_path / "rampart"
    # One user: an idle server, so nothing is shed (two at 100 ms deadlines can be: a request behind another
    # in the fallback's queue may be predicted late, and the primary has no share of 100 ms).
    command = [sys.executable, "-m", "locust", "-f", "bench/locustfile.py", "--headless", "-u", "1", "-r", "1",
               "-t", "8s", "--stop-timeout", "5", "--host", server.url, "--csv", str(prefix), "--only-summary",
               # 3 s: the primary answers (full); 100 ms leaves the primary no share (degraded, the fallback's)
               "--deadlines-ms", "3000,100", "--high-fraction", "0.5"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]  # 1 when any request failed
    with open(f"{prefix}_stats.csv", newline="") as stats:
        rows = {row["Name"]: row for row in csv.DictReader(stats)}
    total = rows.pop("Aggregated")
    # Rounds of (3000, 100) ms, every other one high: four requests cover every row.
    assert int(total["Request Count"]) >= 4 and int(total["Failure Count"]) == 0, (total, out.stderr[-3000:])
    names = set(rows)
    assert names == {f"/classify {priority} {kind}" for priority in ("high", "normal") for kind in ("full", "degraded")}


def test_bench_loadgen_command_line_prints_a_json_summary(server):
    command = [sys.executable, "-m", "bench.loadgen", "--url", server.url, "--mode", "closed", "--connections", "2",
               "--duration-s", "3", "--deadline-ms", "3000"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["mode"] == "closed" and summary["url"] == f"{server.url}/classify"
    assert summary["requests"] >= 2 and summary["ok"] == summary["requests"] and summary["errors_5xx"] == 0, summary
    assert summary["full"] + summary["degraded"] == summary["ok"] and summary["p99_ms"] > 0
