"""Slow request bodies on the real session server: they hold no in-flight place and are cut with 408.

300 uploads trickle their bodies a byte at a time (their heads announce 100 kB); meanwhile ordinary
uploads are answered, and once the grace (``BODY_GRACE_MS``, 2 s) has passed each trickling upload
is answered 408 and its connection closed. Before, about 300 of them filled the in-flight bound and
every ordinary upload got 429 until they closed.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

from rampart.config import Settings
from tests.support import encode, photo

TRICKLERS = 300
TRICKLE_EVERY_S = 0.5
GRACE_S = Settings().connections.body_grace_ms / 1000
MARGIN_S = 2.0


def trickle(url: str, count: int, stop: threading.Event) -> tuple[list[socket.socket], threading.Thread]:
    """``count`` uploads that send their head and then one byte of body every ``TRICKLE_EVERY_S`` until ``stop``."""
    address = urlparse(url)
    head = (f"POST /classify HTTP/1.1\r\nHost: {address.hostname}\r\nContent-Type: image/jpeg\r\n"
            "X-Deadline-Ms: 30000\r\nContent-Length: 100000\r\n\r\n").encode()
    sockets = []
    for _ in range(count):
        client = socket.create_connection((address.hostname, address.port))
        client.sendall(head + b"\xff")
        sockets.append(client)

    def run() -> None:
        while not stop.wait(TRICKLE_EVERY_S):
            for client in sockets:
                try:
                    client.send(b"\xd8")
                except OSError:
                    pass  # cut by the server

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return sockets, thread


def answer_of(client: socket.socket, wait_s: float) -> bytes:
    """What the server sent on ``client`` within ``wait_s`` (b"" when it closed without a word)."""
    client.settimeout(wait_s)
    try:
        return client.recv(4096)
    except (TimeoutError, socket.timeout):
        return b"<no answer>"
    except OSError:
        return b""


def test_slow_bodies_hold_no_place_and_are_cut_with_408_after_the_grace(server, http):
    body = encode(photo("coffee"))
    stop = threading.Event()
    started = time.monotonic()
    sockets, thread = trickle(server.url, TRICKLERS, stop)
    try:
        time.sleep(0.3)
        ordinary = [http.post("/classify", content=body, headers={"Content-Type": "image/jpeg",
                                                                   "X-Deadline-Ms": "3000"}) for _ in range(5)]
        during = time.monotonic() - started
        time.sleep(max(0.0, GRACE_S + MARGIN_S - (time.monotonic() - started)))
        answers = [answer_of(client, 1.0) for client in sockets]
    finally:
        stop.set()
        thread.join()
        for client in sockets:
            client.close()
    assert during < GRACE_S, during  # the ordinary uploads were answered while every trickler was still there
    assert [a.status_code for a in ordinary] == [200] * 5, [a.text for a in ordinary]
    assert all(a.json()["degraded_reason"] is None for a in ordinary)
    cut = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(cut) == TRICKLERS, sorted({a[:40] for a in answers})
    assert all(b"request_timeout" in a for a in cut)
    after = http.post("/classify", content=body, headers={"Content-Type": "image/jpeg"})
    assert after.status_code == 200
