"""``bench.knee_budget``, ``bench.ramp`` and ``bench.cpu_budget``: the load benchmark's primary-path knee, knee ratios
and CPU-budget stage rules."""

from __future__ import annotations

from bench.cpu_budget import STAGES, stage_of
from bench.knee_budget import knee_ratios
from bench.ramp import primary_knee


def step(clients: int, throughput: float, full: float, p99: float, errors: float = 0.0) -> dict:
    return {"clients": clients, "throughput_rps": throughput, "full_rps": full, "p99_ms": p99, "error_rate": errors,
            "degraded_rate": round(1 - full / throughput, 4)}


def test_primary_knee_counts_full_answers_only_within_the_slo():
    steps = [step(4, 30.0, 30.0, 300.0), step(16, 45.0, 20.0, 800.0),  # more answers, fewer from the primary
             step(32, 50.0, 40.0, 1200.0),  # past the SLO
             step(8, 38.0, 36.0, 500.0, errors=0.02)]  # too many refused
    assert primary_knee(steps)["clients"] == 4


def test_knee_ratios_divide_rampart_by_the_best_raw_batch_and_every_baseline_that_ran():
    results = {"raw_ceiling_ips": {"primary": {"1": 30.0, "4": 60.0, "8": 50.0}, "fallback": {"1": 200.0}},
               "rampart": {"ramp": {"primary_knee": step(16, 55.0, 51.0, 900.0)}},
               "naive": {"ramp": {"knee": step(32, 51.0, 51.0, 950.0)}}}
    ratios = knee_ratios(results)
    assert set(ratios) == {"raw_ceiling", "naive"}  # plain_bentoml did not run
    assert ratios["raw_ceiling"]["ratio"] == 0.85 and ratios["raw_ceiling"]["best_batch"] == 4
    assert ratios["naive"]["ratio"] == 1.0


API = "thread (1): MainThread;<module> (_bentoml_impl/worker/service.py:243);Server.run (uvicorn/server.py:86)"


def frames(stack: str) -> list[str]:
    return stack.split(";")[1:]


def test_stage_rules_take_the_innermost_matching_frame_and_drop_waits():
    metrics_middleware = "RunnerTrafficMetricsMiddleware.__call__ (bentoml/_internal/server/http/instruments.py:120)"
    runner_call = (f"{API};{metrics_middleware};classify (rampart/api/app.py:240);"
                   "model_endpoint.<locals>.call (service.py:75);AsyncClient.send (httpx/_client.py:1600)")
    assert stage_of("api", frames(runner_call)) == "runner call (API side, serialisation)"
    answer = f"{API};{metrics_middleware};classify (rampart/api/app.py:240);JSONEncoder.iterencode (json/encoder.py:200)"
    assert stage_of("api", frames(answer)) == "JSON answer"
    assert stage_of("api", frames(f"{API};{metrics_middleware}")) == "logging and metrics"  # the middleware's own work
    assert stage_of("api", frames(f"{API};Runner.run (asyncio/runners.py:118)")) is None  # the loop waiting
    resize = "t;_serve (rampart/inputs/pool.py:300);prepare (rampart/inputs/decode_job.py:70);fit_to_bucket " \
             "(rampart/inputs/buckets.py:80);Image.resize (PIL/Image.py:2300)"
    assert stage_of("decode", frames(resize)) == "resize"
    assert all(stage in STAGES for stage in ("model", "decode", "resize", "body read", "admission"))
