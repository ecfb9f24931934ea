"""Hostile connections on one real server with short connection timeouts (docs/connections.md): a mass hang-up,
slow bodies beyond the in-flight bound, idle and trickled connections, a scrape storm. Every input is built here."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.server.test_observability import scrape, total
from tests.support import encode, photo

#: Short timeouts, so the module is quick; the defaults are in docs/connections.md.
HEAD_TIMEOUT_MS = 1000
KEEP_ALIVE_TIMEOUT_MS = 1000
BODY_RATE_GRACE_MS = 1000
#: Room beyond a timeout for the server to act and the test to see it, on a shared 2-core host.
CLOSE_SLACK_S = 3.0


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(RAMPART_HEAD_TIMEOUT_MS=HEAD_TIMEOUT_MS, RAMPART_KEEP_ALIVE_TIMEOUT_MS=KEEP_ALIVE_TIMEOUT_MS,
                        RAMPART_BODY_RATE_GRACE_MS=BODY_RATE_GRACE_MS)


def raw_upload(body: bytes, deadline_ms: int, declared: int | None = None) -> bytes:
    """A raw ``POST /classify`` head (Content-Length ``declared``, default the body's) and ``body``."""
    return (b"POST /classify HTTP/1.1\r\nHost: rampart\r\nContent-Type: image/jpeg\r\nX-Deadline-Ms: %d\r\n"
            b"Content-Length: %d\r\n\r\n" % (deadline_ms, len(body) if declared is None else declared)) + body


def connect(server, timeout_s: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (b"" on a reset)."""
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except ConnectionResetError:
        pass
    return reply


def status_of(reply: bytes) -> int | None:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else None


def ordinary(server, deadline_ms: int = 2000) -> httpx.Response:
    return httpx.post(f"{server.url}/classify", content=encode(photo("coffee")),
                      headers={"X-Deadline-Ms": str(deadline_ms)}, timeout=30)


def test_a_mass_hang_up_gives_every_place_back_and_the_primary_answers_the_next_upload(server):
    """300 uploads with long deadlines sent raw, then their clients close: the decode queue, the models' gates and
    the in-flight count are empty within a second (100 ms on a quiet host; without the fix over a hundred stayed
    in flight for seconds), and an ordinary upload is the primary's full answer as soon as the model has finished
    what it had already been sent."""
    assert ordinary(server).status_code == 200
    before = scrape(server)
    request = raw_upload(encode(photo("chelsea")), 30_000)
    sockets = [connect(server) for _ in range(300)]
    for sock in sockets:
        sock.sendall(request)
    time.sleep(0.3)  # the server has read them: they wait for decoders, in the gates, at the models
    loaded = httpx.get(f"{server.url}/stats", timeout=30).json()
    for sock in sockets:
        sock.close()
    for _ in range(10):  # every 100 ms for a second: empty at the first look on a quiet host
        time.sleep(0.1)
        stats = httpx.get(f"{server.url}/stats", timeout=30).json()
        if stats["lifecycle"]["in_flight"] == stats["decode_pending"] == stats["primary"]["queued"] == 0:
            break
    # What the gate had already dispatched (at most its window) is the model's to finish: wait for that.
    for _ in range(100):
        if total(scrape(server), "rampart_inflight_batches", model="primary") == 0:
            break
        time.sleep(0.1)
    answer = ordinary(server, 1000)
    gone = {stage: total(scrape(server), "rampart_client_gone_total", stage=stage)
            - total(before, "rampart_client_gone_total", stage=stage) for stage in ("body", "decode", "queue", "model")}
    busy = loaded["lifecycle"]["in_flight"]
    assert busy > 50, loaded["lifecycle"]  # the hang-up did hold places
    assert stats["lifecycle"]["in_flight"] == 0 and stats["decode_pending"] == 0, (stats["lifecycle"], stats)
    assert stats["primary"]["queued"] == stats["fallback"]["queued"] == 0, stats
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["degraded"] is False and body["model"]["name"] == "rampart-primary", (body["degraded_reason"], body)
    assert sum(gone.values()) >= busy // 2 and gone["decode"] + gone["queue"] > 0, gone


def test_slow_bodies_beyond_the_in_flight_bound_cannot_shed_ordinary_uploads(server):
    """More slow bodies (10 bytes, then nothing) than the in-flight bound: ordinary uploads are answered 200, and
    every slow body gets 408 (too slow) or 429 (no body place) and its connection closed, within the grace period."""
    limit = httpx.get(f"{server.url}/stats", timeout=30).json()["inflight_limit"]
    head = raw_upload(b"0123456789", 60_000, declared=100_000)
    slow = [connect(server) for _ in range(limit + 20)]
    started = time.monotonic()
    for sock in slow:
        sock.sendall(head)
    time.sleep(0.7)  # all arrived, the first ones old enough to give their place up
    front = httpx.get(f"{server.url}/stats", timeout=30).json()["connections"]
    assert 0 < front["receiving"] <= front["receiving_limit"] < limit and front["in_flight"] < limit, front
    answers = [ordinary(server, 5000) for _ in range(5)]
    assert [a.status_code for a in answers] == [200] * 5, [a.text[:200] for a in answers]
    assert all(a.json()["degraded"] is False for a in answers)
    statuses = []
    for sock in slow:
        sock.settimeout(max(0.1, started + BODY_RATE_GRACE_MS / 1000 + CLOSE_SLACK_S - time.monotonic()))
        try:
            reply = read_until_closed(sock)
        except socket.timeout:
            reply = b"still open"
        statuses.append(status_of(reply) or reply[:40])
        sock.close()
    assert set(statuses) <= {408, 429} and 408 in statuses, statuses


def get_livez(sock: socket.socket) -> None:
    """One ``GET /livez`` on ``sock``, its whole answer read."""
    sock.sendall(b"GET /livez HTTP/1.1\r\nHost: rampart\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(65536)
    head, body = reply.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200 "), head


def test_idle_connections_and_trickled_heads_are_closed_within_their_timeouts(server):
    """200 connections that send nothing, 50 heads sent a byte every 200 ms, and 20 + 20 kept-alive connections
    (one request, then idle or a trickled head): every one is closed within its timeout; a busy one stays open."""
    import select

    head = b"GET /livez HTTP/1.1\r\nHost: rampart\r\nX-Slow: " + b"a" * 1000
    idle = [connect(server) for _ in range(200)]
    trickled = [connect(server) for _ in range(50)]
    kept_idle, kept_trickled = [connect(server) for _ in range(20)], [connect(server) for _ in range(20)]
    for sock in kept_idle + kept_trickled:
        get_livez(sock)
    started = time.monotonic()
    limit_s = max(HEAD_TIMEOUT_MS, KEEP_ALIVE_TIMEOUT_MS) / 1000 + CLOSE_SLACK_S
    open_ = {sock: kind for kind, socks in (("idle", idle), ("trickled", trickled), ("kept-idle", kept_idle),
                                            ("kept-trickled", kept_trickled)) for sock in socks}
    sent = 0
    while open_ and time.monotonic() - started < limit_s:
        for sock, kind in list(open_.items()):
            if kind.endswith("trickled"):
                try:
                    sock.send(head[sent:sent + 1])
                except OSError:
                    del open_[sock]
        sent += 1
        readable, _, _ = select.select(list(open_), [], [], 0.2)
        for sock in readable:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data or data.startswith(b"HTTP/1.1 408 "):
                del open_[sock]
    still = {kind: sum(1 for k in open_.values() if k == kind) for kind in set(open_.values())}
    for sock in idle + trickled + kept_idle + kept_trickled:
        sock.close()
    assert not open_, f"still open {limit_s:.1f} s later: {still}"
    with connect(server) as busy:  # a request every half keep-alive timeout keeps its connection
        for _ in range(4):
            get_livez(busy)
            time.sleep(KEEP_ALIVE_TIMEOUT_MS / 2000)
        get_livez(busy)
    closed = scrape(server)
    assert total(closed, "rampart_connections_closed_total", reason="head_timeout") >= 250
    assert total(closed, "rampart_connections_closed_total", reason="idle") >= 20


def latencies_ms(server, n: int) -> list[float]:
    out = []
    data = encode(photo("coffee"))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(n):
            started = time.perf_counter()
            response = client.post("/classify", content=data)
            assert response.status_code == 200, response.text
            out.append((time.perf_counter() - started) * 1000)
    return out


def test_a_scrape_storm_does_not_slow_classification(server):
    """20 loops each scraping /stats then /metrics: ordinary P95 stays within 1.5x of its value without them (before
    and after the storm, pooled: the host's other load drifts), and every scrape is answered."""
    import threading

    import numpy as np

    latencies_ms(server, 5)  # warm
    before = latencies_ms(server, 60)
    stop, scrapes, failures = threading.Event(), [0], []

    def scrape_loop() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set():
                for path in ("/stats", "/metrics"):
                    response = client.get(path)
                    if response.status_code != 200:
                        failures.append((path, response.status_code))
                    scrapes[0] += 1

    loops = [threading.Thread(target=scrape_loop) for _ in range(20)]
    for loop in loops:
        loop.start()
    try:
        time.sleep(1.0)
        stormy = latencies_ms(server, 80)
    finally:
        stop.set()
        for loop in loops:
            loop.join()
    calm = before + latencies_ms(server, 60)
    calm_p95, stormy_p95 = np.percentile(calm, 95), np.percentile(stormy, 95)
    report = {"calm_p50_p95": (np.median(calm), calm_p95), "stormy_p50_p95": (np.median(stormy), stormy_p95),
              "scrapes": scrapes[0]}
    assert not failures and scrapes[0] >= 80, (failures[:5], report)
    assert stormy_p95 <= 1.5 * calm_p95, report
