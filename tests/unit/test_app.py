"""``rampart.api.app``, the HTTP layer in-process: ``create_app`` through Starlette's ``TestClient``, no server.

The app gets a real ``rampart.pipeline.Pipeline`` on a thread decode pool, whose
two models are stand-ins (``StandIn``): they answer fixed probabilities, or raise,
hang, or drop the item as expired, to inject each fault on purpose (the ``rig`` and
``make_rig`` fixtures of tests/unit/conftest.py, built by ``tests.unit.standins.open_rig``). Every 4xx the
HTTP layer maps and every ``degraded_reason`` the pipeline emits is reached here.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import pytest
from PIL import Image
from starlette.testclient import TestClient

from rampart.api.app import attach, create_app, state_of
from rampart.config import Settings
from tests.support import encode, photo
from tests.unit.standins import CAT, COFFEE, fill

def error_of(response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def png(size: tuple[int, int]) -> bytes:
    return encode(Image.new("RGB", size, "gray"), "PNG")


def two_frame_gif() -> bytes:
    frames = [Image.new("RGB", (64, 64), colour) for colour in ("red", "blue")]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


# --- full and degraded answers ------------------------------------------------------------------


def test_a_full_answer_has_the_primary_labels_timings_and_request_id(rig):
    response = rig.client.post("/classify?top_k=3", content=CAT, headers={"X-Request-Id": "abc-1"})
    body = response.json()
    assert response.status_code == 200 and body["request_id"] == "abc-1" == response.headers["x-request-id"]
    assert [entry["index"] for entry in body["labels"]][:1] == [281] and len(body["labels"]) == 3
    assert body["degraded"] is False and body["degraded_reason"] is None and body["model"]["name"] == "rampart-primary"
    assert list(body["timings_ms"]) == ["before_handler", "decode", "queue", "inference", "total"]
    assert response.headers["server-timing"].startswith("before_handler;dur=")


def test_multipart_field_image_is_classified_like_a_raw_body(rig):
    response = rig.client.post("/classify", files={"image": ("cat.jpg", CAT, "image/jpeg")})
    assert response.status_code == 200 and response.json()["labels"][0]["index"] == 281


def test_a_deadline_used_up_before_the_handler_is_a_429_whose_cause_is_the_deadline(rig):
    """Accepted (above the minimum), but a load balancer's X-Request-Start shows it waited 0.5 s of its 100 ms."""
    stamp = f"t={time.time() - 0.5:.3f}"
    used_up = rig.client.post("/classify", content=CAT, headers={"X-Deadline-Ms": "100", "X-Request-Start": stamp})
    assert error_of(used_up) == (429, "overloaded") and used_up.json()["error"]["cause"] == "deadline"
    assert int(used_up.headers["retry-after"]) >= 1
    fresh = rig.client.post("/classify", content=CAT, headers={"X-Deadline-Ms": "100"})
    assert fresh.status_code == 200 and fresh.json()["degraded_reason"] == "primary_timeout"


def test_top_k_may_come_as_a_multipart_field_as_bentoml_s_client_sends_it(rig):
    image = {"image": ("cat.jpg", CAT, "image/jpeg")}
    assert len(rig.client.post("/classify", files=image, data={"top_k": "2"}).json()["labels"]) == 2
    batch = rig.client.post("/classify_batch", files=[("images", ("cat.jpg", CAT))] * 2, data={"top_k": "3"}).json()
    assert [len(entry["labels"]) for entry in batch["results"]] == [3, 3]
    for data, query in (({"top_k": "2"}, "?top_k=2"), ({"top_k": "0"}, ""), ({"top_k": "7" * 65}, "")):
        response = rig.client.post(f"/classify{query}", files=image, data=data)
        assert error_of(response) == (422, "invalid_parameter"), response.json()


@pytest.mark.parametrize("mode, reason", [("error", "primary_error"), ("hang", "primary_timeout"),
                                          ("expired", "primary_timeout")])
