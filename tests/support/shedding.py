"""A small real HTTP server on 127.0.0.1 that sheds on purpose (429 + Retry-After, 503), for the client's
back-off and the load balancer's retries."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.harness import free_port


PREDICTION = {
    "request_id": "stub", "labels": [{"index": 967, "label": "espresso", "score": 0.9}],
    "model": {"name": "stub", "version": "1"}, "degraded": False, "degraded_reason": None,
    "timings_ms": {"decode": 1.0, "queue": 0.0, "inference": 1.0, "total": 2.0},
}


@dataclass
class Arrival:
    """One request as the server saw it: ``at`` (monotonic s), ``request_id``, ``deadline_ms`` header, status sent,
    and the ``X-Request-Start`` header (``request_start``, None when absent)."""

    at: float
    request_id: str | None
    deadline_ms: float | None
    status: int = 0
    request_start: str | None = None


@dataclass
class SheddingServer:
    """A real HTTP server whose answer to each request is ``decide(arrival) -> (status, retry_after[, cause])``
    (``cause``: a 429's ``error.cause``, ``capacity`` when left out)."""

    decide: object
    arrivals: list[Arrival] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    connections: set = field(default_factory=set)

    def __post_init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # header and body are separate writes: no 40 ms delayed-ACK stalls

            def setup(self) -> None:
                super().setup()
                owner.connections.add(self.connection)

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                header = self.headers.get("X-Deadline-Ms")
                arrival = Arrival(time.monotonic(), self.headers.get("X-Request-Id"), float(header) if header else None,
                                  request_start=self.headers.get("X-Request-Start"))
                with owner.lock:
                    status, retry_after, *cause = owner.decide(arrival)  # a 429's cause: capacity unless given
                    arrival.status = status
                    owner.arrivals.append(arrival)
                body = PREDICTION if status == 200 else {"error": {"code": "overloaded" if status == 429 else
                                                                   "unavailable", "message": "injected", "request_id": ""}}
                if status == 429:
                    body["error"]["cause"] = cause[0] if cause else "capacity"
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if retry_after is not None:
                    self.send_header("Retry-After", str(retry_after))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.httpd.daemon_threads, self.httpd.block_on_close = True, False  # close() must not wait on keep-alive
        self.httpd.handle_error = lambda request, address: None  # a connection cut by close() is the point
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def count(self, status: int | None = None) -> int:
        """How many requests arrived (with answer ``status``, when given)."""
        return sum(1 for a in self.arrivals if status is None or a.status == status)

    def close(self) -> None:
        """Stop listening and cut every open connection: a crashed server."""
        self.httpd.shutdown()
        self.httpd.server_close()
        for connection in list(self.connections):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the other side
