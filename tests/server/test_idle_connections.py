"""Idle and slow connections on a real server: silent connections and trickled heads are closed by the head
timeout, an answered keep-alive connection by the keep-alive timeout, while uploads are still answered; the
rest of an answered request's body and an endless trailer section do not hold a connection either, nor bodies
that stall holding the worker's budget of body bytes. Last, the same server runs the runners' lean route
(``RAMPART_RUNNER_ROUTE=lean``): its calls are counted, by the runner and in BentoML's metrics.

The module starts its own server with short timeouts (``HEAD_S``, ``KEEP_ALIVE_S``) and a small budget of body
bytes (``HELD_BUDGET_BYTES``); the in-process tests of the same protocol are in
``tests/unit/test_connection_timeouts.py`` and ``tests/unit/test_arrival.py``.
"""

from __future__ import annotations

import base64
import json
import selectors
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from PIL import Image

from rampart.api.arrival import SLOW_WINDOW_MIN_S
from rampart.compat.uvicorn_httptools import LINGER_S
from rampart.config import Settings
from tests.support import encode, photo

HEAD_S = 1.5
KEEP_ALIVE_S = 2.0
#: Time allowed beyond a timeout for the server's loop to close a connection.
MARGIN_S = 2.0
SILENT = 200
TRICKLING = 50
TRICKLE_EVERY_S = 0.5


#: Bodies that stall holding most of the worker's budget of body bytes (this module's server has a small one).
STALLED_BODIES = 5
STALLED_BYTES = 10_000_000
HELD_BUDGET_BYTES = STALLED_BODIES * STALLED_BYTES + 100_000


@pytest.fixture(scope="module")
def timed_server(start_server):
    return start_server(RAMPART_REQUEST_HEAD_TIMEOUT_MS=str(int(HEAD_S * 1000)),
                        RAMPART_KEEP_ALIVE_TIMEOUT_S=str(KEEP_ALIVE_S),
                        RAMPART_MAX_HELD_BODY_BYTES=str(HELD_BUDGET_BYTES),
                        RAMPART_RUNNER_ROUTE="lean")  # the runners' lean route, checked at the end of this module


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setblocking(False)
    return sock


def closed_by_server(sock: socket.socket, kept: bytearray | None = None) -> bool:
    """Whether the server has closed ``sock`` (EOF or a reset); bytes it sent first are added to ``kept``
    when given, else skipped."""
    try:
        while True:
            chunk = sock.recv(65536)
            if chunk == b"":
                return True
            if kept is not None:
                kept += chunk
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def close_times(socks: list[socket.socket], opened: float, limit_s: float, every_s: float = 0.0,
                write=None, received: list[bytearray] | None = None) -> list[float]:
    """Seconds from ``opened`` until the server closed each socket, ``inf`` for one still open at ``limit_s``.

    ``write(sock)``, when given, is called on every open socket each ``every_s``; ``received``, when given,
    gets what the server sent on each socket (one buffer per socket, in order).
    """
    times = [float("inf")] * len(socks)
    selector = selectors.DefaultSelector()
    for index, sock in enumerate(socks):
        selector.register(sock, selectors.EVENT_READ, index)
    next_write = opened
    while selector.get_map() and time.monotonic() - opened < limit_s:
        if write is not None and time.monotonic() >= next_write:
            for key in list(selector.get_map().values()):
                try:
                    write(key.fileobj)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed: seen as readable below
            next_write += every_s
        for key, _ in selector.select(0.05):
            if closed_by_server(key.fileobj, None if received is None else received[key.data]):
                times[key.data] = time.monotonic() - opened
                selector.unregister(key.fileobj)
    selector.close()
    return times


