"""The Open Inference Protocol (KServe v2 / Triton HTTP) and BentoML's own client.

Unit tests of ``rampart.oip``'s parsing and encoding, with request and response bodies
made and read by ``tritonclient`` itself; then ``tritonclient.http`` and
``bentoml.SyncHTTPClient``, unchanged, against the session's default server, with
answers compared to ``/classify``'s on the same bytes.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import bentoml
import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

from rampart import oip
from rampart.errors import ERROR_CLASSES, EmptyBody, InvalidParameter, PayloadTooLarge
from tests.conftest import PHOTOS, encode, photo

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


# --- unit: parsing and encoding, with bodies tritonclient makes and reads ---


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


# --- end to end: tritonclient.http and bentoml.SyncHTTPClient against the default server ---


@pytest.fixture(scope="module")
def client(server):
    with triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60) as client:
        yield client


def classify(http, data: bytes, top_k: int = 5) -> dict:
    response = http.post("/classify", content=data, params={"top_k": top_k}, headers={"X-Deadline-Ms": str(DEADLINE_MS)})
    assert response.status_code == 200, response.text
    return response.json()


def test_health_metadata_and_config(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(oip.MODEL_NAME)
    assert not client.is_model_ready("resnet50")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    metadata = client.get_model_metadata(oip.MODEL_NAME)
    assert {t["name"]: (t["datatype"], t["shape"]) for t in metadata["inputs"]} == {
        oip.IMAGE: ("BYTES", [-1]), oip.PIXELS: ("UINT8", [-1, -1, -1, 3])}
    assert {t["name"]: t["datatype"] for t in metadata["outputs"]} == {
        oip.LABELS: "BYTES", oip.SCORES: "FP32", oip.CLASS_INDICES: "INT64"}
    config = client.get_model_config(oip.MODEL_NAME, model_version=metadata["versions"][0])
    assert config["max_batch_size"] == 16 and config["dynamic_batching"]["priority_levels"] == 2
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("rampart-typo")
    assert unknown.value.status() == "404"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_gives_the_labels_of_classify(client, http, binary):
    names = sorted(PHOTOS)
    images = [encode(photo(name)) for name in names]
    expected_answers = [classify(http, image, top_k=3) for image in images]
    outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in OUTPUTS]
    result = client.infer(oip.MODEL_NAME, [image_input(images, binary)], outputs=outputs,
                          parameters={"top_k": 3, "deadline_ms": DEADLINE_MS})
    parameters = result.get_response()["parameters"]
    indices, scores = result.as_numpy(oip.CLASS_INDICES), result.as_numpy(oip.SCORES)
    assert indices.shape == scores.shape == result.as_numpy(oip.LABELS).shape == (len(names), 3)
    for row, (name, expected) in enumerate(zip(names, expected_answers)):
        assert parameters["models"].split(",")[row] == expected["model"]["name"], parameters
        assert indices[row].tolist() == [label["index"] for label in expected["labels"]]
        assert texts(result.as_numpy(oip.LABELS))[row] == [label["label"] for label in expected["labels"]]
        assert np.allclose(scores[row], [label["score"] for label in expected["labels"]], atol=1e-4)
        assert set(indices[row].tolist()) & PHOTOS[name]
    assert parameters["degraded"] is False, parameters


def test_batch_of_eight_and_raw_pixels(client):
    names = sorted(PHOTOS) * 2
    result = client.infer(oip.MODEL_NAME, [image_input([encode(photo(name)) for name in names], True)],
                          parameters={"deadline_ms": DEADLINE_MS})
    indices = result.as_numpy(oip.CLASS_INDICES)
    assert indices.shape == (8, 5)
    for name, row in zip(names, indices):
        assert set(row[:3].tolist()) & PHOTOS[name], (name, row)
    pixels = photo("chelsea")
    tensor = triton.InferInput(oip.PIXELS, [1, *pixels.shape], "UINT8")
    tensor.set_data_from_numpy(pixels[None])
    raw = client.infer(oip.MODEL_NAME, [tensor], parameters={"deadline_ms": DEADLINE_MS}, priority=1)
    assert set(raw.as_numpy(oip.CLASS_INDICES)[0, :3].tolist()) & PHOTOS["chelsea"]


@pytest.mark.parametrize("images, parameters, status, code", [
    ([b"this is not an image"], {}, "415", "unsupported_format"),
    ([b"\x89PNG\r\n\x1a\n" + b"\x00" * 40], {}, "400", "undecodable_image"),
    ([b"", b""], {}, "400", "empty_body"),
    ([b"x"], {"top_k": 21}, "422", "invalid_parameter"),
    ([b"x"], {"deadline_ms": "soon"}, "422", "invalid_parameter"),
    ([b"x"], {"priority": 7}, "422", "invalid_parameter"),
    ([b"x"] * 17, {}, "422", "invalid_parameter"),
], ids=["not-an-image", "broken-png", "empty", "top-k", "deadline", "priority", "over-batch-limit"])
def test_bad_requests_are_protocol_errors_with_rampart_status(client, images, parameters, status, code):
    with pytest.raises(InferenceServerException) as failure:
        rest = {key: value for key, value in parameters.items() if key != "priority"}  # a reserved name there
        client.infer(oip.MODEL_NAME, [image_input(images, True)], parameters=rest,
                     priority=parameters.get("priority", 0))
    assert failure.value.status() == status and failure.value.message().startswith(f"{code}: ")


def test_bentoml_client_answers_as_classify(server, http, tmp_path):
    jpeg = encode(photo("coffee"))
    (tmp_path / "coffee.jpg").write_bytes(jpeg)
    (tmp_path / "junk.jpg").write_bytes(b"not an image")
    expected = classify(http, jpeg)
    with bentoml.SyncHTTPClient(server.url, timeout=60) as bento:
        bento.client.headers["X-Deadline-Ms"] = str(DEADLINE_MS)  # the client's own httpx.Client
        got = bento.classify(tmp_path / "coffee.jpg")
        with pytest.raises(bentoml.exceptions.BentoMLException) as failure:
            bento.classify(tmp_path / "junk.jpg")

    async def call_async() -> dict:
        async with bentoml.AsyncHTTPClient(server.url, timeout=60) as bento_async:
            bento_async.client.headers["X-Deadline-Ms"] = str(DEADLINE_MS)
            return await bento_async.classify(tmp_path / "coffee.jpg")

    got_async = asyncio.run(call_async())
    for answer_ in (got, got_async):
        assert answer_["labels"] == expected["labels"] and answer_["model"] == expected["model"]
        assert answer_["degraded_reason"] == expected["degraded_reason"] is None
    direct = http.post("/classify", content=b"not an image")
    assert failure.value.error_code == direct.status_code == 415
    assert json.loads(str(failure.value))["error"]["code"] == direct.json()["error"]["code"] == "unsupported_format"


def test_docs_show_the_bentoml_api_with_its_error_table(http):
    spec = http.get("/docs.json").json()
    operation = spec["paths"]["/bentoml/classify"]["post"]
    assert operation["x-bentoml-name"] == "classify"
    assert set(operation["responses"]["200"]["content"]["application/json"]["schema"]["required"]) >= {
        "labels", "model", "degraded", "degraded_reason", "timings_ms"}
    for error in ERROR_CLASSES:
        assert f"| {error.status} | `{error.code}` |" in operation["description"]
