"""The HTTP API on a real server: real photos, parameters, errors, batch."""

from __future__ import annotations

import pytest

from tests.support import PHOTOS, encode, photo


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_raw_body_photo_is_classified(http, name):
    response = http.post("/classify", content=encode(photo(name)), params={"top_k": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert {label["index"] for label in body["labels"][:3]} & PHOTOS[name], body["labels"]
    scores = [label["score"] for label in body["labels"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 5
    assert body["degraded"] is False and body["degraded_reason"] is None
    assert body["model"]["name"] == "rampart-primary"
    assert set(body["timings_ms"]) == {"before_handler", "decode", "queue", "inference", "total"}


def test_content_type_header_is_ignored(http):
    png = encode(photo("coffee"), "PNG")
    response = http.post("/classify", content=png, headers={"Content-Type": "image/jpeg"})
    assert response.status_code == 200
    assert {label["index"] for label in response.json()["labels"][:3]} & PHOTOS["coffee"]


def test_multipart_field_image_without_content_type(http):
    jpeg = encode(photo("chelsea"))
    response = http.post("/classify", files={"image": ("cat.jpg", jpeg)}, params={"top_k": 3})
    assert response.status_code == 200, response.text
    assert {label["index"] for label in response.json()["labels"]} & PHOTOS["chelsea"]


@pytest.mark.parametrize("top_k", ["0", "21", "-1", "abc", "2.5"])
def test_top_k_out_of_range_is_422(http, top_k):
    response = http.post("/classify", content=encode(photo("chelsea")), params={"top_k": top_k})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_parameter" and "top_k" in error["message"]


@pytest.mark.parametrize("top_k", [1, 20])
def test_top_k_bounds_are_accepted(http, top_k):
    response = http.post("/classify", content=encode(photo("chelsea")), params={"top_k": top_k})
    assert response.status_code == 200 and len(response.json()["labels"]) == top_k


@pytest.mark.parametrize("deadline", ["0", "-5", "soon", "nan", "inf", "1_000"])
def test_bad_deadline_header_is_422(http, deadline):
    response = http.post("/classify", content=encode(photo("chelsea")), headers={"X-Deadline-Ms": deadline})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_parameter"


@pytest.mark.parametrize("headers", [[("X-Deadline-Ms", "1000"), ("X-Deadline-Ms", "5")],
                                     [("X-Priority", "high"), ("X-Priority", "low")]], ids=["deadline", "priority"])
def test_a_header_repeated_with_different_values_is_422_and_the_next_request_is_served(http, headers):
    body = encode(photo("chelsea"))
    response = http.post("/classify", content=body, headers=headers)
    assert response.status_code == 422 and "different values" in response.json()["error"]["message"], response.text
    assert http.post("/classify", content=body, headers=headers[:1] * 2).status_code == 200  # the same value twice


@pytest.mark.parametrize(
    "body, status, code",
    [
        (b"", 400, "empty_body"),
        (b"this is not an image", 415, "unsupported_format"),
        (b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF", 415, "unsupported_format"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, 400, "undecodable_image"),
    ],
)
def test_invalid_image_is_a_json_4xx(http, server, body, status, code):
    response = http.post("/classify", content=body, headers={"X-Request-Id": "bad-upload-1"})
    assert response.status_code == status, response.text
    assert response.json() == {
        "error": {"code": code, "message": response.json()["error"]["message"], "request_id": "bad-upload-1"}
    }
    assert response.json()["error"]["message"]
    # The worker survives and the next real photo is still classified correctly.
    after = http.post("/classify", content=encode(photo("chelsea")))
    assert after.status_code == 200 and {label["index"] for label in after.json()["labels"][:3]} & PHOTOS["chelsea"]


def test_request_id_is_echoed_or_generated(http):
    jpeg = encode(photo("chelsea"))
    echoed = http.post("/classify", content=jpeg, headers={"X-Request-Id": "abc-123"})
    assert echoed.json()["request_id"] == "abc-123" and echoed.headers["x-request-id"] == "abc-123"
    generated = http.post("/classify", content=jpeg)
    assert len(generated.json()["request_id"]) == 32 and generated.headers["x-request-id"] == generated.json()["request_id"]


def test_batch_gives_one_entry_per_image_and_isolates_bad_ones(http):
    files = [
        ("images", ("cat.jpg", encode(photo("chelsea")))),
        ("images", ("junk.bin", b"not an image at all")),
        ("images", ("coffee.png", encode(photo("coffee"), "PNG"))),
    ]
    response = http.post("/classify_batch", files=files, params={"top_k": 3})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert {label["index"] for label in results[0]["labels"]} & PHOTOS["chelsea"]
    assert results[1]["error"]["code"] == "unsupported_format"
    assert {label["index"] for label in results[2]["labels"]} & PHOTOS["coffee"]


def test_readyz_and_metrics_stay_available(http):
    assert http.get("/readyz").status_code == 200
    assert "bentoml_service_request_total" in http.get("/metrics").text