def test_silent_and_trickled_connections_are_closed_while_uploads_are_answered(timed_server):
    port = int(timed_server.url.rsplit(":", 1)[1])
    with httpx.Client(base_url=timed_server.url, timeout=30) as client:
        assert client.post("/classify", content=encode(photo("coffee"))).status_code == 200  # warm
    upload = encode(photo("chelsea"))
    statuses: list[int] = []

    def classify_meanwhile() -> None:
        time.sleep(0.5)
        with httpx.Client(base_url=timed_server.url, timeout=30) as client:
            statuses.append(client.post("/classify", content=upload).status_code)

    opened = time.monotonic()
    silent = [connect(port) for _ in range(SILENT)]
    silent_opened = time.monotonic()
    trickling = [connect(port) for _ in range(TRICKLING)]
    trickling_opened = time.monotonic()
    head = b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n" + b"X-Pad: " + b"a" * 200
    sent = {sock.fileno(): 0 for sock in trickling}

    def trickle(sock: socket.socket) -> None:
        if sock.fileno() in sent:
            offset = sent[sock.fileno()]
            sock.send(head[offset:offset + 1])
            sent[sock.fileno()] = offset + 1

    meanwhile = threading.Thread(target=classify_meanwhile)
    meanwhile.start()
    times = close_times(silent + trickling, opened, HEAD_S + MARGIN_S + 3, TRICKLE_EVERY_S, trickle)
    quiet, trickled = times[:SILENT], [t - (trickling_opened - opened) for t in times[SILENT:]]
    meanwhile.join(30)
    for sock in silent + trickling:
        sock.close()

    print(f"silent: {SILENT} closed {min(quiet):.2f}-{max(quiet):.2f} s after opening (the last opened at "
          f"{silent_opened - opened:.2f} s); trickled: {TRICKLING} closed {min(trickled):.2f}-{max(trickled):.2f} s, "
          f"after {max(sent.values())} bytes at most")
    assert max(quiet) <= (silent_opened - opened) + HEAD_S + MARGIN_S
    assert max(trickled) <= HEAD_S + MARGIN_S
    assert min(trickled) >= HEAD_S - 0.2 and min(quiet) >= HEAD_S - 0.2  # by the timeout, not at once
    assert statuses == [200]
    with httpx.Client(base_url=timed_server.url, timeout=30) as client:
        assert client.get("/livez").status_code == 200
        assert client.post("/classify", content=upload).status_code == 200


