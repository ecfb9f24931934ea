"""Clients that hang up after sending their upload, on the real session server: their places come back at once.

Hundreds of uploads are sent whole over raw sockets, then every socket is closed without reading
an answer; an ordinary upload right after is answered by the primary (not 429), and the server
counts the requests that were dropped in ``rampart_client_gone_total``. Before the fix the places of
292 such uploads stayed taken for up to 2.8 s and an ordinary upload 0.5 s later got 429.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

from tests.support import encode, logged_lines, photo
from tests.support.metrics import scrape

HANG_UPS = 300


def upload_then_hang_up(url: str, body: bytes, count: int, id_prefix: str = "hang-up-") -> list[socket.socket]:
    """``count`` sockets that each sent a whole ``POST /classify`` with ``body`` and ``X-Request-Id``
    ``<id_prefix><i>`` (not closed yet)."""
    address = urlparse(url)
    sockets = []
    for i in range(count):
        head = (f"POST /classify HTTP/1.1\r\nHost: {address.hostname}\r\nContent-Type: image/jpeg\r\n"
                f"X-Deadline-Ms: 5000\r\nX-Request-Id: {id_prefix}{i}\r\nContent-Length: {len(body)}\r\n\r\n")
        client = socket.create_connection((address.hostname, address.port))
        client.sendall(head.encode() + body)
        sockets.append(client)
    return sockets


def gone_total(server) -> float:
    return sum(scrape(server).get("rampart_client_gone_total", {}).values())


def test_a_mass_hang_up_gives_the_places_back_and_the_next_upload_gets_the_primary(server, http):
    body = encode(photo("coffee"))
    before = gone_total(server)
    sockets = upload_then_hang_up(server.url, body, HANG_UPS)
    time.sleep(0.3)  # read, admitted or refused, decoding and waiting for the primary
    held = http.get("/stats").json()["lifecycle"]["in_flight"]
    for client in sockets:
        client.close()
    time.sleep(0.1)
    in_flight = http.get("/stats").json()["lifecycle"]["in_flight"]
    answer = http.post("/classify", content=body, headers={"Content-Type": "image/jpeg", "X-Deadline-Ms": "3000"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["degraded_reason"] is None and answer.json()["model"]["name"] == "rampart-primary"
    assert held >= 20, held  # the uploads held places before they hung up
    assert in_flight <= 3, (held, in_flight)  # back within 100 ms: the /stats request itself and a straggler
    time.sleep(1.0)  # the metrics files are read by the scrape
    gone = gone_total(server) - before
    assert gone >= 0.5 * held, (before, held)
    # Each stopped request has its access line, as nginx logs 499, with the id it was sent with.
    lines = [json.loads(line) for line in logged_lines(server, '"hang-up-', count=HANG_UPS, timeout_s=2.0)]
    stopped = [line for line in lines if line["status"] == 499]
    assert len(stopped) >= 0.5 * held, (held, gone, len(lines))
    assert all(line["code"] == "client_disconnected" and line["stage"] in ("decode", "queue", "model")
               and line["path"] == "/classify" for line in stopped), stopped[:3]
