"""``rampart.api.oip``: the Open Inference Protocol (KServe v2 / Triton HTTP) and BentoML's own client.

Unit tests of ``rampart.api.oip``'s parsing and encoding, with request and response bodies
made and read by ``tritonclient`` itself. The end-to-end tests (``tritonclient.http``
and ``bentoml.SyncHTTPClient`` against a real server) are in ``tests/server/test_oip.py``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import gzip
import io
import json
import time
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
import tritonclient.http as triton
from PIL import Image

from starlette.requests import Request
from starlette.testclient import TestClient

from bench.perf_analyzer import make_inputs
from rampart.api import http, oip
from rampart.api.app import refuse_before_admission
from rampart.config import Settings
from rampart.overload.deadline import Deadline
from rampart.errors import DeadlineTooShort, EmptyBody, InvalidParameter, PayloadTooLarge, RampartError, RequestTimeout
from tests.support import encode, photo
from tests.support.stalls import loop_stall_s
from tests.support.oip import DEADLINE_MS, HOSTILE, answer, bad_request, image_input, image_json, pixels_json, texts
from tests.unit.standins import CAT, COFFEE

OUTPUTS = (oip.LABELS, oip.SCORES, oip.CLASS_INDICES)
#: The default settings' limits: 16 images, 20 MB each, 50 M pixels each.
LIMITS = oip.Limits(max_images=16, max_image_bytes=20_000_000, max_pixels=50_000_000)


def limits(**changes) -> oip.Limits:
    return dataclasses.replace(LIMITS, **changes)


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
    parsed = oip.parse_infer_request(body, header_length, LIMITS)
    assert parsed.images == images and parsed.id == "r-1"
    assert parsed.parameters["top_k"] == 3 and parsed.parameters["deadline_ms"] == 800
    assert parsed.outputs is None and parsed.binary_output is True  # tritonclient's default: all outputs binary


def test_binary_image_over_the_byte_cap_is_413():
    body, header_length = request_body([image_input([b"x" * 10, b"x" * 11], True)])
    assert len(oip.parse_infer_request(body, header_length, limits(max_image_bytes=11)).images) == 2
    with pytest.raises(PayloadTooLarge, match=r"IMAGE\[1\]"):
        oip.parse_infer_request(body, header_length, limits(max_image_bytes=10))


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_pixels_input_becomes_a_lossless_image(binary):
    pixels = photo("coffee")[:64, :80]
    tensor = triton.InferInput(oip.PIXELS, [1, *pixels.shape], "UINT8")
    tensor.set_data_from_numpy(pixels[None], binary_data=binary)
    (image,) = oip.parse_infer_request(*request_body([tensor]), LIMITS).images
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(image)).convert("RGB")), pixels)


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
        oip.parse_infer_request(body, header_length, limits(max_image_bytes=10))


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_responses_read_back_with_tritonclient_and_pad_unanswered_rows(binary):
    results = [answer([(285, "Egyptian cat", 0.5), (281, "tabby", 0.25)]), answer([], "no_model_available")]
    parsed = oip.InferRequest("id-7", [b"", b""], {}, [(name, binary) for name in oip.OUTPUT_DATATYPES], False)
    response = oip.encode_infer_response(parsed, results, 2, "req-1", "v")
    length = response.headers.get(oip.HEADER_LENGTH)
    assert (length is not None) == binary
    result = triton.InferenceServerClient.parse_response_body(response.body, header_length=length and int(length))
    assert texts(result.as_numpy(oip.LABELS)) == [["Egyptian cat", "tabby"], ["", ""]]
    assert result.as_numpy(oip.SCORES).dtype == np.float32
    assert result.as_numpy(oip.SCORES).tolist() == [[0.5, 0.25], [0.0, 0.0]]
    assert result.as_numpy(oip.CLASS_INDICES).tolist() == [[285, 281], [-1, -1]]
    assert texts(result.as_numpy(oip.DEGRADED_REASON)) == [[""], ["no_model_available"]]
    assert texts(result.as_numpy(oip.MODEL)) == [["rampart-primary"], [""]]
    assert result.as_numpy(oip.NEEDS_REVIEW).tolist() == [[False], [True]]
    parameters = result.get_response()["parameters"]
    assert parameters["degraded"] is True and parameters["needs_review"] is True
    assert parameters["request_id"] == "req-1" and parameters["total_ms"] == 6.0
    assert result.get_response()["id"] == "id-7"


def test_per_image_outcomes_are_one_element_per_image_not_joined_strings():
    confident = {**answer([(285, "Egyptian cat", 0.9)]), "route": "cascade_confident",
                 "model": {"name": "rampart-fallback", "version": "v"}}
    escalated = {**answer([(281, "tabby", 0.6)]), "route": "cascade_escalated"}
    unanswered = {**answer([], "no_model_available"), "route": None}
    parsed = oip.InferRequest(None, [b""] * 3, {}, None, False)
    body = json.loads(oip.encode_infer_response(parsed, [confident, escalated, unanswered], 1, "req-2", "v").body)
    outputs = {output["name"]: output for output in body["outputs"]}
    assert list(outputs) == list(oip.OUTPUT_DATATYPES)  # every output when none is named
    assert outputs[oip.ROUTE]["data"] == ["cascade_confident", "cascade_escalated", ""]
    assert outputs[oip.MODEL]["data"] == ["rampart-fallback", "rampart-primary", ""]
    assert outputs[oip.DEGRADED_REASON]["data"] == ["", "", "no_model_available"]
    assert all(outputs[name]["shape"] == [3, 1] for name in (oip.ROUTE, oip.MODEL, oip.DEGRADED_REASON))
    two_full = json.loads(oip.encode_infer_response(parsed, [confident, escalated], 1, "r", "v").body)
    assert {o["name"]: o["data"] for o in two_full["outputs"]}[oip.DEGRADED_REASON] == ["", ""]
    assert "degraded_reason" not in two_full["parameters"] and two_full["parameters"]["degraded"] is False


def test_metadata_and_config_declare_the_same_tensors():
    """perf_analyzer checks data against the metadata's shapes with the batch dimension removed, and
    against the config's dims: they must agree (Triton's convention: metadata = [-1] + dims)."""
    metadata, config = oip.model_metadata("v"), oip.model_config(Settings(), "v")
    declared = {t["name"]: t["shape"] for t in metadata["inputs"] + metadata["outputs"]}
    dims = {t["name"]: [-1, *t["dims"]] for t in config["input"] + config["output"]}
    assert declared == dims
    assert declared[oip.IMAGE] == [-1, 1] and declared[oip.PIXELS] == [-1, -1, -1, 3]
    types = {t["name"]: t["datatype"] for t in metadata["inputs"] + metadata["outputs"]}
    assert {t["name"]: t["data_type"] for t in config["input"] + config["output"]} == {
        name: "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}" for name, datatype in types.items()}


# --- hostile bodies: every one a 4xx RampartError, never another exception ----------------------------


def interpret(body: bytes, header_length: str | None) -> oip.InferRequest:
    """What ``/infer`` does with a body before classifying: parse it, then read its parameters."""
    parsed = oip.parse_infer_request(body, header_length, LIMITS)
    request = Request({"type": "http", "method": "POST", "path": "/v2/models/rampart/infer", "headers": [],
                       "query_string": b""})
    settings_ = Settings()
    deadline = http.parse_deadline(request, settings_)
    oip.request_options(request, parsed.parameters, settings_, 0.0, deadline)
    return parsed


@pytest.mark.parametrize("body, header_length", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_bodies_are_refused_with_a_client_error(body, header_length):
    with pytest.raises(RampartError) as refused:
        interpret(body, header_length)
    assert 400 <= refused.value.status < 500 and refused.value.message


#: Parameters that ``request_options`` refuses: the error and the start of its message.
BAD_PARAMETERS = [
    ({"deadline_ms": -1}, InvalidParameter, "parameter deadline_ms must be positive"),
    ({"deadline_ms": 10}, DeadlineTooShort, "parameter deadline_ms=10 is below the minimum"),
    ({"timeout": -5}, InvalidParameter, "parameter timeout (µs; the value shown is in ms) must be positive"),
    ({"priority": "urgent"}, InvalidParameter, "parameter priority must be"),
    # Not ASCII: no header could carry it (a UnicodeEncodeError, a 500, found by the property test below).
    ({"deadline_ms": "\u0100"}, InvalidParameter, "parameter deadline_ms must be a number"),
    ({"timeout": "\u00e9"}, InvalidParameter, "parameter timeout must be a number"),
    ({"top_k": "\u0663"}, InvalidParameter, "parameter top_k must be a number"),
    ({"priority": "h\u00efgh"}, InvalidParameter, "parameter priority must be"),
    ({"top_k": [1] * 1000}, InvalidParameter, "parameter top_k must be a number, got a list"),
    ({"priority": {"level": 1}}, InvalidParameter, "parameter priority must be 'high', 'normal', 'low' or 0..3, got an object"),
]


@pytest.mark.parametrize("parameters, error, named", BAD_PARAMETERS)
def test_a_bad_parameter_is_named_as_the_parameter_not_as_the_header_it_stands_for(parameters, error, named):
    """``parameters.deadline_ms`` = -1 said "X-Deadline-Ms must be positive": the client sent no such header."""
    request = Request({"type": "http", "method": "POST", "path": "/v2/models/rampart/infer", "headers": [],
                       "query_string": b""})
    with pytest.raises(error) as refused:
        oip.request_options(request, parameters, Settings(), 0.0, http.parse_deadline(request, Settings()))
    assert refused.value.message.startswith(named) and "X-" not in refused.value.message, refused.value.message


def test_ten_million_empty_binary_elements_are_refused_on_their_declared_count():
    blob = b"\x00\x00\x00\x00" * 10_000_000
    for declared in (10_000_000, 1):
        header = bad_request({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [declared],
                                          "parameters": {"binary_data_size": len(blob)}}]})
        with pytest.raises(InvalidParameter, match="16|more than the 1 elements"):
            oip.parse_infer_request(header + blob, str(len(header)), LIMITS)


@pytest.mark.parametrize("body", [
    b'{"inputs":[{"name":"IMAGE","datatype":"BYTES","shape":[2000000],"data":[' + b",".join([b'""'] * 2_000_000) + b"]}]}",
    b'{"inputs":[{"name":"PIXELS","datatype":"UINT8","shape":[1,1000,1000,3],"data":['
    + b",".join([b"7"] * 3_000_000) + b"]}]}",
], ids=["2M-empty-strings", "3M-pixel-values"])
def test_json_holding_more_values_than_the_cap_is_413_before_it_is_parsed(body, monkeypatch):
    monkeypatch.setattr(oip.json, "loads", lambda *a, **k: pytest.fail("parsed a JSON part over the value cap"))
    with pytest.raises(PayloadTooLarge, match="binary tensor data extension"):
        oip.parse_infer_request(body, None, LIMITS)


def test_json_pixels_up_to_the_cap_are_accepted():
    side = int((oip.MAX_JSON_VALUES // 3) ** 0.5)
    pixels = np.random.default_rng(0).integers(0, 256, (1, side, side, 3), dtype=np.uint8)
    body = bad_request({"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": list(pixels.shape),
                                    "data": pixels.tolist()}]})
    (image,) = oip.parse_infer_request(body, None, LIMITS).images
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(image))), pixels[0])


#: Every code point, lone UTF-16 surrogates included (JSON's "\\ud800" escape gives one; hypothesis leaves them out
#: by default).
ANY_CHARACTER = st.characters(exclude_categories=())
#: Values hypothesis puts anywhere in a request: every JSON type, numbers beyond every dtype, NaN/Infinity.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10**30), 10**30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(ANY_CHARACTER, max_size=12),
                    st.sampled_from(["IMAGE", "PIXELS", "BYTES", "UINT8", "eA==", "", "high", "1e300"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["name", "datatype", "shape", "data", "parameters", "binary_data_size", "top_k", "inputs"])
    | st.text(max_size=6), inner, max_size=4), max_leaves=12)
TEMPLATES = [image_json(), pixels_json(),
             {**image_json(), "parameters": {"top_k": 3, "deadline_ms": 800, "priority": 1},
              "outputs": [{"name": "LABELS", "parameters": {"binary_data": True}}], "id": "r"},
             {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": 5}}]}]


@st.composite
def hostile_requests(draw) -> tuple[bytes, str | None]:
    """A valid request (JSON or binary), then 1-4 of: a field replaced by any value, a field deleted,
    a value nested up to 1,200 lists deep; the binary part and Inference-Header-Content-Length mutated."""
    request = json.loads(json.dumps(draw(st.sampled_from(TEMPLATES))))
    nests = {}  # marker string: (depth, value), spliced into the text (json cannot write 1,200 levels)
    for _ in range(draw(st.integers(1, 4))):
        node = request
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            if not isinstance(node[key], (dict, list)) or not node[key]:
                break
            node = node[key]
        if not isinstance(node, (dict, list)) or not node:
            continue
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        action = draw(st.sampled_from(["replace", "delete", "nest"]))
        if action == "replace":
            node[key] = draw(VALUES)
        elif action == "delete":
            del node[key]
        else:
            marker = f"nest-{len(nests)}"
            nests[marker] = (draw(st.integers(1, 1200)), node[key])
            node[key] = marker
    text = json.dumps(request)
    for marker, (depth, value) in nests.items():
        text = text.replace(json.dumps(marker), "[" * depth + json.dumps(value) + "]" * depth)
    text = text.encode()
    binary = draw(st.sampled_from([b"", serialize(b"x"), b"\x05\x00", b"\xff" * 9]))
    header_length = draw(st.one_of(st.none(), st.just(str(len(text))), st.text(max_size=6),
                                   st.integers(-5, len(text) + 20).map(str)))
    return text + binary, header_length


def serialize(image: bytes) -> bytes:
    return oip.serialize_bytes([image])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_requests())
def test_any_body_is_a_request_or_a_client_error(body_and_header):
    body, header_length = body_and_header
    try:
        parsed = interpret(body, header_length)
    except RampartError as exc:
        assert 400 <= exc.status < 500, exc
        return
    assert 1 <= len(parsed.images) <= LIMITS.max_images
    assert all(isinstance(image, bytes) and len(image) <= LIMITS.max_image_bytes for image in parsed.images)
    assert isinstance(parsed.parameters, dict) and isinstance(parsed.binary_output, bool)


# --- the routes in-process: compression, errors in the protocol's form, statistics, repository index ---

def infer_body(images: list[bytes]) -> tuple[bytes, dict]:
    body, header_length = request_body([image_input(images, True)], parameters={"deadline_ms": DEADLINE_MS})
    return body, {oip.HEADER_LENGTH: header_length, "Content-Type": "application/octet-stream"}


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                                ("GZip", gzip.compress), ("identity", lambda body: body)])
def test_compressed_bodies_are_answered_as_plain_ones(rig, encoding, compress):
    body, headers = infer_body([CAT])
    response = rig.client.post("/v2/models/rampart/infer", content=compress(body),
                               headers={**headers, "Content-Encoding": encoding})
    assert response.status_code == 200, response.text
    result = triton.InferenceServerClient.parse_response_body(
        response.content, header_length=int(response.headers[oip.HEADER_LENGTH]))
    assert result.as_numpy(oip.CLASS_INDICES)[0, 0] == 281  # the stand-in primary's best class


@pytest.mark.parametrize("encoding, body, status, code", [
    ("br", b"anything", 415, "unsupported_format"),
    ("gzip, deflate", b"anything", 415, "unsupported_format"),
    ("gzip", b"not gzip at all", 422, "invalid_parameter"),
    ("gzip", gzip.compress(b'{"inputs": []}')[:-6], 422, "invalid_parameter"),
    ("deflate", zlib.compress(b"{}") + b"trailing", 422, "invalid_parameter"),
], ids=["brotli", "two-encodings", "not-gzip", "truncated", "trailing-data"])
def test_other_or_broken_encodings_are_protocol_errors(rig, encoding, body, status, code):
    response = rig.client.post("/v2/models/rampart/infer", content=body, headers={"Content-Encoding": encoding})
    assert response.status_code == status
    assert isinstance(response.json()["error"], str) and response.json()["error"].startswith(f"{code}: ")


@functools.cache
def zeros_bomb(size: int) -> bytes:
    """``size`` zero bytes, gzip-compressed (about 1,000:1)."""
    compressor, zeros = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), bytes(1 << 20)
    return b"".join([*(compressor.compress(zeros) for _ in range(size >> 20)), compressor.flush()])


def test_a_decompression_bomb_stops_at_the_byte_cap(make_rig):
    rig = make_rig(max_batch_images=1, max_body_bytes=1_000_000)  # a cap of 1 MB + multipart overhead
    bomb = zeros_bomb(64 << 20)  # 64 MiB inflated, 64 KB sent
    response = rig.client.post("/v2/models/rampart/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 413 and response.json()["error"].startswith("payload_too_large: the decompressed")


def test_a_bomb_under_the_cap_that_inflates_past_the_deadline_says_so(make_rig):
    """A bomb of 256 MiB under a 320 MB cap: inflating it outlasts a 100 ms deadline, after the body had arrived."""
    rig = make_rig(max_batch_images=16, max_body_bytes=20_000_000)
    response = rig.client.post("/v2/models/rampart/infer", content=zeros_bomb(256 << 20),
                               headers={"Content-Encoding": "gzip", "X-Deadline-Ms": "100"})
    assert response.status_code == 408
    assert response.json()["error"].startswith("request_timeout: the body was not received and decompressed within")


def test_inflating_stops_reading_a_bomb_once_past_the_cap():
    bomb = zeros_bomb(64 << 20)
    pieces = [bomb[start:start + 1024] for start in range(0, len(bomb), 1024)]
    consumed = []

    async def chunks():
        for piece in pieces:
            consumed.append(piece)
            yield piece

    with pytest.raises(PayloadTooLarge):
        asyncio.run(oip._inflated(chunks(), zlib.decompressobj(16 + zlib.MAX_WBITS), 4 << 20))
    assert len(consumed) < len(pieces) / 8  # about 4 MiB of 64 inflated


def test_a_json_body_stops_inflating_at_the_json_byte_cap(rig):
    """A body without binary data is all JSON: however large the request cap, it is held to ``MAX_JSON_BYTES``."""
    bomb = zeros_bomb(oip.MAX_JSON_BYTES + (16 << 20))
    response = rig.client.post("/v2/models/rampart/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 413, response.text
    assert response.json()["error"].startswith(f"payload_too_large: the decompressed body is over the limit of "
                                               f"{oip.MAX_JSON_BYTES} bytes")


def test_a_json_part_over_its_byte_cap_is_refused_before_it_is_parsed():
    body, header_length = request_body([image_input([CAT], True)])
    small = dataclasses.replace(LIMITS, max_json_bytes=int(header_length) - 1)
    with pytest.raises(PayloadTooLarge, match="the JSON part of the request is over"):
        oip.parse_infer_request(body, header_length, small)
    whitespace = b" " * 100 + b'{"inputs": []}'  # few values, many bytes
    with pytest.raises(PayloadTooLarge):
        oip.parse_infer_request(whitespace, None, dataclasses.replace(LIMITS, max_json_bytes=100))
    assert oip.parse_infer_request(body, header_length, LIMITS).images == [CAT]


def test_a_json_part_over_its_byte_cap_is_refused_before_it_is_sliced_out_of_the_body():
    body = b" " * (8 << 20)  # Inference-Header-Content-Length says all but one byte of it is JSON
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge, match="the JSON part of the request is over"):
            oip.parse_infer_request(body, str(len(body) - 1), dataclasses.replace(LIMITS, max_json_bytes=1 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # no copy of the 8 MiB


def test_an_identity_body_is_held_once_while_it_is_read():
    """A plain (not compressed) ``/infer`` body of 16 MiB arriving in 64 KiB chunks: it was kept as a list of
    its chunks and joined at the end, so the worker held it twice for a moment (32 MiB for 16 counted against
    the body budget). Read into one buffer, it is held once."""
    size, chunk = 16 << 20, 64 << 10
    sent = 0

    async def receive() -> dict:  # a fresh chunk each time, as from the network
        nonlocal sent
        sent += chunk
        return {"type": "http.request", "body": bytes(chunk), "more_body": sent < size}

    scope = {"type": "http", "method": "POST", "path": "/v2/models/rampart/infer", "query_string": b"",
             "headers": [(b"content-length", str(size).encode()), (oip.HEADER_LENGTH.lower().encode(), b"2")]}

    async def read() -> tuple[bytes | bytearray, int]:  # the peak taken before asyncio.run's own teardown
        body = await oip.read_infer_body(Request(scope, receive), size, Deadline(DEADLINE_MS), Settings(), lambda: 1.0)
        return body, tracemalloc.get_traced_memory()[1]

    tracemalloc.start()
    try:
        body, peak = asyncio.run(read())
    finally:
        tracemalloc.stop()
    assert len(body) == size and not any(body[::chunk])
    assert peak < 1.3 * size, peak


def test_inflating_counts_each_slice_against_the_budget_and_stops_when_one_does_not_fit():
    bomb = zeros_bomb(64 << 20)
    held: list[int] = []

    def hold(size: int) -> bool:
        if sum(held) + size > 8 * oip.INFLATE_SLICE_BYTES:
            return False
        held.append(size)
        return True

    async def chunks():
        yield bomb

    with pytest.raises(oip.BodiesOverBudget):
        asyncio.run(oip._inflated(chunks(), zlib.decompressobj(16 + zlib.MAX_WBITS), 1 << 30, hold))
    assert sum(held) == 8 * oip.INFLATE_SLICE_BYTES


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v2/models/rampart/infer", 405), ("DELETE", "/v2", 405), ("GET", "/v2/nothing/here", 404),
    ("POST", "/v2/repository/models/rampart/load", 404), ("GET", "/v2/models/other/stats", 404),
    ("POST", "/v2/models/rampart/versions/7/infer", 404),
])
def test_every_error_under_v2_has_a_string_error(rig, method, path, status):
    response = rig.client.request(method, path)
    assert response.status_code == status and isinstance(response.json()["error"], str), response.text
    if status == 405:
        assert response.headers["allow"]
    other = rig.client.get("/no/such/path").json()["error"]  # the rest of the server keeps its own form
    assert other["code"] == "not_found"


def test_statistics_count_answers_and_failures(rig):
    body, headers = infer_body([CAT, COFFEE])
    assert rig.client.post("/v2/models/rampart/infer", content=body, headers=headers).status_code == 200
    assert rig.client.post("/v2/models/rampart/infer", content=b"{}").status_code == 422
    (stats,) = rig.client.get("/v2/models/rampart/stats").json()["model_stats"]
    assert rig.client.get("/v2/models/stats").json()["model_stats"] == [stats]
    assert (stats["name"], stats["version"]) == (oip.MODEL_NAME, oip.MODEL_VERSION)
    assert (stats["inference_count"], stats["execution_count"]) == (2, 1)
    counts = {stage: value["count"] for stage, value in stats["inference_stats"].items()}
    assert counts == {"success": 1, "fail": 1, "queue": 1, "compute_input": 1, "compute_infer": 1, "compute_output": 1}
    assert stats["inference_stats"]["success"]["ns"] > 0


def test_repository_index_lists_the_model_with_its_state(rig):
    assert rig.client.post("/v2/repository/index").json() == [
        {"name": oip.MODEL_NAME, "version": oip.MODEL_VERSION, "state": "READY"}]
    rig.lifecycle.begin_drain()
    assert rig.client.post("/v2/repository/index", json={"ready": True}).json() == []
    assert rig.client.post("/v2/repository/index").json()[0]["state"] == "UNAVAILABLE"
    refused = rig.client.post("/v2/repository/index", content=b"[1]")
    assert refused.status_code == 422 and isinstance(refused.json()["error"], str)


def test_hostile_bodies_through_the_route_are_protocol_errors_and_the_next_request_is_answered(rig):
    for name, (body, header_length) in HOSTILE.items():
        headers = {} if header_length is None else {oip.HEADER_LENGTH: header_length.encode()}  # UTF-8 on the wire
        response = rig.client.post("/v2/models/rampart/infer", content=body, headers=headers)
        assert 400 <= response.status_code < 500 and isinstance(response.json()["error"], str), (name, response.text)
    body, headers = infer_body([CAT])
    assert rig.client.post("/v2/models/rampart/infer", content=body, headers=headers).status_code == 200


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.text(ANY_CHARACTER, max_size=8) | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3))
@example("\ud800")
@example("r\udfff\u00e9")
def test_any_request_id_is_echoed_in_a_json_answer(rig, request_id):
    """The answer echoes the request's ``id``; any string JSON can carry, a lone surrogate (``"\\ud800"``, which
    UTF-8 cannot encode) included, comes back as the same string (it was a plain-text 500)."""
    body = {"id": request_id, "parameters": {"deadline_ms": DEADLINE_MS},
            "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(CAT).decode()]}]}
    response = rig.client.post("/v2/models/rampart/infer", content=json.dumps(body).encode())
    assert response.status_code == 200, response.text
    assert json.loads(response.content)["id"] == json.loads(json.dumps(request_id))  # a surrogate pair reads as one


def test_the_shipped_perf_analyzer_inputs_are_what_make_inputs_builds_and_parse():
    for name, build in make_inputs.FILES.items():
        assert json.loads((make_inputs.HERE / name).read_text()) == build(), f"rebuild {name}: see make_inputs"
    (step,) = make_inputs.image_inputs()["data"]
    (jpeg,) = oip.deserialize_bytes(base64.b64decode(step[oip.IMAGE]["b64"]))
    assert Image.open(io.BytesIO(jpeg)).format == "JPEG"


def test_a_request_over_the_in_flight_bound_is_refused_in_the_protocol_s_form_under_v2(rig):
    refuse = TestClient(refuse_before_admission(rig.client.app.app))  # what rampart.api.arrival answers with
    response = refuse.post("/v2/models/rampart/infer", content=b"{}")
    assert response.status_code == 429 and response.json()["error"].startswith("overloaded: ")
    assert int(response.headers["retry-after"]) >= 1
    assert refuse.post("/classify", content=b"").json()["error"]["code"] == "overloaded"


class SpentDeadline:
    """A deadline with no time left (the ``Deadline`` interface ``_parse_within`` reads)."""

    def remaining_s(self) -> float:
        return 0.0

    def share_ms(self) -> float:
        return 5.0


def test_parsing_past_the_deadline_is_408():
    body, header_length = request_body([image_input([encode(photo("coffee"))], False)])
    with pytest.raises(RequestTimeout, match="parsed within the deadline"):
        asyncio.run(oip._parse_within(body, header_length, LIMITS, SpentDeadline()))


def test_a_top_k_parameter_replaces_every_top_k_of_the_query_and_without_it_two_differing_ones_are_422():
    request = Request({"type": "http", "method": "POST", "path": "/v2/models/rampart/infer", "headers": [],
                       "query_string": b"top_k=3&top_k=4"})
    deadline = http.parse_deadline(request, Settings())
    assert oip.request_options(request, {"top_k": 2}, Settings(), 0.0, deadline)[0] == 2
    with pytest.raises(InvalidParameter, match="different values"):
        oip.request_options(request, {}, Settings(), 0.0, deadline)


@pytest.mark.parametrize("level", ["low", 3])
def test_a_low_priority_parameter_without_a_deadline_gets_the_low_class_default_deadline(level):
    """``parameters.priority`` low with no deadline anywhere: the low class's default deadline, as ``X-Priority:
    low`` gets, not the normal default the headers implied (an OIP low request sent that way was shed at about
    1 s beside normal traffic where the header's got 10 s); a deadline sent in the header or as a parameter is kept."""
    settings = Settings()
    request = Request({"type": "http", "method": "POST", "path": "/v2/models/rampart/infer", "headers": [],
                       "query_string": b""})
    deadline = http.parse_deadline(request, settings)
    assert deadline.budget_ms == settings.deadlines.default_deadline_ms
    _, priority, low = oip.request_options(request, {"priority": level}, settings, 0.0, deadline)
    assert priority == "low" and low.budget_ms == settings.deadlines.low_priority_deadline_ms
    assert low.arrival is deadline.arrival  # counted from the same arrival
    _, _, normal = oip.request_options(request, {"priority": "normal"}, settings, 0.0, deadline)
    assert normal.budget_ms == settings.deadlines.default_deadline_ms
    _, _, sent = oip.request_options(request, {"priority": level, "deadline_ms": 3000}, settings, 0.0, deadline)
    assert sent.budget_ms == 3000
    with_header = Request({"type": "http", "method": "POST", "path": "/v2/models/rampart/infer",
                           "headers": [(b"x-deadline-ms", b"2500")], "query_string": b""})
    header_deadline = http.parse_deadline(with_header, settings)
    assert oip.request_options(with_header, {"priority": level}, settings, 0.0, header_deadline)[2].budget_ms == 2500


def options_or_error(parameters: dict) -> tuple:
    """``request_options``' answer for ``parameters`` on a bare request: (top_k, priority, deadline ms) or the
    error's type and message."""
    request = Request({"type": "http", "method": "POST", "path": "/v2/models/rampart/infer", "headers": [],
                       "query_string": b""})
    try:
        top_k, priority, deadline = oip.request_options(request, parameters, Settings(), 0.0,
                                                        http.parse_deadline(request, Settings()))
    except RampartError as refused:
        return type(refused), refused.message
    return top_k, priority, round(deadline.remaining_s())


@pytest.mark.parametrize("parameters", [parameters for parameters, _, _ in BAD_PARAMETERS] + [
    {"top_k": 3, "priority": 1, "deadline_ms": "2500"}, {"timeout": 4_000_000, "priority": "low"}, {},
    {"top_k": "1" * 10_000}, {"priority": None},
])
def test_a_body_parsed_in_a_decode_worker_brings_back_only_the_parameters_read_with_the_same_outcome(parameters):
    """``parse_in_worker`` sends back the parameters ``request_options`` reads, each bounded, and nothing else (a
    million keys in ``parameters`` stay in the worker): the options, or the error, are the same as from the
    parameters the client sent."""
    body = json.dumps({**image_json(), "parameters": {**parameters, **{f"k{i}": [i] for i in range(1000)}}}).encode()
    parsed = oip.parse_in_worker(body, None, LIMITS)
    assert set(parsed.parameters) == set(parameters) & set(oip.PARAMETERS_READ)
    assert options_or_error(parsed.parameters) == options_or_error(parameters)
    assert parsed.images == oip.parse_infer_request(body, None, LIMITS).images


def hostile_json(values: int = 300_000) -> bytes:
    """A body that ``json.loads`` takes long over, inside ``MAX_JSON_VALUES``: ``values`` long floats."""
    return b'{"parameters": {"x": [' + b",".join([b"1.2345678901234567e-300"] * values) + b']}, "inputs": []}'


def test_a_large_json_part_is_parsed_in_a_decode_worker_without_stalling_the_event_loop():
    """In a thread of the API worker, ``json.loads`` holds the GIL: the event loop stalled for the whole parse of
    a million long floats (0.75-0.85 s; 1.07 s against 12 ms through a worker, measured so). In a decode worker
    process it keeps ticking; the same error comes back. Here 300,000 floats, the two stalls compared in the
    same run."""
    from rampart.inputs.pool import BoundedPool

    body, deadline = hostile_json(), Deadline(time.monotonic() + 30.0)
    pool = BoundedPool(workers=1, queue=2, processes=True, name="rampart-oip-parse")

    async def parse(in_worker: bool) -> str:
        try:
            await oip._parse_within(body, None, LIMITS, deadline, pool if in_worker else None, 30.0)
        except InvalidParameter as refused:
            return refused.message
        raise AssertionError("the body has no input: it must be refused")

    try:
        loop_stall_s(lambda: parse(True))  # the worker imports the parser once
        in_thread, thread_stall = loop_stall_s(lambda: parse(False))
        in_worker, worker_stall = loop_stall_s(lambda: parse(True))
    finally:
        pool.close()
    assert in_worker == in_thread and "no input" in in_thread
    assert worker_stall <= 0.25 * thread_stall, (worker_stall, thread_stall)


@pytest.mark.parametrize("chunk_size", [7, 1, 1 << 20], ids=["small_chunks", "one_byte_chunks", "one_chunk"])
def test_a_gzip_body_of_several_members_inflates_to_all_of_them(chunk_size):
    """RFC 1952 makes a gzip body a series of members (``gzip.decompress`` reads them all); the body was refused
    with "data after its end". Members may be cut anywhere between chunks, the magic included."""
    original = json.dumps(image_json()).encode() * 3
    members = gzip.compress(original[:50]) + gzip.compress(original[50:80]) + gzip.compress(original[80:])

    async def chunks():
        for start in range(0, len(members), chunk_size):
            yield members[start:start + chunk_size]

    inflated = asyncio.run(oip._inflated(chunks(), zlib.decompressobj(16 + zlib.MAX_WBITS), 1 << 20, gzip_members=True))
    assert bytes(inflated) == original == gzip.decompress(members)


@pytest.mark.parametrize("tail, message", [
    (b"\x00\x00", "data after its end"),  # not a member
    (b"\x1f", "data after its end"),  # half a magic, then the body ends
    (gzip.compress(b"x")[:12], "ends before its end of stream"),  # a member cut short
    (gzip.compress(b"") * oip.MAX_GZIP_MEMBERS, f"more than {oip.MAX_GZIP_MEMBERS} members"),
])
def test_what_follows_a_gzip_member_must_be_a_whole_member_and_their_number_is_bounded(tail, message):
    async def chunks():
        yield gzip.compress(b"{}") + tail

    with pytest.raises(InvalidParameter, match=message):
        asyncio.run(oip._inflated(chunks(), zlib.decompressobj(16 + zlib.MAX_WBITS), 1 << 20, gzip_members=True))


def test_a_deflate_body_takes_no_second_stream():
    async def chunks():
        yield zlib.compress(b"{}") + zlib.compress(b"{}")

    with pytest.raises(InvalidParameter, match="data after its end"):
        asyncio.run(oip._inflated(chunks(), zlib.decompressobj(zlib.MAX_WBITS), 1 << 20))



def test_an_inference_header_content_length_sent_twice_with_different_values_is_422(rig):
    """The split between JSON and binary data must not depend on which copy a proxy or the server reads."""
    body, header_length = request_body([image_input([CAT], True)])
    headers = [("Content-Type", "application/octet-stream"), (oip.HEADER_LENGTH, header_length),
               (oip.HEADER_LENGTH, str(int(header_length) + 1))]
    response = rig.client.post("/v2/models/rampart/infer", content=body, headers=headers)
    assert response.status_code == 422 and "inference-header-content-length is sent 2 times" in response.text, \
        response.text
    same = [headers[0], headers[1], headers[1]]
    assert rig.client.post("/v2/models/rampart/infer", content=body, headers=same).status_code == 200


def test_a_pixels_image_over_the_byte_cap_of_its_bmp_is_refused_on_its_declared_shape_naming_pixels():
    """PIXELS images are decoded from BMPs held to ``max_body_bytes``: a 2600×2600 image (20.28 MB as BMP) got 413
    about a byte count the client never sent, after the pixels were converted; now it is refused on its shape."""
    limit = limits(max_image_bytes=20_000_000)
    fits = oip.bmp_bytes(2500, 2600)
    assert fits <= 20_000_000 < oip.bmp_bytes(2600, 2600)
    header = {"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1, 2600, 2600, 3],
                          "parameters": {"binary_data_size": 2600 * 2600 * 3}}]}
    text = json.dumps(header).encode()
    with pytest.raises(PayloadTooLarge, match="'PIXELS': a 2600x2600 image is 20280054 bytes as the BMP"):
        oip.parse_infer_request(text + bytes(2600 * 2600 * 3), str(len(text)), limit)
    small = encode(photo("chelsea"), "BMP")
    assert oip.bmp_bytes(451, 300) == len(small)


def test_an_empty_pixels_tensor_is_named_as_pixels():
    with pytest.raises(EmptyBody, match="'PIXELS' tensor has no elements"):
        oip.parse_infer_request(json.dumps(pixels_json(shape=[0, 1, 1, 3], data=[])).encode(), None, LIMITS)