def test_a_failing_primary_hands_over_to_the_fallback(rig, mode, reason):
    rig.primary.mode = mode
    response = rig.client.post("/classify", content=CAT, headers={"X-Deadline-Ms": "600"})
    body = response.json()
    assert response.status_code == 200 and body["degraded_reason"] == reason and body["degraded"] is True
    assert body["model"]["name"] == "rampart-fallback" and body["labels"][0]["index"] == 967


def test_a_full_primary_gate_is_primary_overloaded(rig):
    tickets = fill(rig.pipeline.primary.gate)
    response = rig.client.post("/classify", content=CAT)
    for ticket in tickets:
        ticket.cancel()
    assert response.json()["degraded_reason"] == "primary_overloaded" and rig.primary.calls == 0


def test_an_open_breaker_is_primary_circuit_open(make_rig):
    rig = make_rig(breaker_min_calls=2)
    rig.primary.mode = "error"
    reasons = [rig.client.post("/classify", content=CAT).json()["degraded_reason"] for _ in range(3)]
    assert reasons == ["primary_error", "primary_error", "primary_circuit_open"] and rig.primary.calls == 2


def test_no_model_then_the_cache_then_nothing(rig):
    assert rig.client.post("/classify", content=CAT).json()["degraded_reason"] is None  # cached now
    rig.primary.mode = rig.fallback.mode = "error"
    cached = rig.client.post("/classify", content=CAT).json()
    assert cached["degraded_reason"] == "cached_result" and cached["labels"][0]["index"] == 281
    nothing = rig.client.post("/classify", content=COFFEE).json()
    assert nothing["degraded_reason"] == "no_model_available" and nothing["labels"] == [] and nothing["model"] is None
    assert nothing["needs_review"] is True


def test_a_decode_that_outlives_the_deadline_is_deadline_exceeded(make_rig, tmp_path):
    fault = tmp_path / "fault.json"
    fault.write_text(json.dumps({"fault_decode_hang": True}))
    rig = make_rig(fault_file=str(fault))
    try:
        body = rig.client.post("/classify", content=CAT, headers={"X-Deadline-Ms": "300"}).json()
    finally:
        fault.write_text("{}")  # the hung decode threads end
    assert body["degraded_reason"] == "deadline_exceeded" and body["labels"] == [] and body["needs_review"] is True


# --- errors: parameters, body, image ------------------------------------------------------------


@pytest.mark.parametrize("query, headers", [
    ("top_k=0", {}), ("top_k=21", {}), ("top_k=five", {}),
    ("", {"X-Deadline-Ms": "soon"}), ("", {"X-Deadline-Ms": "-5"}), ("", {"X-Deadline-Ms": "inf"}),
    ("", {"X-Priority": "urgent"}),
])
def test_bad_parameters_are_422_invalid_parameter(rig, query, headers):
    response = rig.client.post(f"/classify?{query}", content=CAT, headers=headers)
    assert error_of(response) == (422, "invalid_parameter")
    assert response.json()["error"]["request_id"] == response.headers["x-request-id"]


@pytest.mark.parametrize("raw", ["1", "20", "49.9"])
def test_a_deadline_below_the_minimum_is_422_deadline_too_short(rig, raw):
    response = rig.client.post("/classify", content=CAT, headers={"X-Deadline-Ms": raw})
    assert error_of(response) == (422, "deadline_too_short")
    assert "minimum deadline of 50 ms" in response.json()["error"]["message"]


@pytest.mark.parametrize("content_type, body", [
    ("multipart/form-data", b"--x\r\n"),  # no boundary parameter
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\nab"),  # cut off
])
def test_malformed_multipart_is_422_invalid_parameter(rig, content_type, body):
    response = rig.client.post("/classify", content=body, headers={"Content-Type": content_type})
    assert error_of(response) == (422, "invalid_parameter")


