"""Request bounds on a real server: JSON 404/405, bounded metric series, Server-Timing on batches, request-head limit, JSON 400 for what the HTTP parser refuses, trailer fields kept out of the headers, pipelining floods, part bombs answered fast while others are served."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time

import httpx
import pytest

from rampart.compat.uvicorn_httptools import MAX_HEAD_BYTES
from rampart.api.routing import OTHER_ENDPOINT
from tests.support import PHOTOS, encode, photo, server_timing
from tests.support.metrics import scrape
from tests.support.bounds import BOMB_TO_UPLOAD_RATIO, EMPTY_PARTS_BOMB, LIVEZ_BUDGET_MS, MULTIPART, TINY_IMAGES_BOMB, json_error


def test_unknown_paths_and_wrong_methods_get_json_404_and_405(http):
    body = json_error(http.get("/no/such/path", headers={"X-Request-Id": "nf-1"}), 404, "not_found")
    assert body["request_id"] == "nf-1"
    wrong = http.delete("/classify")
    json_error(wrong, 405, "method_not_allowed")
    assert wrong.headers["allow"] == "POST"
    json_error(http.post("/livez"), 405, "method_not_allowed")
    json_error(http.put("/metrics"), 405, "method_not_allowed")
    json_error(http.get("/classify_batch/x"), 404, "not_found")


def test_metric_series_do_not_grow_with_random_paths_and_methods(server, http):
    rng = random.Random(10)
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    wrong_methods = ["PUT", "DELETE", "PATCH"]  # served by none of the known paths
    known = ["/classify", "/classify_batch", "/stats", "/livez", "/readyz", "/metrics", "/healthz"]
    unknown = [lambda: f"/{rng.getrandbits(64):x}", lambda: f"/classify/{rng.getrandbits(32):x}",
               lambda: f"/static_content/{rng.getrandbits(32):x}", lambda: f"{rng.choice(known)}{rng.randint(0, 9)}"]

    def send(method: str, path: str) -> None:
        assert http.request(method, path).status_code in (404, 405), (method, path)

    # One request of each kind first: each may add its one series (endpoint label, status).
    for kind in unknown:
        for method in methods:
            send(method, kind())
    for path in known:
        for method in wrong_methods:
            send(method, path)
    before = set(series(scrape(server)))
    for _ in range(300):
        if rng.random() < 0.8:
            send(rng.choice(methods), rng.choice(unknown)())
        else:
            send(rng.choice(wrong_methods), rng.choice(known))
    after = set(series(scrape(server)))
    assert after == before, {"new": sorted(after - before)[:10], "gone": sorted(before - after)[:10]}
    assert any(dict(labels).get("endpoint") == OTHER_ENDPOINT for _, labels in after)


def test_classify_batch_sends_server_timing(http):
    files = [("images", ("cat.jpg", encode(photo("chelsea")))), ("images", ("junk.bin", b"junk"))]
    response = http.post("/classify_batch", files=files)
    assert response.status_code == 200, response.text
    timing = server_timing(response)
    assert set(timing) == {"decode", "queue", "inference", "total"}
    assert timing["total"] >= timing["inference"] > 0
    assert {label["index"] for label in response.json()["results"][0]["labels"]} & PHOTOS["chelsea"]


@pytest.mark.parametrize("head", [
    b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n",
    b"GET /livez HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(70)) + b"\r\n",
    b"GET /" + b"a" * (MAX_HEAD_BYTES + 1) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
])
def test_request_head_over_the_limit_gets_431_json(server, head):
    for piece in (len(head), 1000):  # in one write and trickled in pieces
        reply = send_raw(server, head, piece)
        assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
        assert b'"code":"headers_too_large"' in reply and b"application/json" in reply


@pytest.mark.parametrize("request_bytes", [
    b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"post /classify HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    b"GET /livez HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /livez HTTP/1.1\r\nHost x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS ClientHello on the plain port
], ids=["negative_length", "repeated_length", "length_and_chunked", "bad_chunk_size", "lower_case_method",
        "unknown_version", "header_without_colon", "tls_hello"])
def test_bytes_the_http_parser_refuses_get_a_json_400_and_the_next_request_is_served(server, http, request_bytes):
    reply = send_raw(server, request_bytes, len(request_bytes))
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:300]
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head and b"connection: close" in head, head
    assert b'"code":"malformed_request"' in body and b'"request_id"' in body, body
    answer = http.post("/classify", content=encode(photo("coffee")))
    assert answer.status_code == 200 and answer.json()["labels"], answer.text


@pytest.mark.parametrize("upgrade", [
    b"h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
    b"foo/1\r\nConnection: Upgrade",
    # No route serves a WebSocket: the handshake got an empty 403 (400 without its key) from uvicorn's WebSocket side.
    b"websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13",
    b"websocket\r\nConnection: Upgrade",
], ids=["h2c", "unknown", "websocket", "websocket-without-key"])
def test_an_upgrade_to_a_protocol_not_served_gets_a_json_400_and_the_connection_closes(server, http, upgrade):
    """llhttp stops parsing at the end of an upgrade request's head: answered as if its body were empty, the
    request after it on the connection went unread. Now one JSON 400 and a close; a new connection is served."""
    body = encode(photo("coffee"))
    first = b"POST /classify HTTP/1.1\r\nHost: x\r\nUpgrade: " + upgrade + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    second = b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    reply = send_raw(server, first + body + second + body, 1 << 20)
    assert reply.startswith(b"HTTP/1.1 400 ") and reply.count(b"HTTP/1.1 ") == 1, reply[:300]
    head, _, answer = reply.partition(b"\r\n\r\n")
    assert b"connection: close" in head and b'"code":"malformed_request"' in answer, reply[:300]
    assert http.post("/classify", content=body).json()["labels"]


def test_request_head_under_the_limit_is_served(http):
    headers = {f"X-{i}": "a" * 1000 for i in range(MAX_HEAD_BYTES // 1100)}
    assert http.get("/livez", headers=headers).status_code == 200
    assert http.post("/classify", content=encode(photo("coffee")), headers=headers).status_code == 200


def test_trailer_fields_after_a_chunked_upload_are_not_read_as_headers(server):
    """A photo sent chunked, in one write, whose trailer says ``X-Deadline-Ms: 1``, ``X-Priority: bogus`` and
    ``X-Request-Id``: the photo is classified as if there were no trailer (they gave a 422 and the trailer's id)."""
    photo_bytes = encode(photo("chelsea"))
    request = (b"POST /classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               + b"%x\r\n" % len(photo_bytes) + photo_bytes + b"\r\n0\r\n"
               + b"X-Deadline-Ms: 1\r\nX-Priority: bogus\r\nX-Request-Id: from-trailer\r\n\r\n")
    reply = send_raw(server, request, len(request))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:600]
    answer = json.loads(body)
    assert answer["request_id"] != "from-trailer" and answer["degraded_reason"] is None, answer
    assert {label["index"] for label in answer["labels"]} & PHOTOS["chelsea"], answer


