"""``rampart.plan.planner``: the plan and overlay from fixed measurements; the overlay renders and validates (no
server)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from rampart.config import FLAT_NAMES, Settings
from rampart.plan import planner
from rampart.plan.planner import knee_of, plan, plot, write_overlay
from tests.support.deploy import validate

MEASURED = {
    "service_ms": 120.0,
    "ramp": [{"clients": c, "throughput_rps": t, "goodput_rps": t, "primary_rps": p, "p50_ms": l / 2, "p99_ms": l,
              "error_rate": 0.0} for c, t, p, l in ((1, 8, 8, 130), (4, 30, 30, 220), (16, 40, 35, 700), (64, 45, 36, 1400))],
    "knee": {"clients": 16, "goodput_rps": 40.0, "p99_ms": 700},
    "primary_capacity_rps": 36.0,
    "overload": {"goodput_rps": 80.0, "fallback_inference_p99_ms": 61.0},
    "cpu_ms_per_request": {"api": 8.0, "primary": 30.0, "fallback": 4.0, "total": 50.0},
    "rss_bytes": 3_400_000_000,
}


def test_a_plan_from_known_measurements(tmp_path):
    planned = plan(MEASURED, peak_rps=100, p99_ms=1000, deadline_ms=1000, degraded_share=0.0, settings=Settings())
    assert planned["fleet"]["replicas"] == 4  # the primaries bind: 100 / (0.8 x 36) = 3.5
    assert planned["settings"]["RAMPART_FALLBACK_RESERVE_MS"] == 130
    # the primary's share of the deadline, 1000 - 130 - 20 = 850, less the 120 ms service time
    assert planned["settings"]["RAMPART_PRIMARY_QUEUE_DELAY_MS"] == 730
    assert planned["queue_places"]["primary"] == 26  # 36 img/s x 0.73 s
    at_3x = planned["outcomes"]["3.0x"]  # 75 per replica: 36 by the primary, the other 39 within the 80 in all
    assert (at_3x["primary"], at_3x["fallback"], at_3x["shed"]) == pytest.approx((0.48, 0.52, 0.0), abs=1e-3)
    at_1_5x = planned["outcomes"]["1.5x"]  # 37.5 per replica: 36 + 1.5
    assert (at_1_5x["primary"], at_1_5x["shed"]) == pytest.approx((0.96, 0.0), abs=1e-3)
    plot(MEASURED, planned, 1000, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_the_overlay_renders_and_validates(tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (make kubectl)")
    planned = plan(MEASURED, peak_rps=100, p99_ms=1000, deadline_ms=1000, degraded_share=0.0, settings=Settings())
    overlay = write_overlay(planned, tmp_path / "overlay")
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    for doc in docs:
        validate(doc)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert deployment["spec"]["replicas"] == 4
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RAMPART_FALLBACK_RESERVE_MS"] == "130" and env["RAMPART_API_WORKERS"] == "1"
    assert env["RAMPART_MAX_DEADLINE_MS"] == "60000"  # the base's settings stay
    for name in env:  # every setting the plan writes is one Rampart reads
        assert name.removeprefix("RAMPART_").lower() in FLAT_NAMES, name
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 8)
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == str(planned["fleet"]["queue_wait_threshold_s"])


def test_the_knee_is_the_best_step_within_the_target_and_says_when_none_is():
    steps = MEASURED["ramp"]
    assert knee_of(steps, 1000) == {**steps[2], "meets_target": True}  # 40 req/s at P99 700 ms
    assert knee_of(steps, 1) == {**steps[0], "meets_target": False}  # none: the lowest P99, flagged
    failing = [{**step, "error_rate": 1.0} for step in steps]  # a deadline no request met
    assert knee_of(failing, 1000)["meets_target"] is False


@pytest.mark.parametrize("arguments", [["--peak-rps", "nan"], ["--peak-rps", "inf"], ["--p99-ms", "nan"],
                                       ["--deadline-ms", "10"], ["--deadline-ms", "0"], ["--deadline-ms", "1e9"],
                                       ["--degraded-share", "nan"]])
def test_arguments_no_plan_can_use_are_refused_before_anything_runs(arguments, capsys):
    given = {"--peak-rps": "20", "--p99-ms": "1000"}
    given.update(dict(zip(arguments[::2], arguments[1::2])))
    assert planner.main([item for pair in given.items() for item in pair]) == 2
    assert "must be" in capsys.readouterr().err


def test_a_target_no_step_met_writes_no_plan_and_no_overlay(tmp_path, monkeypatch, capsys):
    """Fault injected: ``measure`` returns a ramp none of whose steps met P99 <= 1 ms (a real --quick run
    gave this and a confident 2-replica plan, exit 0)."""
    unmet = {**MEASURED, "knee": knee_of(MEASURED["ramp"], 1)}
    monkeypatch.setattr(planner, "measure", lambda *args: unmet)
    code = planner.main(["--peak-rps", "20", "--p99-ms", "1", "--out", str(tmp_path), "--url", "http://x", "--pid", "1"])
    assert code == 1 and "no measured step met P99 <= 1 ms" in capsys.readouterr().err
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["target_met"] is False and report["overlay"] is None and not (tmp_path / "overlay").exists()
