"""Start-up and graceful drain on one real server: probed from the moment it listens, then SIGTERMed.

The server is this module's own (it is killed by the drain test), with a short
``max_deadline_ms`` so the drain's bound is short too.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import uuid

import httpx
import pytest

from rampart.api.lifecycle import RUNNER_EXIT_MARGIN_S
from bench.harness import START_TIMEOUT_S, Replica
from bench.loadgen import load_bodies, unique
from tests.support import PHOTOS, SLACK_MS, encode, photo, server_timing

MAX_DEADLINE_MS = 6000
#: Raw uploads and 4-image batch uploads in flight when SIGTERM arrives.
DRAIN_UPLOADS, DRAIN_BATCHES, BATCH_IMAGES = 16, 4, 4
#: Answers that come from no model run now: the models failed or were gone.
NO_MODEL = {"no_model_available", "cached_result"}


@pytest.fixture(scope="module")
def fresh_server(tmp_path_factory):
    """A server just started (not waited for), with ``max_deadline_ms`` = ``MAX_DEADLINE_MS``."""
    server = Replica("serve", tmp_path_factory.mktemp("lifecycle"), {"RAMPART_MAX_DEADLINE_MS": str(MAX_DEADLINE_MS)})
    yield server
    server.stop()


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def answered_by_a_model(body: dict) -> bool:
    """A result with labels computed by one of the two models for this request."""
    return (bool(body.get("labels")) and body.get("degraded_reason") not in NO_MODEL
            and body.get("model", {}).get("name") in ("rampart-primary", "rampart-fallback"))


def assert_json_503(response: httpx.Response, code: str) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == code, response.text
    assert 1 <= int(response.headers["retry-after"]) <= 5


def test_requests_from_the_moment_it_listens_never_get_a_200_without_labels(fresh_server):
    deadline = time.monotonic() + START_TIMEOUT_S
    while not listening(fresh_server.port):
        assert time.monotonic() < deadline and fresh_server.process.poll() is None, fresh_server.log()
        time.sleep(0.02)
    jpeg = encode(photo("chelsea"))
    answers: list[httpx.Response] = []

    async def probe(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            response = await client.post("/classify", content=jpeg)
            answers.append(response)
            if response.status_code == 200:
                return
            await asyncio.sleep(0.25)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=fresh_server.url, timeout=START_TIMEOUT_S) as client:
            await asyncio.gather(*(probe(client) for _ in range(4)))

    asyncio.run(main())
    assert any(r.status_code == 503 for r in answers), "no request arrived before warm-up ended"
    for response in answers:
        if response.status_code == 200:
            assert answered_by_a_model(response.json()), response.text
        elif response.status_code == 429:  # once ready, admission may shed as ever
            assert response.json()["error"]["code"] == "overloaded" and "retry-after" in response.headers
        else:
            assert_json_503(response, "not_ready")
    assert "Rampart ready: both runners warm" in fresh_server.log_path.read_text(errors="replace")


def test_a_fresh_servers_first_answers_one_at_a_time_wait_in_no_batch_queue(fresh_server):
    """BentoML's batch dispatcher trains on its first calls, per bucket route, and upstream holds a lone request
    for a training batch of 2 or 3 (``rampart.compat.bentoml_batching.dispatch_when_free``): six of a fresh
    server's first 70 sequential answers queued 75-116 ms against 44-73 ms of inference. Sequential photos of
    all three buckets: each answer's queue time (Server-Timing) stays under half its own inference time."""
    bodies = load_bodies()
    timings = []
    with httpx.Client(base_url=fresh_server.url, timeout=30) as client:
        for i in range(12 * len(bodies)):  # each bucket route well past the dispatcher's 11 training calls
            response = client.post("/classify", content=unique(bodies[i % len(bodies)]))
            assert response.status_code == 200 and answered_by_a_model(response.json()), response.text
            timing = server_timing(response)
            timings.append((timing["queue"], timing["inference"]))
    held = [(i, queue, inference) for i, (queue, inference) in enumerate(timings) if queue >= 0.5 * inference]
    assert not held, held