#: Growth of the API worker's RSS while 20 connections pipeline 256 KiB of ``GET /livez`` each and never read:
#: the queued requests of MAX_PIPELINED_REQUESTS a connection. With every request of a read queued, 50 such
#: connections raised it by about 900 MB; with the bound, by 11 MB.
PIPELINE_FLOOD_RSS_GROWTH_BOUND_MB = 100


def test_a_pipelining_flood_costs_no_memory_and_livez_and_a_photo_are_answered_during_it(server):
    """20 connections each write 256 KiB of pipelined ``GET /livez`` (about 6,500 requests each) and never read
    their answers: meanwhile ``/livez`` answers and a photo is classified by the primary."""
    import psutil

    from bench.process_cpu import server_processes

    (api,) = [process for role, process in server_processes(server.process.pid).values() if role == "api"]
    baseline = api.memory_info().rss
    flood = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n" * (256 * 1024 // 38)
    sockets = []
    for _ in range(20):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.setblocking(False)
        sockets.append([sock, 0])
    peak, livez_ok, started = baseline, 0, time.monotonic()
    try:
        while time.monotonic() - started < 3.0:
            for entry in sockets:
                try:
                    entry[1] += entry[0].send(flood[entry[1]:]) if entry[1] < len(flood) else 0
                except (BlockingIOError, ConnectionError):
                    pass
            with contextlib.suppress(psutil.Error):
                peak = max(peak, api.memory_info().rss)
            livez_ok += httpx.get(f"{server.url}/livez", timeout=5).status_code == 200
            time.sleep(0.05)
        answer = httpx.post(f"{server.url}/classify", content=encode(photo("chelsea")), timeout=30).json()
    finally:
        for entry in sockets:
            entry[0].close()
    assert (peak - baseline) / 1e6 < PIPELINE_FLOOD_RSS_GROWTH_BOUND_MB, f"API worker RSS grew by {(peak - baseline) / 1e6:.0f} MB"
    assert livez_ok >= 10 and sum(entry[1] for entry in sockets) > 0
    assert answer["degraded_reason"] is None and {label["index"] for label in answer["labels"]} & PHOTOS["chelsea"], answer