def test_an_answered_keep_alive_connection_is_closed_after_the_keep_alive_timeout(timed_server):
    port = int(timed_server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    upload = encode(photo("coffee"))
    sock.sendall(b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n"
                 % len(upload) + upload)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200")
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    answered = time.monotonic()
    sock.setblocking(False)
    idle = close_times([sock], answered, KEEP_ALIVE_S + MARGIN_S + 3)[0]
    sock.close()
    print(f"keep-alive: closed {idle:.2f} s after the answer")
    assert KEEP_ALIVE_S - 0.2 <= idle <= KEEP_ALIVE_S + MARGIN_S


def answer_to_trickled_head(port: int, deadline_ms: int, head_s: float, body: bytes, path: str = "/classify",
                            content_type: str = "image/jpeg") -> tuple[int, dict]:
    """Send a POST ``path`` head with ``X-Deadline-Ms: deadline_ms`` in pieces over ``head_s`` seconds (under the head
    timeout), then ``body`` at once; return the status and JSON body of the answer (the connection closes after)."""
    head = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nConnection: close\r\n"
            b"X-Deadline-Ms: %d\r\nContent-Length: %d\r\n\r\n" % (path.encode(), content_type.encode(), deadline_ms,
                                                                    len(body)))
    pieces = 6
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for i in range(pieces):
            sock.sendall(head[i * len(head) // pieces:(i + 1) * len(head) // pieces])
            time.sleep(head_s / pieces)
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_a_head_sent_slower_than_its_deadline_is_408_like_a_slow_body_and_then_requests_are_answered(timed_server):
    """The time a client takes to send its head is its own: a head trickled over 0.9 s with a 300 ms deadline is
    timed out (408 ``request_timeout``, as a body would be), not told that the server was too busy (429); so is an
    OIP request whose body shortens a long header deadline to 300 ms; the same head with a 5 s deadline is
    answered."""
    port = int(timed_server.url.rsplit(":", 1)[1])
    upload = encode(photo("coffee"))
    head_s = 0.6 * HEAD_S
    status, body = answer_to_trickled_head(port, 300, head_s, upload)
    assert status == 408 and body["error"]["code"] == "request_timeout" and "head took" in body["error"]["message"], body
    infer = json.dumps({"parameters": {"deadline_ms": 300}, "inputs": [
        {"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(upload).decode()]}]}).encode()
    status, body = answer_to_trickled_head(port, 60_000, head_s, infer, "/v2/models/rampart/infer", "application/json")
    assert status == 408 and "head took" in body["error"], body
    status, body = answer_to_trickled_head(port, 5_000, head_s, upload)
    assert status == 200 and body["model"]["name"] == "rampart-primary", body


def test_the_rest_of_an_answered_body_and_an_endless_trailer_section_do_not_hold_connections(timed_server):
    """Found by a hostile-client check: 10 ``GET /livez`` whose declared 1 MB body is trickled a byte at a time
    after their 200 (each byte restarted the keep-alive timer: open as long as the client sent), and 10 chunked
    uploads whose trailer section is streamed without end (grown by copying in the parser until the deadline):
    the first are closed ``LINGER_S`` after their answer, the second answered 431 ``headers_too_large`` and
    closed; an ordinary upload is answered after them."""
    port = int(timed_server.url.rsplit(":", 1)[1])
    upload = encode(photo("chelsea"))
    livez = [connect(port) for _ in range(10)]
    for sock in livez:
        sock.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nx")
    trailers = [connect(port) for _ in range(10)]
    for sock in trailers:
        sock.setblocking(True)
        sock.sendall(b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: chunked"
                     b"\r\n\r\n%x\r\n%s\r\n0\r\nX-Trailer: " % (len(upload), upload))
        sock.setblocking(False)

    def more(sock: socket.socket) -> None:
        try:
            sock.send(b"a" if sock in livez else b"a" * 8192)
        except BlockingIOError:
            pass  # the send buffer is full: the server is not reading

    received = [bytearray() for _ in livez + trailers]
    times = close_times(livez + trailers, time.monotonic(), LINGER_S + MARGIN_S + 3, 0.05, more, received)
    results = list(zip(received, times))
    with httpx.Client(base_url=timed_server.url, timeout=30) as client:
        assert client.post("/classify", content=upload).status_code == 200
    for sock in livez + trailers:
        sock.close()
    print("closed after (s):", [round(closed, 2) for _, closed in results])
    for answer, closed in results[:10]:
        assert answer.startswith(b"HTTP/1.1 200") and closed <= LINGER_S + MARGIN_S, (bytes(answer[:200]), closed)
    for answer, closed in results[10:]:
        assert answer.startswith(b"HTTP/1.1 431") and b"headers_too_large" in answer, bytes(answer[:300])
        assert closed <= LINGER_S + MARGIN_S, closed


def test_bodies_that_stall_holding_the_budget_of_body_bytes_give_way_to_an_upload(timed_server):
    """Found by a hostile-client check: connections that send most of a large body at once and then stall (or
    trickle a byte now and then) are far ahead of the minimum body rate, so nothing cut them, and together they
    held the worker's whole budget of body bytes: every upload got 429 until their deadlines (30 s here).
    Now, when an upload needs their room, the stalled bodies are cut with 408, as many as it takes (one here),
    and the upload is answered by the primary."""
    port = int(timed_server.url.rsplit(":", 1)[1])
    grace_s = Settings().connections.body_grace_ms / 1000
    big = photo("chelsea")
    upload = encode(np.asarray(Image.fromarray(big).resize((1600, 1066))), quality=95)
    assert 100_000 < len(upload) < 2_000_000
    head = (b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nX-Deadline-Ms: 30000\r\n"
            b"Content-Length: %d\r\n\r\n" % (STALLED_BYTES + 1_000_000))
    stalling = []
    for index in range(STALLED_BODIES):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(head + bytes([index]) * STALLED_BYTES)
        sock.setblocking(False)
        stalling.append(sock)
    time.sleep(max(grace_s, SLOW_WINDOW_MIN_S) + 0.5)  # their last window brought nothing
    for sock in stalling[3:]:
        sock.send(b"t")  # two trickle: slow too, but less slow than the stalled
    with httpx.Client(base_url=timed_server.url, timeout=30) as client:
        answered = client.post("/classify", content=upload, headers={"X-Deadline-Ms": "10000"})
    received = [bytearray() for _ in stalling]
    closed = [closed_by_server(sock, kept) for sock, kept in zip(stalling, received)]
    time.sleep(0.5)
    closed = [was or closed_by_server(sock, kept) for was, sock, kept in zip(closed, stalling, received)]
    for sock in stalling:
        sock.close()
    print("stalled bodies answered:", [bytes(kept[:12]) for kept in received], "closed:", closed)
    assert answered.status_code == 200 and answered.json()["model"]["name"] == "rampart-primary", answered.text
    cut = [index for index, kept in enumerate(received) if kept]
    assert len(cut) == 1 and cut[0] < 3 and closed[cut[0]], (cut, closed)
    assert received[cut[0]].startswith(b"HTTP/1.1 408") and b"request_timeout" in received[cut[0]]


def test_runner_calls_are_answered_in_front_of_bentomls_app_and_counted_in_its_metrics(timed_server):
    """With ``RAMPART_RUNNER_ROUTE=lean`` (this module's server) the runners answer the entry service's batch calls
    with their lean routes, and BentoML's runner metrics still count each call under its route."""
    with httpx.Client(base_url=timed_server.url, timeout=30) as http:

        def lean_calls() -> dict[str, int]:
            return http.get("/stats").json()["primary"]["runner"]["lean_calls"]

        before = lean_calls()
        assert http.post("/classify", content=encode(photo("chelsea"))).status_code == 200
        deadline = time.monotonic() + 5  # /stats asks the runners at most every stats_runner_refresh_ms (500)
        while sum((after := lean_calls()).values()) <= sum(before.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        metrics = http.get("/metrics").text
    assert sum(after.values()) > sum(before.values()), (before, after)
    assert any(line.startswith("bentoml_service_request_total{") and f'endpoint="{route}"' in line
               and 'http_response_code="200"' in line for line in metrics.splitlines() for route in after), after
