"""The Open Inference Protocol on a real server, through tritonclient and BentoML's own client."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import time
import zlib

import bentoml
import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from rampart.api import oip
from rampart.config import Settings
from rampart.errors import ERROR_CLASSES
from tests.support import PHOTOS, ROOT, encode, photo
from tests.support.bounds import concurrent_posts_with_peak_rss_growth
from tests.support.oip import DEADLINE_MS, HOSTILE, image_input, texts


@pytest.fixture(scope="module")
def client(server):
    with triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60) as client:
        yield client


def test_health_metadata_and_config(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(oip.MODEL_NAME)
    assert not client.is_model_ready("resnet50")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    metadata = client.get_model_metadata(oip.MODEL_NAME)
    assert {t["name"]: (t["datatype"], t["shape"]) for t in metadata["inputs"]} == {
        oip.IMAGE: ("BYTES", [-1, 1]), oip.PIXELS: ("UINT8", [-1, -1, -1, 3])}
    assert {t["name"]: t["datatype"] for t in metadata["outputs"]} == oip.OUTPUT_DATATYPES
    config = client.get_model_config(oip.MODEL_NAME, model_version=metadata["versions"][0])
    assert config["max_batch_size"] == 16 and config["dynamic_batching"]["priority_levels"] == 3
    assert {t["name"]: t["dims"] for t in config["input"]} == {oip.IMAGE: [1], oip.PIXELS: [-1, -1, 3]}
    assert config["parameters"]["primary_model"]["string_value"].startswith("rampart-primary:")
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("rampart-typo")
    assert unknown.value.status() == "404"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_gives_the_labels_of_classify(client, http, binary):
    names = sorted(PHOTOS)
    images = [encode(photo(name)) for name in names]
    expected_answers = [classify(http, image, top_k=3) for image in images]
    outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in oip.OUTPUT_DATATYPES]
    result = client.infer(oip.MODEL_NAME, [image_input(images, binary)], outputs=outputs,
                          parameters={"top_k": 3, "deadline_ms": DEADLINE_MS})
    parameters = result.get_response()["parameters"]
    assert texts(result.as_numpy(oip.DEGRADED_REASON)) == [[""]] * len(names)  # one element per image
    assert result.as_numpy(oip.NEEDS_REVIEW).tolist() == [[False]] * len(names)
    indices, scores = result.as_numpy(oip.CLASS_INDICES), result.as_numpy(oip.SCORES)
    assert indices.shape == scores.shape == result.as_numpy(oip.LABELS).shape == (len(names), 3)
    for row, (name, expected) in enumerate(zip(names, expected_answers)):
        assert texts(result.as_numpy(oip.MODEL))[row] == [expected["model"]["name"]]
        assert texts(result.as_numpy(oip.ROUTE))[row] == [expected["route"]]
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


def classify(http, data: bytes, top_k: int = 5) -> dict:
    response = http.post("/classify", content=data, params={"top_k": top_k}, headers={"X-Deadline-Ms": str(DEADLINE_MS)})
    assert response.status_code == 200, response.text
    return response.json()


def test_every_tritonclient_call_a_user_makes(client):
    """The calls of tritonclient's examples, in a user's order, each answered in a form tritonclient reads."""
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(oip.MODEL_NAME) and client.is_model_ready(oip.MODEL_NAME, oip.MODEL_VERSION)
    assert set(client.get_server_metadata()["extensions"]) >= {"binary_tensor_data", "statistics"}
    assert client.get_model_metadata(oip.MODEL_NAME)["versions"] == [oip.MODEL_VERSION]
    assert client.get_model_config(oip.MODEL_NAME)["name"] == oip.MODEL_NAME
    assert client.get_model_repository_index() == [
        {"name": oip.MODEL_NAME, "version": oip.MODEL_VERSION, "state": "READY"}]
    before = client.get_inference_statistics(oip.MODEL_NAME)["model_stats"][0]
    jpeg = encode(photo("coffee"))
    by_bytes = client.infer(oip.MODEL_NAME, [image_input([jpeg], True)], parameters={"deadline_ms": DEADLINE_MS})
    pixels = photo("coffee")
    tensor = triton.InferInput(oip.PIXELS, [1, *pixels.shape], "UINT8")
    tensor.set_data_from_numpy(pixels[None])
    by_pixels = client.infer(oip.MODEL_NAME, [tensor], parameters={"deadline_ms": DEADLINE_MS})
    for result in (by_bytes, by_pixels):
        assert set(result.as_numpy(oip.CLASS_INDICES)[0, :3].tolist()) & PHOTOS["coffee"]
        assert texts(result.as_numpy(oip.DEGRADED_REASON)) == [[""]]
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("resnet50", [image_input([jpeg], True)])
    assert unknown.value.status() == "404" and "unknown model 'resnet50'" in unknown.value.message()
    with pytest.raises(InferenceServerException) as unloadable:
        client.load_model(oip.MODEL_NAME)  # the repository is read only: a protocol error, not a crash
    assert unloadable.value.status() == "404" and isinstance(unloadable.value.message(), str)
    after = client.get_inference_statistics(oip.MODEL_NAME)["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] >= 2  # this worker's; one API worker by default
    assert after["inference_stats"]["success"]["count"] > before["inference_stats"]["success"]["count"]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_request_compression_is_accepted(client, http, algorithm):
    images = [encode(photo("chelsea")), encode(photo("rocket"))]
    result = client.infer(oip.MODEL_NAME, [image_input(images, True)], parameters={"deadline_ms": DEADLINE_MS},
                          request_compression_algorithm=algorithm)
    for row, (image, name) in enumerate(zip(images, ("chelsea", "rocket"))):
        assert result.as_numpy(oip.CLASS_INDICES)[row].tolist() == [
            label["index"] for label in classify(http, image)["labels"]]
        assert set(result.as_numpy(oip.CLASS_INDICES)[row, :3].tolist()) & PHOTOS[name]
    refused = http.post("/v2/models/rampart/infer", content=b"{}", headers={"Content-Encoding": "br"})
    assert refused.status_code == 415 and refused.json()["error"].startswith("unsupported_format: ")


@functools.cache
def inflating_binary_body(size_mib: int) -> tuple[bytes, str]:
    """A gzip ``/infer`` body of the binary extension whose binary part inflates to ``size_mib`` MiB of spaces
    (about 1,000:1), and its ``Inference-Header-Content-Length``."""
    header = json.dumps({"inputs": [{"name": oip.IMAGE, "datatype": "BYTES", "shape": [1, 1],
                                     "parameters": {"binary_data_size": size_mib << 20}}]}).encode()
    compressor, spaces = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), b" " * (1 << 20)
    return b"".join([compressor.compress(header), *(compressor.compress(spaces) for _ in range(size_mib)),
                     compressor.flush()]), str(len(header))


@pytest.mark.parametrize("path", oip.INFER_PATHS, ids=["unversioned", "versioned"])
def test_compressed_bodies_inflating_together_stay_within_the_worker_budget_of_body_bytes(server, http, path):
    """Four concurrent gzip bodies of about 300 KiB, each inflating to 300 MiB (under the request cap): of bodies
    growing together the oldest completes (a 4xx for its content), the others get 429 once the worker's bodies
    would pass the budget, and the server tree grows by about the budget, not by four bodies and their copies
    (1.8 GB of one API worker before the budget)."""
    budget_mib = Settings().inputs.max_held_body_bytes / 2**20
    body, header_length = inflating_binary_body(300)
    headers = {"Content-Encoding": "gzip", oip.HEADER_LENGTH: header_length,
               "Content-Type": "application/octet-stream", "X-Deadline-Ms": "10000"}
    responses, growth_mb = concurrent_posts_with_peak_rss_growth(server, [body] * 4, path, headers)
    statuses = [response.status_code for response in responses]
    completed = [status for status in statuses if status != 429]
    assert statuses.count(429) == 3 and len(completed) == 1 and 400 <= completed[0] < 500, [r.text for r in responses]
    assert all("MAX_HELD_BODY_BYTES" in r.json()["error"] for r in responses if r.status_code == 429)
    assert growth_mb * 1e6 / 2**20 < 1.25 * budget_mib, f"RSS grew by {growth_mb:.0f} MB"
    assert http.post("/classify", content=encode(photo("chelsea"))).status_code == 200


#: A handful of the hostile bodies of the unit tests, sent to a real server.
SERVER_HOSTILE = ["shape-30-digits", "pixel-1e300", "parameters-list", "tensor-parameters-string",
                  "data-nested-500", "header-length-arabic-digits", "nan-parameter", "top-k-1e300"]


def test_hostile_bodies_get_protocol_errors_and_the_worker_answers_after(http):
    for name in SERVER_HOSTILE:
        body, header_length = HOSTILE[name]
        headers = {} if header_length is None else {oip.HEADER_LENGTH: header_length.encode()}
        response = http.post("/v2/models/rampart/infer", content=body, headers=headers)
        assert 400 <= response.status_code < 500 and isinstance(response.json()["error"], str), (name, response.text)
    many = b'{"inputs":[{"name":"IMAGE","datatype":"BYTES","shape":[2000000],"data":[' + b",".join(
        [b'""'] * 2_000_000) + b"]}]}"
    refused = http.post("/v2/models/rampart/infer", content=many)
    assert refused.status_code == 413 and refused.json()["error"].startswith("payload_too_large: ")
    for method, path in (("GET", "/v2/models/rampart/infer"), ("GET", "/v2/no/such/thing")):
        response = http.request(method, path)
        assert response.status_code in (404, 405) and isinstance(response.json()["error"], str), response.text
    assert classify(http, encode(photo("chelsea")))["model"]["name"] == "rampart-primary"


PERF_ANALYZER = ROOT / ".perf-analyzer" / "perf_analyzer"


@pytest.mark.parametrize("inputs", ["inputs.json", "pixels.json"])
def test_perf_analyzer_drives_v2_without_errors(server, client, inputs):
    """perf_analyzer as docs/oip.md runs it: a few seconds at concurrency 1 and 2, its table free of errors."""
    if not PERF_ANALYZER.exists():
        pytest.skip("perf_analyzer is not installed: run `make perf-analyzer` (make test runs it)")
    failed_before = client.get_inference_statistics(oip.MODEL_NAME)["model_stats"][0]["inference_stats"]["fail"]
    run = subprocess.run(
        [str(PERF_ANALYZER), "-u", server.url.removeprefix("http://"), "-i", "http", "-m", oip.MODEL_NAME,
         "--input-data", str(ROOT / "bench" / "perf_analyzer" / inputs), "--concurrency-range", "1:2",
         "--measurement-interval", "1000", "--stability-percentage", "999", "--max-trials", "10"],
        capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    table = output.split("Inferences/Second vs. Client Average Batch Latency")[1].strip().splitlines()
    assert [line.split(",")[0] for line in table] == ["Concurrency: 1", "Concurrency: 2"], output
    assert all(float(line.split("throughput: ")[1].split()[0]) > 0 for line in table), output
    assert "error" not in output.lower() and "failed" not in output.lower(), output
    failed_after = client.get_inference_statistics(oip.MODEL_NAME)["model_stats"][0]["inference_stats"]["fail"]
    assert failed_after["count"] == failed_before["count"], "perf_analyzer's requests were refused"


def test_a_json_body_slow_to_parse_is_parsed_in_a_decode_worker_and_leaves_the_event_loop_free(server):
    """Gzip of a few dozen KB that inflates to JSON of half a million long floats, inside every cap: parsed in a
    thread of the API worker it held the GIL, and the event loop with it, for the whole parse (0.75-0.85 s for a
    million). Parsed in a decode worker, ``/livez`` keeps answering meanwhile: its slowest answer during the
    request is compared with the request's own time, in the same run."""
    floats = b",".join([b"1.2345678901234567e-300"] * 500_000)
    body = zlib.compress(b'{"parameters": {"x": [' + floats + b']}, "inputs": []}', 9)
    headers = {"Content-Type": "application/json", "Content-Encoding": "deflate", "X-Deadline-Ms": "20000"}

    async def scenario() -> tuple[httpx.Response, float, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            started = time.monotonic()
            infer = asyncio.create_task(client.post("/v2/models/rampart/infer", content=body, headers=headers))
            slowest = 0.0
            while not infer.done():
                asked = time.monotonic()
                assert (await client.get("/livez")).status_code == 200
                slowest = max(slowest, time.monotonic() - asked)
                await asyncio.sleep(0.01)
            return await infer, time.monotonic() - started, slowest

    response, took_s, livez_s = asyncio.run(scenario())
    assert response.status_code == 422 and "no input" in response.json()["error"], response.text
    assert livez_s <= 0.3 * took_s, f"/livez took up to {livez_s:.3f} s during a request of {took_s:.3f} s"
