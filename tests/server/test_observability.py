"""Metrics on /metrics that move under load, JSON access logs, Server-Timing, the Grafana dashboard."""

from __future__ import annotations

import json
import re

import httpx
import psutil

from tests.support import PHOTOS, encode, logged_lines, photo, server_timing
from tests.support.metrics import dashboard_metrics, missing_metrics, scrape, total

#: Every rampart_* family docs/observability.md and the dashboard promise (name as the parser reports it).
RAMPART_FAMILIES = {
    "rampart_queue_depth", "rampart_inflight_batches", "rampart_admitted", "rampart_rejected", "rampart_responses",
    "rampart_ttl_dropped", "rampart_fallback", "rampart_degraded", "rampart_circuit_breaker_state",
    "rampart_stage_duration_seconds", "rampart_batch_size", "rampart_input_megapixels", "rampart_top1_confidence",
    "rampart_top1_class", "rampart_process_resident_memory_bytes", "rampart_event_loop_lag_seconds",
    "rampart_gc_pause_seconds", "rampart_access_log_dropped",
}


def families(samples: dict) -> set[str]:
    names = set()
    for name in samples:
        names.add(re.sub(r"_(total|created|bucket|count|sum)$", "", name))
    return names


def test_metrics_exist_and_move_under_load(server):
    before = scrape(server)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name in sorted(PHOTOS):
            assert client.post("/classify", content=encode(photo(name))).status_code == 200
        assert client.post("/classify", content=b"not an image").status_code == 415
    after = scrape(server)
    missing = {f for f in RAMPART_FAMILIES if f not in families(after)}
    assert not missing, f"metrics missing from /metrics: {missing}"
    assert "bentoml_service_request_total" in after or "bentoml_service_request_in_progress" in after  # BentoML's own stay

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("rampart_responses_total", status="200", code="ok") >= len(PHOTOS)
    assert grew("rampart_responses_total", status="415", code="unsupported_format") >= 1
    assert grew("rampart_admitted_total", model="primary") >= len(PHOTOS)
    assert grew("rampart_stage_duration_seconds_count", model="primary", stage="total") >= len(PHOTOS)
    assert grew("rampart_batch_size_count", model="primary") >= 1  # written by the runner process
    assert grew("rampart_input_megapixels_count") >= len(PHOTOS)
    assert grew("rampart_top1_confidence_count", model="primary") >= len(PHOTOS)
    assert grew("rampart_top1_class_total", model="primary") >= len(PHOTOS)
    assert total(after, "rampart_process_resident_memory_bytes") > 0


def test_request_id_server_timing_and_one_json_log_line(server):
    response = httpx.post(f"{server.url}/classify", content=encode(photo("coffee")),
                          headers={"X-Request-Id": "obs-test-1"}, timeout=30)
    assert response.status_code == 200 and response.headers["X-Request-Id"] == "obs-test-1"
    timing = server_timing(response)
    assert set(timing) == {"before_handler", "decode", "queue", "inference", "total"}
    assert timing["total"] >= timing["inference"] > 0

    lines = logged_lines(server, '"obs-test-1"')
    assert len(lines) == 1, lines
    entry = json.loads(lines[0])
    assert entry["status"] == 200 and entry["code"] == "ok" and entry["path"] == "/classify"
    assert entry["bucket"] == response.json()["bucket"] and entry["model"] == "rampart-primary"
    assert set(entry["timings_ms"]) == {"before_handler", "decode", "queue", "inference", "total"}

    bad = httpx.post(f"{server.url}/classify", content=b"", headers={"X-Request-Id": "obs-test-2"}, timeout=30)
    assert bad.status_code == 400
    (bad_line,) = logged_lines(server, '"obs-test-2"')
    assert json.loads(bad_line)["code"] == "empty_body"


def test_one_log_line_per_request(server):
    """The default server writes Rampart's JSON access line per request and nothing else (no runner access lines)."""
    requests = 12
    before = len(server.log_path.read_text(errors="replace").splitlines())
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for i in range(requests):
            name = sorted(PHOTOS)[i % len(PHOTOS)]
            response = client.post("/classify", content=encode(photo(name)), headers={"X-Request-Id": f"obs-count-{i}"})
            assert response.status_code == 200
        # /stats calls both runners (its copy of their counters is older than STATS_RUNNER_REFRESH_MS, 500 ms, after
        # 12 requests): once it answers, their lines for the batches before it are written.
        assert client.get("/stats").status_code == 200
    logged_lines(server, '"obs-count-', count=requests)
    new = server.log_path.read_text(errors="replace").splitlines()[before:]
    ours = [line for line in new if '"obs-count-' in line]
    assert len(ours) == requests, ours
    assert all(json.loads(line)["path"] == "/classify" for line in ours)
    others = [line for line in new if '"obs-count-' not in line]
    assert len(others) <= 2, others[:6]  # a runner access line per call would be one more line per request


