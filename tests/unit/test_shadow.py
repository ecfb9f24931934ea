"""``rampart.shadow``, shadow traffic in process: sampling, idle-only mirroring, bounds, failures, agreement.

The candidate is a stand-in ``ModelEndpoint`` whose call is a coroutine, so each case
(slow, failing, busy) is exact; the server tests (tests/server/test_shadow.py) run the real runner.
"""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
from PIL import Image
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from rampart.inputs.buckets import buckets_for_resolution, choose_bucket, fit_to_bucket
from rampart.pipeline import ModelEndpoint, RunnerResult
from rampart.shadow import AnsweredBody, ShadowMirror, agreement, shadow_input
from tests.support import photo

LABELS = [f"class{i}" for i in range(10)]


def inputs_of(image: np.ndarray) -> dict:
    """``Prepared.inputs`` for a 260 px primary and a 224 px fallback, as the decode worker makes them."""
    pil = Image.fromarray(image)
    out = {}
    for role, resolution in (("primary", 260), ("fallback", 224)):
        bucket = choose_bucket(*pil.size, buckets_for_resolution(resolution))
        out[role] = (bucket, fit_to_bucket(pil, bucket, 1.14))
    return out


CHELSEA_INPUTS = inputs_of(photo("chelsea"))


def answered(top: list[int], role: str = "primary") -> AnsweredBody:
    return AnsweredBody({"labels": [], "model": {"name": "m"}}, role, CHELSEA_INPUTS, LABELS, np.array(top))


def candidate(resolution: int, behaviour) -> ModelEndpoint:
    async def call(bucket_name, pixels, deadline):
        return await behaviour(bucket_name, pixels, deadline)

    return ModelEndpoint("cand", "v1", LABELS, buckets_for_resolution(resolution), call)


def probs_for(top: list[int]) -> np.ndarray:
    probs = np.zeros(len(LABELS), np.float32)
    probs[top] = np.linspace(0.9, 0.5, len(top))
    return probs


def test_agreement_by_class_name():
    assert agreement(["a", "b", "c", "d", "e"], ["a", "x", "c", "y", "e"]) == (True, 0.6)
    assert agreement(["a", "b"], ["b", "a"]) == (False, 0.4)
    with pytest.raises(ValueError):
        agreement([], ["a"])


def test_shadow_input_reuses_or_resizes_the_decoded_pixels():
    inputs = inputs_of(photo("chelsea"))  # 451×300: landscape
    bucket, pixels = shadow_input(inputs, buckets_for_resolution(224))
    assert pixels is inputs["fallback"][1] and bucket.name == "landscape"  # same shape: the very same array
    bucket, pixels = shadow_input(inputs, buckets_for_resolution(260))
    assert pixels is inputs["primary"][1]
    bucket, pixels = shadow_input(inputs, buckets_for_resolution(192))
    assert pixels.shape == (192, 256, 3) and pixels.dtype == np.uint8
    # A resize of the primary's crop, not another picture: close to fitting the photo directly.
    direct = fit_to_bucket(Image.fromarray(photo("chelsea")), bucket, 1.14).astype(float)
    assert np.abs(pixels.astype(float) - direct).mean() < 8


def run_mirror(mirror: ShadowMirror, results: list[tuple[str, dict]], busy_each: float = 0.0) -> None:
    async def go():
        for request_id, result in results:
            task = mirror.background(request_id, result)
            if task is not None:
                await task()
            await asyncio.sleep(busy_each)
        while mirror._tasks:
            await asyncio.sleep(0.01)

    asyncio.run(go())


def test_agreement_and_latency_are_recorded_and_disagreements_logged(caplog):
    seen = []

    async def healthy(bucket_name, pixels, deadline):
        seen.append((bucket_name, pixels.shape))
        return RunnerResult(probs_for([1, 2, 3, 4, 5]), 1.0, 1)

    mirror = ShadowMirror(candidate(224, healthy), 1.0, 500, 2, busy=lambda: False)
    with caplog.at_level("INFO", "rampart.shadow"):
        run_mirror(mirror, [("agree", answered([1, 2, 3, 4, 5])), ("differ", answered([9, 2, 3, 8, 7], "fallback")),
                            ("cached", {"labels": []})])  # a plain dict (cached/static answer) is never mirrored
    state = mirror.state()
    assert (state["sampled"], state["mirrored"], state["compared"]) == (2, 2, 2)
    assert state["top1_agreement"] == 0.5 and state["top5_overlap_mean"] == pytest.approx((1.0 + 0.4) / 2)
    assert state["latency_ms"]["p99"] >= state["latency_ms"]["p50"] > 0
    assert seen == [("landscape", (224, 298, 3))] * 2
    lines = [r.getMessage() for r in caplog.records if "disagreement" in r.getMessage()]
    assert len(lines) == 1 and "request differ" in lines[0] and "'class9'" in lines[0], lines


def test_rate_samples_a_share():
    async def healthy(bucket_name, pixels, deadline):
        return RunnerResult(probs_for([1]), 1.0, 1)

    mirror = ShadowMirror(candidate(224, healthy), 0.1, 500, 2, busy=lambda: False, rng=random.Random(7))
    picked = sum(mirror.background(str(i), answered([1])) is not None for i in range(2000))
    assert 150 < picked < 250 and mirror.sampled == picked