def test_part_bombs_get_fast_4xx_while_livez_and_ordinary_requests_are_served(server):
    """Run under the load lock: 2 million empty parts to /classify, 100,000 tiny parts to /classify_batch."""
    stop, livez_ms, ordinary = threading.Event(), [], []

    def probe_livez() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                assert client.get("/livez").status_code == 200
                livez_ms.append((time.perf_counter() - started) * 1000)
                time.sleep(0.01)

    def post(client: httpx.Client, path: str, body: bytes, headers: dict) -> tuple[float, httpx.Response]:
        started = time.perf_counter()
        response = client.post(path, content=body, headers=headers)
        return time.perf_counter() - started, response

    prober = threading.Thread(target=probe_livez)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.post("/classify", content=encode(photo("coffee")))  # warm the connection and the paths
        prober.start()
        try:
            for path, bomb in (("/classify", EMPTY_PARTS_BOMB), ("/classify_batch", TINY_IMAGES_BOMB)):
                plain = min(post(client, "/classify", b"\x00" * len(bomb), {})[0] for _ in range(2))  # 415 after the read
                ordinary_reply: list[httpx.Response] = []
                sender = threading.Thread(target=lambda: ordinary_reply.append(httpx.post(
                    f"{server.url}/classify", content=encode(photo("chelsea")), headers={"X-Deadline-Ms": "5000"},
                    timeout=30)))
                sender.start()
                took = []
                for _ in range(2):
                    seconds, response = post(client, path, bomb, MULTIPART)
                    json_error(response, 413, "too_many_parts")
                    took.append(seconds)
                sender.join()
                ordinary.append(ordinary_reply[0])
                assert min(took) <= BOMB_TO_UPLOAD_RATIO * plain, (path, took, plain)
        finally:
            stop.set()
            prober.join()
    assert [r.status_code for r in ordinary] == [200, 200], [r.text[:200] for r in ordinary]
    assert all({label["index"] for label in r.json()["labels"]} & PHOTOS["chelsea"] for r in ordinary)
    assert len(livez_ms) >= 5 and max(livez_ms) < LIVEZ_BUDGET_MS, sorted(livez_ms)[-5:]


def series(samples: dict) -> list[tuple[str, tuple]]:
    return [(name, labels) for name, values in samples.items() for labels in values]


def send_raw(server, data: bytes, piece: int) -> bytes:
    """Send ``data`` in ``piece``-byte writes on a raw connection; the reply (the server may close early)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        try:
            for start in range(0, len(data), piece):
                sock.sendall(data[start:start + piece])
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply
