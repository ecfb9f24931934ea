"""The Python SDK and its CLI against a real server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from PIL import Image

from rampart_client import AsyncClient, Client, ImageRejected, Prediction, ServiceError
from tests.support import PHOTOS, ROOT, encode, photo


def test_sync_client_accepts_path_bytes_and_pil(server, tmp_path):
    path = tmp_path / "cat.jpg"
    path.write_bytes(encode(photo("chelsea")))
    with Client(server.url) as client:
        for image in (path, str(path), path.read_bytes(), Image.fromarray(photo("chelsea"))):
            prediction = client.classify(image, top_k=3)
            assert isinstance(prediction, Prediction)
            assert {label.index for label in prediction.labels} & PHOTOS["chelsea"]
            assert not prediction.degraded and prediction.top.score >= prediction.labels[-1].score
            timings = prediction.timings_ms  # every stage the server sends, before_handler included
            assert timings.before_handler is not None and timings.before_handler >= 0
            assert timings.total == pytest.approx(timings.decode + timings.queue + timings.inference, abs=0.01)


def test_async_client_classifies_concurrently(server):
    async def run():
        async with AsyncClient(server.url) as client:
            return await asyncio.gather(*(client.classify(encode(photo(n)), deadline_ms=5000) for n in sorted(PHOTOS)))

    for name, prediction in zip(sorted(PHOTOS), asyncio.run(run())):
        assert {label.index for label in prediction.labels[:3]} & PHOTOS[name]


def test_client_raises_typed_errors(server):
    with Client(server.url) as client:
        with pytest.raises(ImageRejected) as rejected:
            client.classify(b"not an image")
        assert rejected.value.code == "unsupported_format" and rejected.value.status == 415
        with pytest.raises(ImageRejected) as bad_param:
            client.classify(encode(photo("chelsea")), top_k=50)
        assert bad_param.value.code == "invalid_parameter"
        with pytest.raises(ImageRejected, match="X-Priority") as bad_priority:
            client.classify(encode(photo("chelsea")), priority="urgent")
        assert bad_priority.value.status == 422
        assert client.classify(encode(photo("chelsea")), priority="high").labels
    with Client("http://127.0.0.1:9", timeout=2) as nowhere:
        with pytest.raises(ServiceError):
            nowhere.classify(encode(photo("chelsea")))


def test_client_batch_keeps_errors_in_place(server):
    with Client(server.url) as client:
        results = client.classify_batch([encode(photo("coffee")), b"\x00\x01junk"], top_k=3)
    assert isinstance(results[0], Prediction) and {label.index for label in results[0].labels} & PHOTOS["coffee"]
    assert isinstance(results[1], ImageRejected) and results[1].code == "unsupported_format"


def test_cli_prints_top_labels(server, tmp_path):
    path = tmp_path / "coffee.png"
    path.write_bytes(encode(photo("coffee"), "PNG"))
    out = subprocess.run(
        [sys.executable, "-m", "rampart_client", "classify", str(path), "--url", server.url, "--top-k", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "espresso" in out.stdout and "rampart-primary" in out.stdout


def test_cli_prints_json_with_the_answer_and_each_failure_in_place(server, tmp_path):
    path = tmp_path / "coffee.jpg"
    path.write_bytes(encode(photo("coffee")))
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"\x00\x01 not an image")
    out = subprocess.run(
        [sys.executable, "-m", "rampart_client", "classify", str(path), str(junk), "--url", server.url, "--top-k", "2",
         "--deadline-ms", "30000", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1, out.stderr  # one image failed
    answered, refused = json.loads(out.stdout)
    assert answered["image"] == str(path) and len(answered["prediction"]["labels"]) == 2
    assert {label["index"] for label in answered["prediction"]["labels"]} & PHOTOS["coffee"]
    assert Prediction.model_validate(answered["prediction"]).model.name == "rampart-primary"
    assert refused == {"image": str(junk), "error": {"type": "ImageRejected", "status": 415,
                                                     "code": "unsupported_format", "message": refused["error"]["message"]}}