def test_busy_models_and_the_inflight_bound_skip_the_mirror():
    calls = []

    async def slow(bucket_name, pixels, deadline):
        calls.append(bucket_name)
        await asyncio.sleep(0.2)
        return RunnerResult(probs_for([1]), 1.0, 1)

    busy = {"now": True}
    mirror = ShadowMirror(candidate(224, slow), 1.0, 1000, 2, busy=lambda: busy["now"])
    run_mirror(mirror, [(str(i), answered([1])) for i in range(3)])
    assert mirror.state()["skipped_busy"] == 3 and not calls  # real traffic queued: nothing mirrored

    busy["now"] = False
    run_mirror(mirror, [(str(i), answered([1])) for i in range(5)])  # back to back: two fit the bound
    state = mirror.state()
    assert (state["mirrored"], state["skipped_busy"], state["compared"]) == (2, 6, 2) and len(calls) == 2
    assert state["in_flight"] == 0


def test_errors_and_timeouts_are_counted_and_hold_the_slot_until_the_runner_replies():
    async def failing(bucket_name, pixels, deadline):
        raise RuntimeError("candidate broke")

    mirror = ShadowMirror(candidate(224, failing), 1.0, 500, 2, busy=lambda: False)
    run_mirror(mirror, [("a", answered([1])), ("b", answered([1]))], busy_each=0.01)
    assert mirror.state()["failed"] == {"error": 2, "timeout": 0} and mirror.in_flight == 0

    async def hung(bucket_name, pixels, deadline):
        await asyncio.sleep(0.3)  # replies, but after the 100 ms shadow deadline
        return RunnerResult(probs_for([1]), 1.0, 1)

    mirror = ShadowMirror(candidate(224, hung), 1.0, 100, 1, busy=lambda: False)

    async def go():
        await mirror.background("a", answered([1]))()
        await asyncio.sleep(0.15)  # the mirror gave up at 100 ms; the runner still has the item
        assert mirror.state()["failed"]["timeout"] == 1 and mirror.in_flight == 1
        await mirror.background("b", answered([1]))()
        assert mirror.state()["skipped_busy"] == 1  # the bound counts the runner's work, not the waiting
        await asyncio.sleep(0.25)
        assert mirror.in_flight == 0

    asyncio.run(go())


def test_not_ready_runner_is_skipped_until_it_answers_ready():
    answers = iter([False, False, True])

    async def ready(timeout):
        return next(answers)

    async def healthy(bucket_name, pixels, deadline):
        return RunnerResult(probs_for([1]), 1.0, 1)

    mirror = ShadowMirror(candidate(224, healthy), 1.0, 500, 2, busy=lambda: False, ready_check=ready)

    async def go():
        await mirror.background("a", answered([1]))()
        assert mirror.state()["skipped_not_ready"] == 1
        while not mirror.ready:
            await asyncio.sleep(0.05)
        await mirror.background("b", answered([1]))()
        while mirror._tasks:
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert mirror.state()["compared"] == 1


def test_the_mirror_runs_after_the_response_is_sent():
    """Through Starlette: the whole response has gone out before the candidate is called."""
    order = []

    async def healthy(bucket_name, pixels, deadline):
        order.append("candidate called")
        return RunnerResult(probs_for([1]), 1.0, 1)

    mirror = ShadowMirror(candidate(224, healthy), 1.0, 500, 2, busy=lambda: False)

    async def classify(request):
        result = answered([1])
        response = JSONResponse(dict(result))
        response.background = mirror.background("r1", result)
        return response

    app = Starlette(routes=[Route("/classify", classify, methods=["POST"])])

    async def recording(scope, receive, send):
        async def sending(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                order.append("response sent")

        await app(scope, receive, sending)

    with TestClient(recording) as client:
        response = client.post("/classify")
        assert response.status_code == 200 and response.json() == {"labels": [], "model": {"name": "m"}}
        for _ in range(100):
            if mirror.state()["compared"]:
                break
            time.sleep(0.01)
    assert order == ["response sent", "candidate called"] and mirror.state()["compared"] == 1


def test_any_sign_of_overload_pauses_mirroring():
    """A 429 (``note_overload``) or an answer the primary shed to the fallback pauses mirrors for a while,
    even when the gates look idle at that instant."""
    async def healthy(bucket_name, pixels, deadline):
        return RunnerResult(probs_for([1]), 1.0, 1)

    mirror = ShadowMirror(candidate(224, healthy), 1.0, 500, 2, busy=lambda: False)
    shed_to_fallback = answered([1], "fallback")
    shed_to_fallback["degraded_reason"] = "primary_overloaded"
    run_mirror(mirror, [("a", shed_to_fallback), ("b", answered([1]))])
    assert mirror.state()["skipped_busy"] == 2 and mirror.state()["mirrored"] == 0

    mirror = ShadowMirror(candidate(224, healthy), 1.0, 500, 2, busy=lambda: False)
    mirror.note_overload()
    run_mirror(mirror, [("a", answered([1]))])
    assert mirror.state()["skipped_busy"] == 1
    mirror.overloaded_at -= 1.0  # the quiet period is over
    run_mirror(mirror, [("b", answered([1]))])
    assert mirror.state()["compared"] == 1