@pytest.mark.parametrize("data, settings, expected", [
    (b"", {}, (400, "empty_body")),
    (CAT[:9000], {}, (400, "corrupt_image")),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, {}, (400, "undecodable_image")),
    (b"GET / HTTP/1.1\r\n", {}, (415, "unsupported_format")),
    (CAT, {"max_body_bytes": 10_000}, (413, "payload_too_large")),
    (CAT, {"max_pixels": 10_000}, (413, "image_too_large")),
    (png((8, 8)), {}, (422, "image_too_small")),
    (png((3000, 20)), {}, (422, "aspect_ratio_out_of_range")),
    (two_frame_gif(), {"max_frames": 1}, (422, "too_many_frames")),
    (encode(photo("coffee"), progressive=True), {"max_jpeg_scans": 1}, (422, "decode_cost_too_high")),
])
def test_bad_images_get_their_status_and_code(make_rig, data, settings, expected):
    rig = make_rig(**settings)
    assert error_of(rig.client.post("/classify", content=data)) == expected


def test_a_decode_past_its_limit_is_422_decode_timeout(make_rig, tmp_path):
    fault = tmp_path / "fault.json"
    fault.write_text(json.dumps({"fault_decode_hang": True}))
    rig = make_rig(fault_file=str(fault), decode_timeout_ms=100)
    try:
        response = rig.client.post("/classify", content=CAT, headers={"X-Deadline-Ms": "5000"})
    finally:
        fault.write_text("{}")
    assert error_of(response) == (422, "decode_timeout")


def test_multipart_limits_are_413(rig):
    two = [("image", ("a.jpg", CAT)), ("image", ("b.jpg", CAT))]
    assert error_of(rig.client.post("/classify", files=two)) == (413, "too_many_parts")
    headers = "".join(f"X-{i}: y\r\n" for i in range(20))
    body = (f"--x\r\nContent-Disposition: form-data; name=\"image\"\r\n{headers}\r\n").encode() + CAT + b"\r\n--x--\r\n"
    response = rig.client.post("/classify", content=body, headers={"Content-Type": "multipart/form-data; boundary=x"})
    assert error_of(response) == (413, "part_headers_too_large")
    other = rig.client.post("/classify", files={"photo": ("a.jpg", CAT)})
    assert error_of(other) == (400, "empty_body")


async def post_slowly(app, receive) -> tuple[int, dict]:
    """POST /classify straight through ASGI, the body coming from ``receive``; (status, JSON body)."""
    scope = {"type": "http", "method": "POST", "path": "/classify", "raw_path": b"/classify", "query_string": b"",
             "headers": [(b"x-deadline-ms", b"200")], "http_version": "1.1", "scheme": "http",
             "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    sent = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_body_slower_than_the_deadline_is_408_and_a_hang_up_is_499(rig):
    app = rig.client.app.app

    async def trickle() -> dict:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"\xff", "more_body": True}

    async def hang_up() -> dict:
        return {"type": "http.disconnect"}

    status, body = asyncio.run(post_slowly(app, trickle))
    assert (status, body["error"]["code"]) == (408, "request_timeout")
    status, body = asyncio.run(post_slowly(app, hang_up))
    assert (status, body["error"]["code"]) == (499, "client_disconnected")


# --- errors: capacity and lifecycle -------------------------------------------------------------


def test_both_gates_full_is_429_overloaded_with_retry_after(rig):
    tickets = fill(rig.pipeline.primary.gate) + fill(rig.pipeline.fallback.gate)
    responses = [rig.client.post(path, files={field: ("a.jpg", CAT)})
                 for path, field in (("/classify", "image"), ("/classify_batch", "images"))]
    for ticket in tickets:
        ticket.cancel()
    for response in responses:
        assert error_of(response) == (429, "overloaded") and int(response.headers["retry-after"]) >= 1
    assert rig.primary.calls == rig.fallback.calls == 0


def test_not_ready_and_shutting_down_are_503_with_retry_after(make_rig):
    rig = make_rig(ready=False)
    for path in ("/classify", "/classify_batch"):
        response = rig.client.post(path, content=CAT)
        assert error_of(response) == (503, "not_ready") and response.headers["retry-after"] == "1"
    rig.lifecycle.mark_ready()
    rig.lifecycle.begin_drain()
    response = rig.client.post("/classify", content=CAT)
    assert error_of(response) == (503, "shutting_down") and response.headers["retry-after"] == "1"
    assert rig.lifecycle.in_flight == 0


