"""``python -m rampart.plan --quick`` against the session server: a plan, a PNG and an overlay that renders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.support import ROOT
from tests.support.deploy import validate


def test_the_quick_plan_measures_the_server_and_writes_a_valid_overlay(server, tmp_path):
    out = tmp_path / "plan"
    command = [sys.executable, "-m", "rampart.plan", "--peak-rps", "20", "--p99-ms", "1000", "--quick",
               "--out", str(out), "--url", server.url, "--pid", str(server.pid)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "plan.json").read_text())
    measured = report["measured"]
    assert measured["primary_capacity_rps"] > 0 and measured["knee"]["goodput_rps"] > 0, measured
    # The whole tree (two models, the API worker, decoders): at least 256 MiB whichever engine the primary runs on.
    assert measured["cpu_ms_per_request"]["total"] > 0 and measured["rss_bytes"] > 2 ** 28, measured
    assert report["fleet"]["replicas"] >= 2
    assert set(report["outcomes"]) == {"1.0x", "1.5x", "3.0x"}
    for outcome in report["outcomes"].values():
        assert outcome["primary"] + outcome["fallback"] + outcome["shed"] == pytest.approx(1.0, abs=1e-3)
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (make kubectl): the overlay is not rendered")
    rendered = subprocess.run(["kubectl", "kustomize", str(out / "overlay")], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    for doc in docs:
        validate(doc)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == report["fleet"]["replicas"]