def slow_body(head: bytes, tail: bytes, go: asyncio.Event, delay_s: float):
    """A request body: ``head`` at once, ``tail`` in four pieces from ``delay_s`` s after ``go`` is set."""

    async def chunks():
        yield head
        await go.wait()
        await asyncio.sleep(delay_s)
        for i in range(4):
            yield tail[i * len(tail) // 4:(i + 1) * len(tail) // 4]
            await asyncio.sleep(0.1)

    return chunks()


def multipart(images: list[bytes], boundary: str) -> bytes:
    parts = [f"--{boundary}\r\nContent-Disposition: form-data; name=\"images\"; filename=\"{i}.jpg\"\r\n\r\n".encode()
             + data + b"\r\n" for i, data in enumerate(images)]
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def test_sigterm_answers_every_admitted_request_refuses_new_ones_and_exits(fresh_server):
    fresh_server.wait_ready()
    names = sorted(PHOTOS)
    headers = {"X-Deadline-Ms": str(MAX_DEADLINE_MS)}

    async def main():
        go = asyncio.Event()
        async with httpx.AsyncClient(base_url=fresh_server.url, timeout=MAX_DEADLINE_MS / 1000 + 30) as client:
            uploads = []
            for i in range(DRAIN_UPLOADS):
                body = encode(photo(names[i % len(names)]), quality=90 - i)  # distinct bytes: no cache hit
                uploads.append(client.post("/classify", headers=headers,
                                           content=slow_body(body[:100], body[100:], go, 0.1 * (i % 8))))
            for i in range(DRAIN_BATCHES):
                boundary = uuid.uuid4().hex
                body = multipart([encode(photo(names[j]), quality=60 - i) for j in range(BATCH_IMAGES)], boundary)
                uploads.append(client.post(
                    "/classify_batch", content=slow_body(body[:200], body[200:], go, 0.2 * i),
                    headers={**headers, "Content-Type": f"multipart/form-data; boundary={boundary}"}))
            tasks = [asyncio.ensure_future(upload) for upload in uploads]
            in_flight, give_up = 0, time.monotonic() + MAX_DEADLINE_MS / 2000
            while in_flight < len(tasks):  # every request admitted, its body still arriving
                assert time.monotonic() < give_up, f"only {in_flight} of {len(tasks)} requests admitted"
                await asyncio.sleep(0.05)
                in_flight = (await client.get("/stats")).json()["lifecycle"]["in_flight"]
            signalled = time.monotonic()
            fresh_server.process.send_signal(signal.SIGTERM)  # to the arbiter only, as Kubernetes does
            while (await client.get("/readyz")).status_code == 200:
                assert time.monotonic() < signalled + 5, "/readyz still 200 5 s after SIGTERM"
                await asyncio.sleep(0.01)
            late = await client.post("/classify", content=encode(photo("coffee")))
            go.set()
            return signalled, late, await asyncio.gather(*tasks)

    signalled, late, answers = asyncio.run(main())
    assert_json_503(late, "shutting_down")
    for response in answers:
        assert response.status_code == 200, response.text
        body = response.json()
        results = body.get("results", [body])
        for result in results:
            assert answered_by_a_model(result), result
    assert sum(len(r.json().get("results", [1])) for r in answers) == DRAIN_UPLOADS + DRAIN_BATCHES * BATCH_IMAGES
    fresh_server.process.wait(timeout=MAX_DEADLINE_MS / 1000 + RUNNER_EXIT_MARGIN_S + 30)
    exit_s = time.monotonic() - signalled
    log = fresh_server.log_path.read_text(errors="replace")
    assert exit_s <= MAX_DEADLINE_MS / 1000 + SLACK_MS / 1000 + RUNNER_EXIT_MARGIN_S, (exit_s, log[-3000:])
    assert "ClientDisconnect" not in log and "Traceback" not in log, log[-5000:]
