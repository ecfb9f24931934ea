"""Benign damage on a real server: classified like the undamaged photo, missing pixels refused, the repair shown by the SDK and CLI."""

from __future__ import annotations

import json
import time
import subprocess
import sys

import httpx
import pytest

from rampart.inputs import recovery
from tests.support import ROOT, logged_lines
from tests.support.metrics import scrape, total
from tests.support.damage import BENIGN, ORIGINALS, TRUNCATED, original


def test_server_classifies_every_benign_fault_like_the_undamaged_photo(server):
    """200 with the undamaged photo's top-1; warnings in the answer, the metric and one access-log line each."""
    before = scrape(server)
    answers: list[dict] = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        expected_top1 = {}
        for name in ORIGINALS:
            answer = primary_answer(client, original(name), f"undamaged-{name}", answers)
            assert answer["input_warnings"] == []
            expected_top1[name] = top1(answer)
        for index, (name, fault, damage, warnings) in enumerate(BENIGN):
            answer = primary_answer(client, damage(original(name)), f"benign-damage-{index}", answers)
            assert top1(answer) == expected_top1[name], (name, fault, answer)
            assert answer["input_warnings"] == list(warnings), (name, fault)
    after = scrape(server)
    for warning in recovery.INPUT_WARNINGS:
        received = sum(warning in answer["input_warnings"] for answer in answers)
        grew = total(after, "rampart_input_warnings_total", warning=warning) - total(
            before, "rampart_input_warnings_total", warning=warning)
        assert grew == received, (warning, grew, received)
    log = [json.loads(line) for line in logged_lines(
        server, '"benign-damage-', count=sum(a["request_id"].startswith("benign-damage-") for a in answers))]
    for index, (_, _, _, warnings) in enumerate(BENIGN):
        sent = sum(answer["request_id"] == f"benign-damage-{index}" for answer in answers)
        lines = [line for line in log if line["request_id"] == f"benign-damage-{index}"]
        assert len(lines) == sent and all(line["input_warnings"] == list(warnings) for line in lines)


def test_server_refuses_missing_pixel_data_with_corrupt_image(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, data in TRUNCATED:
            response = client.post("/classify", content=data)
            assert response.status_code == 400 and response.json()["error"]["code"] == "corrupt_image", name


def test_sdk_and_cli_show_the_repair(server, tmp_path):
    from rampart_client import Client

    damaged = original("jpeg")[:-2]
    with Client(server.url) as client:
        assert client.classify(damaged, deadline_ms=30_000).input_warnings == ["jpeg_missing_eoi"]
    path = tmp_path / "no-eoi.jpg"
    path.write_bytes(damaged)
    out = subprocess.run([sys.executable, "-m", "rampart_client", "classify", str(path), "--url", server.url,
                          "--deadline-ms", "30000"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "(repaired: jpeg_missing_eoi)" in out.stdout, out


def top1(answer: dict) -> int:
    return answer["labels"][0]["index"]


def primary_answer(client: httpx.Client, data: bytes, request_id: str, answers: list[dict]) -> dict:
    """The primary's 200 answer for ``data``, retried (at most 10 times) while an earlier test's load keeps
    the primary's breaker open, so that damaged and undamaged photos are compared on the same model.
    Every answer received is appended to ``answers``."""
    for _ in range(10):
        response = client.post("/classify", content=data, headers={"X-Deadline-Ms": "30000", "X-Request-Id": request_id})
        assert response.status_code == 200, (request_id, response.text)
        answers.append(response.json())
        if not response.json()["degraded"]:
            return response.json()
        time.sleep(1.0)
    pytest.fail(f"the primary did not answer {request_id} in 10 tries: {response.json()}")
