"""The SDK reading answers no Rampart server sends: every one is a ``ServiceError`` (or the error its status maps
to), never a raw ``TypeError``, ``AttributeError`` or pydantic ``ValidationError``; and a ``Retry-After`` that is
not a finite number of seconds ≥ 0 is taken as absent (a ``nan`` or ``-1`` reached ``time.sleep``)."""

from __future__ import annotations

import json

import httpx
import pytest

from rampart_client import ImageRejected, Overloaded, Prediction, ServiceError
from rampart_client.client import _retry_after_s, parse_batch, parse_prediction

PREDICTION = {"request_id": "r", "labels": [{"index": 967, "label": "espresso", "score": 0.9}],
              "model": {"name": "m", "version": "1"}, "degraded": False, "degraded_reason": None,
              "timings_ms": {"decode": 1.0, "queue": 0.0, "inference": 1.0, "total": 2.0}}


def answer(status: int, body, headers: dict | None = None) -> httpx.Response:
    return httpx.Response(status, content=json.dumps(body).encode(), headers={"content-type": "application/json",
                                                                               **(headers or {})})


@pytest.mark.parametrize("body", [[1, 2], {"results": None}, {"results": [5]}, {"results": "x"}, {},
                                  {"results": [{"index": 0, "labels": "oops"}]}, "text"])
def test_an_unreadable_batch_answer_is_a_service_error(body):
    with pytest.raises(ServiceError) as unreadable:
        parse_batch(answer(200, body))
    assert unreadable.value.status == 200


@pytest.mark.parametrize("status", ["429", None, 4.5, True, [429]])
def test_a_batch_entry_whose_status_is_not_a_number_is_a_service_error_in_place(status):
    body = {"request_id": "r", "results": [{"error": {"code": "x", "message": "m"}, "status": status},
                                           dict(PREDICTION, index=1)]}
    refused, answered = parse_batch(answer(200, body))
    assert type(refused) is ServiceError and refused.status is None and refused.code == "x"
    assert isinstance(answered, Prediction) and answered.labels[0].index == 967


def test_batch_entries_still_map_on_their_own_status():
    body = {"request_id": "r", "results": [{"error": {"code": "overloaded", "message": "m"}, "status": 429},
                                           {"error": {"code": "corrupt_image", "message": "m"}, "status": 400}]}
    shed, rejected = parse_batch(answer(200, body))
    assert isinstance(shed, Overloaded) and shed.retry_after == 1.0 and isinstance(rejected, ImageRejected)


@pytest.mark.parametrize("body", [[PREDICTION], {"labels": "x"}, 3])
def test_an_unreadable_single_answer_is_a_service_error(body):
    with pytest.raises(ServiceError):
        parse_prediction(answer(200, body))


@pytest.mark.parametrize("header, seconds", [("2", 2.0), ("0.5", 0.5), ("0", 0.0), ("nan", None), ("-1", None),
                                             ("inf", None), ("-inf", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None),
                                             ("", None)])
def test_retry_after_is_a_finite_number_of_seconds_or_absent(header, seconds):
    assert _retry_after_s({"retry-after": header}, None) == seconds
    shed = parse_prediction_error(answer(429, {"error": {"code": "overloaded", "message": "m"}}, {"Retry-After": header}))
    assert shed.retry_after == (1.0 if seconds is None else seconds)  # a 429 without a usable one: 1 s


def parse_prediction_error(response: httpx.Response) -> Overloaded:
    with pytest.raises(Overloaded) as shed:
        parse_prediction(response)
    return shed.value


@pytest.mark.parametrize("status, kind, retry_after", [(429, Overloaded, 2.0), (503, ServiceError, 2.0),
                                                       (502, ServiceError, 2.0)])
@pytest.mark.parametrize("page", [b"<html><body><h1>Too Many Requests</h1></body></html>", b'{"error": "slow down"}'])
def test_a_refusal_from_a_proxy_in_front_of_rampart_maps_on_its_status_and_keeps_retry_after(status, kind, retry_after,
                                                                                           page):
    """An ingress's or CDN's rate-limit page (HTML, or JSON of another shape): a 429 was a ``ServiceError`` without
    its ``Retry-After``, which the back-off counted as an accept and never retried."""
    response = httpx.Response(status, content=page, headers={"Retry-After": "2"})
    with pytest.raises(kind) as refused:
        parse_prediction(response)
    assert refused.value.status == status and refused.value.retry_after == retry_after


def test_deeply_nested_json_from_a_hostile_server_is_a_service_error():
    with pytest.raises(ServiceError):
        parse_prediction(httpx.Response(200, content=b"[" * 100_000 + b"]" * 100_000))


@pytest.mark.parametrize("mode", ["CMYK", "YCbCr", "LAB", "HSV", "F", "I", "RGB", "RGBA", "P", "L", "1", "LA", "I;16"])
def test_a_pil_image_of_any_mode_is_sent_as_a_png_that_decodes(mode):
    """A CMYK JPEG opened with Pillow raised a bare ``OSError: cannot write mode CMYK as PNG``."""
    import io

    import numpy as np
    from PIL import Image

    from rampart_client.client import image_bytes

    if mode in ("F", "I", "I;16"):
        image = Image.fromarray(np.full((8, 8), 100, np.uint16))
        image = image if mode == "I;16" else image.convert(mode)
    else:
        image = Image.new("RGB", (8, 8), (10, 200, 30)).convert(mode)
    sent = Image.open(io.BytesIO(image_bytes(image)))
    assert sent.format == "PNG" and sent.size == (8, 8)