#: Metrics a server has only in one mode (routing cascade, a shadow model): the dashboard's are checked on
#: those servers (tests/server/test_cascade.py, test_shadow.py), not on the default one.
MODE_ONLY_PREFIXES = ("rampart_cascade_", "rampart_shadow_")


def test_every_metric_the_grafana_dashboard_queries_exists(server):
    queried = {name for name in dashboard_metrics() if not name.startswith(MODE_ONLY_PREFIXES)}
    assert len(queried) >= 15
    assert {"rampart_gpu_memory_used_bytes", "rampart_gpu_memory_total_bytes"} <= queried
    missing = missing_metrics(server, queried)
    assert not missing, f"the dashboard queries metrics that /metrics lacks: {missing}"


def test_stats_shows_the_cores_each_process_runs_on(server):
    """``rampart.cores`` on a real server, as each process reports it: under the default placement (``weight``)
    nothing is pinned and every process may run on every usable core; under ``reserve`` (the plan, when one
    applies) a CPU-only 2-core host puts the primary on one core and the API worker, its decoders and the
    fallback on the other. The reserved plan's pinning itself is checked in tests/unit/test_cores.py."""
    from bench.process_cpu import server_processes
    from rampart.config import Settings
    from rampart.cores import host_core_plan, usable_cores

    stats = httpx.get(f"{server.url}/stats", timeout=30).json()
    seen = {"api": stats["api_worker"]["cores"], "primary": stats["primary"]["runner"]["cores"],
            "fallback": stats["fallback"]["runner"]["cores"]}
    plan = host_core_plan(Settings())
    if plan is None:  # a GPU host, one core, or a CPU quota: no pinning
        assert seen == dict.fromkeys(seen, usable_cores()), seen
    else:
        assert seen == {"api": list(plan.others), "primary": list(plan.primary), "fallback": list(plan.others)}, seen
        assert not set(plan.primary) & set(plan.others)
        decoders = [process for role, process in server_processes(server.pid).values() if role == "decode"]
        assert decoders and all(process.cpu_affinity() == list(plan.others) for process in decoders)



def test_each_process_runs_at_its_niceness_and_each_runner_lowers_its_own_session(server):
    """The default server's processes: the API worker and the primary at niceness 0, the fallback 19, each thread,
    and the decode workers 5. Where the kernel's autogroup is on, a runner above 0 (the fallback), a session of
    its own under BentoML's process manager, has lowered its session's group as well, so that its niceness
    counts against the other workers; the API worker's session, which its decoders share, stays at 0
    (``rampart.cores.lower_cpu_priority``)."""
    from bench.process_cpu import server_processes
    from rampart.cores import autogroup

    processes = [(role, process) for role, process in server_processes(server.pid).values()]
    expected = {"api": 0, "primary": 0, "fallback": 19}
    for role, process in processes:
        if role in expected:
            assert {psutil.Process(thread.id).nice() for thread in process.threads()} == {expected[role]}, role
    decoders = [process for role, process in processes if role == "decode"]
    assert any(process.nice() == 5 for process in decoders), [process.nice() for process in decoders]
    if autogroup() is None:
        return
    groups = {role: autogroup(process.pid) for role, process in processes if role in expected}
    assert {role: nice for role, (_, nice) in groups.items()} == expected, groups
    assert len({name for name, _ in groups.values()}) == 3, groups  # one session each
    assert {autogroup(process.pid) for process in decoders} == {groups["api"]}, groups


def test_the_primary_gives_its_heap_back_once_when_it_goes_idle_after_batches(server):
    """``RAMPART_RUNNER_HEAP_TRIM_IDLE_S`` (2 s by default): after a burst of requests the primary runner trims its
    C heap once (``rampart.heap.IdleTrim``), and not again while it stays idle."""
    import time

    from rampart.config import Settings

    idle_s = Settings().runners.heap_trim_idle_s

    def trims() -> int:
        return httpx.get(f"{server.url}/stats", timeout=30).json()["primary"]["runner"]["heap_trims"]

    time.sleep(1.5 * idle_s)  # whatever an earlier test sent has been trimmed
    before = trims()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name in sorted(PHOTOS) * 3:
            assert client.post("/classify", content=encode(photo(name))).status_code == 200
    deadline = time.monotonic() + 5 * idle_s
    while trims() == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert trims() == before + 1
    time.sleep(2 * idle_s)
    assert trims() == before + 1