def test_an_app_without_attached_parts_admits_nothing():
    app = create_app(Settings(decode_mode="threads"))
    with TestClient(app) as client:
        assert error_of(client.post("/classify", content=CAT)) == (503, "not_ready")
    assert not state_of(app).ready()


def test_unknown_paths_and_methods_are_json_404_and_405(rig):
    assert error_of(rig.client.get("/nowhere")) == (404, "not_found")
    response = rig.client.get("/classify")
    assert error_of(response) == (405, "method_not_allowed") and response.headers["allow"] == "POST"


def test_rampart_s_own_fault_is_500_internal_error(rig):
    rig.primary.mode = "garbage"
    assert error_of(rig.client.post("/classify", content=CAT)) == (500, "internal_error")


# --- /classify_batch, /stats, /v2 ---------------------------------------------------------------


def test_batch_entries_carry_results_or_their_own_status(rig):
    files = [("images", ("cat.jpg", CAT)), ("images", ("text.txt", b"plain text")),
             ("images", ("tiny.png", png((8, 8))))]
    response = rig.client.post("/classify_batch?top_k=2", files=files)
    results = response.json()["results"]
    assert response.status_code == 200 and [entry["index"] for entry in results] == [0, 1, 2]
    assert results[0]["filename"] == "cat.jpg" and len(results[0]["labels"]) == 2 and "status" not in results[0]
    assert [(entry["status"], entry["error"]["code"]) for entry in results[1:]] == [
        (415, "unsupported_format"), (422, "image_too_small")]
    assert "total;dur=" in response.headers["server-timing"]


def test_a_batch_image_hitting_rampart_s_own_fault_is_status_500(rig):
    rig.primary.mode = "garbage"
    (entry,) = rig.client.post("/classify_batch", files=[("images", ("cat.jpg", CAT))]).json()["results"]
    assert (entry["status"], entry["error"]["code"]) == (500, "internal_error")


def test_batch_needs_multipart(rig):
    assert error_of(rig.client.post("/classify_batch", content=CAT)) == (422, "invalid_parameter")


def test_stats_show_gates_lifecycle_and_runner_counters(rig):
    async def counters(role: str) -> dict:
        return {"role": role}

    attach(rig.client.app.app, runner_stats=counters)
    body = rig.client.get("/stats").json()
    assert body["lifecycle"] == {"state": "ready", "in_flight": 0}
    assert body["primary"]["runner"] == {"role": "primary"} and body["fallback"]["runner"] == {"role": "fallback"}
    assert body["primary"]["model"]["name"] == "rampart-primary"


def test_open_inference_protocol_routes_use_the_app_state(rig):
    assert rig.client.get("/v2/health/ready").json() == {"ready": True}
    image = {"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(CAT).decode()]}
    response = rig.client.post("/v2/models/rampart/infer", json={"inputs": [image]})
    assert response.status_code == 200, response.text
    rig.lifecycle.begin_drain()
    assert rig.client.get("/v2/health/ready").status_code == 503
    assert rig.client.post("/v2/models/rampart/infer", json={"inputs": [image]}).status_code == 503


def test_x_priority_low_is_answered_by_the_primary_and_counted_apart_in_stats_and_metrics(rig):
    response = rig.client.post("/classify", content=CAT, headers={"X-Priority": "low"})
    assert response.status_code == 200, response.text
    assert response.json()["route"] == "low_priority" and response.json()["model"]["name"] == "rampart-primary"
    stats = rig.client.get("/stats").json()
    assert stats["priority"]["low"]["primary"] == 1 and stats["priority"]["normal"]["primary"] == 0
    assert stats["primary"]["queued_by_priority"] == {"high": 0, "normal": 0, "low": 0}
    from prometheus_client import REGISTRY  # /metrics is BentoML's; in-process the counters are the registry's
    assert REGISTRY.get_sample_value("rampart_priority_outcomes_total", {"priority": "low", "outcome": "primary"}) >= 1
