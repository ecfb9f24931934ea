"""The Open Inference Protocol (KServe v2 / Triton HTTP) and BentoML's own client.

Unit tests of ``rampart.api.oip``'s parsing and encoding, with request and response bodies
made and read by ``tritonclient`` itself. The end-to-end tests (``tritonclient.http``
and ``bentoml.SyncHTTPClient`` against a real server) are in ``tests/server/test_oip.py``.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image

from rampart.api import oip
from rampart.errors import EmptyBody, InvalidParameter, PayloadTooLarge
from tests.support import encode, photo

OUTPUTS = (oip.LABELS, oip.SCORES, oip.CLASS_INDICES)
#: Generous, so a loaded 2-core machine does not turn the comparisons into degraded answers.
DEADLINE_MS = 5000


def image_input(images: list[bytes], binary: bool) -> triton.InferInput:
    """An ``IMAGE`` input: raw bytes in the binary extension, base64 strings in JSON."""
    tensor = triton.InferInput(oip.IMAGE, [len(images)], "BYTES")
    elements = images if binary else [base64.b64encode(image) for image in images]
    tensor.set_data_from_numpy(np.array(elements, dtype=object), binary_data=binary)
    return tensor


def texts(array: np.ndarray) -> list:
    """A BYTES output as nested lists of str (tritonclient gives bytes from binary data, str from JSON)."""
    return [[v.decode() if isinstance(v, bytes) else v for v in row] for row in array.tolist()]


def request_body(inputs, outputs=None, **kwargs) -> tuple[bytes, str | None]:
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, outputs=outputs, **kwargs)
    return body, None if json_size is None else str(json_size)


def test_bytes_tensor_round_trip_and_broken_framing():
    elements = [b"", b"\x00\xff" * 3, "é".encode()]
    assert oip.deserialize_bytes(oip.serialize_bytes(elements)) == elements
    blob = oip.serialize_bytes([b"abcdef"])
    for broken in (blob[:-1], blob[:2]):
        with pytest.raises(InvalidParameter):
            oip.deserialize_bytes(broken)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_request_bodies_parse_to_the_same_images(binary):
    images = [encode(photo("chelsea")), encode(photo("coffee"), "PNG")]
    body, header_length = request_body([image_input(images, binary)], request_id="r-1",
                                       parameters={"top_k": 3, "deadline_ms": 800})
    parsed = oip.parse_infer_request(body, header_length, 20_000_000)
    assert parsed.images == images and parsed.id == "r-1"
    assert parsed.parameters["top_k"] == 3 and parsed.parameters["deadline_ms"] == 800
    assert parsed.outputs is None and parsed.binary_output is True  # tritonclient's default: all outputs binary


def test_binary_image_over_the_byte_cap_is_413():
    body, header_length = request_body([image_input([b"x" * 10, b"x" * 11], True)])
    assert len(oip.parse_infer_request(body, header_length, 11).images) == 2
    with pytest.raises(PayloadTooLarge, match=r"IMAGE\[1\]"):
        oip.parse_infer_request(body, header_length, 10)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_pixels_input_becomes_a_lossless_image(binary):
    pixels = photo("coffee")[:64, :80]
    tensor = triton.InferInput(oip.PIXELS, [1, *pixels.shape], "UINT8")
    tensor.set_data_from_numpy(pixels[None], binary_data=binary)
    (image,) = oip.parse_infer_request(*request_body([tensor]), 20_000_000).images
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(image)).convert("RGB")), pixels)


def bad_request(header: dict) -> bytes:
    return json.dumps(header).encode()


@pytest.mark.parametrize("body, header_length, error", [
    (b"{not json", None, InvalidParameter),
    (bad_request({"inputs": "IMAGE"}), None, InvalidParameter),
    (bad_request({"inputs": []}), None, InvalidParameter),
    (bad_request({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["eA=="]}]}), None,
     InvalidParameter),
    (bad_request({"inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [1], "data": [1.0]}]}), None,
     InvalidParameter),
    (bad_request({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [2], "data": ["eA=="]}]}), None,
     InvalidParameter),
    (bad_request({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["not base64!"]}]}),
     None, InvalidParameter),
    (bad_request({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                              "parameters": {"binary_data_size": 99}}]}), "94", InvalidParameter),
    (bad_request({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [0], "data": []}]}), None, EmptyBody),
    (bad_request({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["QUJD" * 40]}]}), None,
     PayloadTooLarge),
    (b"[" * 100_000 + b"]" * 100_000, None, InvalidParameter),
    (bad_request({"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1, 0, 0, 3], "data": []}]}), None,
     InvalidParameter),
    (bad_request({"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [2**40, 2**40, 2**40, 3],
                              "data": [0]}]}), None, InvalidParameter),
], ids=["not-json", "inputs-not-list", "no-input", "unknown-input", "wrong-datatype", "shape-mismatch",
        "bad-base64", "binary-size-past-end", "no-elements", "over-cap", "deep-nesting", "empty-pixels",
        "huge-pixel-shape"])
def test_malformed_requests_raise_rampart_errors(body, header_length, error):
    with pytest.raises(error):
        oip.parse_infer_request(body, header_length, max_image_bytes=10)


def answer(labels: list[tuple[int, str, float]], reason: str | None = None) -> dict:
    return {"labels": [{"index": i, "label": n, "score": s} for i, n, s in labels], "degraded": reason is not None,
            "degraded_reason": reason, "needs_review": not labels,
            "model": {"name": "rampart-primary", "version": "v"} if labels else None,
            "timings_ms": {"decode": 1.0, "queue": 2.0, "inference": 3.0, "total": 6.0}}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_responses_read_back_with_tritonclient_and_pad_unanswered_rows(binary):
    results = [answer([(285, "Egyptian cat", 0.5), (281, "tabby", 0.25)]), answer([], "no_model_available")]
    parsed = oip.InferRequest("id-7", [b"", b""], {}, [(name, binary) for name in OUTPUTS], False)
    response = oip.encode_infer_response(parsed, results, 2, "req-1", "v")
    length = response.headers.get(oip.HEADER_LENGTH)
    assert (length is not None) == binary
    result = triton.InferenceServerClient.parse_response_body(response.body, header_length=length and int(length))
    assert texts(result.as_numpy(oip.LABELS)) == [["Egyptian cat", "tabby"], ["", ""]]
    assert result.as_numpy(oip.SCORES).dtype == np.float32
    assert result.as_numpy(oip.SCORES).tolist() == [[0.5, 0.25], [0.0, 0.0]]
    assert result.as_numpy(oip.CLASS_INDICES).tolist() == [[285, 281], [-1, -1]]
    parameters = result.get_response()["parameters"]
    assert parameters["degraded"] is True and parameters["degraded_reason"] == ",no_model_available"
    assert parameters["request_id"] == "req-1" and parameters["total_ms"] == 6.0
    assert result.get_response()["id"] == "id-7"


def test_response_parameters_carry_each_images_route_as_on_classify():
    confident = {**answer([(285, "Egyptian cat", 0.9)]), "route": "cascade_confident",
                 "model": {"name": "rampart-fallback", "version": "v"}}
    escalated = {**answer([(281, "tabby", 0.6)]), "route": "cascade_escalated"}
    unanswered = {**answer([], "no_model_available"), "route": None}
    parsed = oip.InferRequest(None, [b""] * 3, {}, None, False)
    body = json.loads(oip.encode_infer_response(parsed, [confident, escalated, unanswered], 1, "req-2", "v").body)
    assert body["parameters"]["routes"] == "cascade_confident,cascade_escalated,"
    assert body["parameters"]["models"] == "rampart-fallback,rampart-primary,"
