"""A locust load test of ``POST /classify`` with real photos, deadlines and priorities (docs/clients.md, "locust").

::

    .venv/bin/locust -f bench/locustfile.py --host http://127.0.0.1:3000            # web UI on :8089
    .venv/bin/locust -f bench/locustfile.py --host http://127.0.0.1:3000 --headless -u 16 -r 4 -t 60s \\
        --deadlines-ms 1000,200 --high-fraction 0.1 --csv out/rampart

Each request sends the next of ``bench.loadgen.load_bodies()`` (six JPEGs of the bundled scikit-image
and scikit-learn photos, made unique with ``loadgen.unique`` so the answer cache never answers),
with the next ``X-Deadline-Ms`` of ``--deadlines-ms`` in turn; a user's requests go in rounds of one
per deadline, and ``--high-fraction`` of the rounds are sent with ``X-Priority: high`` (spread evenly:
with 0.5 every other round), so every deadline meets both priorities and a short run covers them all.
Locust's table keeps the outcomes apart, one row per name:

- ``/classify <priority> full``: a full answer (``degraded`` false);
- ``/classify <priority> degraded``: a 200 the server marked degraded (the fallback, the cache or the
  static answer: ``degraded_reason``), counted as a success but never mixed with the full ones;
- ``/classify <priority> shed``: a 429 (``Retry-After``), counted as a failure;
- ``/classify <priority> error``: any other status or an unreadable answer, a failure.

``<priority>`` is ``high`` or ``normal``. Each simulated user sends its next request as soon as its last
is answered (a closed loop: ``-u`` users are ``-u`` requests in flight at most). The three options above are
this file's own; locust lists them in its web UI and takes them on the command line once ``-f`` names it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from locust import HttpUser, constant, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.loadgen

from bench.loadgen import load_bodies, unique  # noqa: E402 - after the path above

BODIES = load_bodies()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--deadlines-ms", type=str, default="1000",
                        help="comma-separated X-Deadline-Ms values, sent in turn")
    parser.add_argument("--high-fraction", type=float, default=0.0,
                        help="share of requests sent with X-Priority: high, 0..1 (whole rounds of --deadlines-ms)")
    parser.add_argument("--top-k", type=int, default=5, help="labels per answer (query top_k), 1..20")


def outcome(status: int, body: object) -> str:
    """``full``, ``degraded``, ``shed`` or ``error`` for an answer's HTTP ``status`` and parsed JSON ``body``."""
    if status == 429:
        return "shed"
    if status != 200 or not isinstance(body, dict) or "degraded" not in body:
        return "error"
    return "degraded" if body["degraded"] else "full"


class RampartUser(HttpUser):
    """One client sending real photos to ``/classify`` one after another."""

    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.deadlines = [float(value) for value in options.deadlines_ms.split(",")]
        self.high_fraction = options.high_fraction
        self.top_k = options.top_k
        self.sent = 0

    def next_request(self) -> tuple[bytes, float, bool]:
        """The next body, deadline (ms) and priority (True: high) of this user, in turn (module doc)."""
        i, self.sent = self.sent, self.sent + 1
        rounds = i // len(self.deadlines)  # whole rounds before this one
        high = math.floor((rounds + 1) * self.high_fraction) > math.floor(rounds * self.high_fraction)
        return unique(BODIES[i % len(BODIES)]), self.deadlines[i % len(self.deadlines)], high

    @task
    def classify(self) -> None:
        data, deadline_ms, high = self.next_request()
        priority = "high" if high else "normal"
        headers = {"Content-Type": "application/octet-stream", "X-Deadline-Ms": f"{deadline_ms:g}", "X-Priority": priority}
        with self.client.post("/classify", data=data, headers=headers,
                              params={"top_k": self.top_k}, name=f"/classify {priority}", catch_response=True) as response:
            try:
                body = response.json()
            except ValueError:
                body = None
            kind = outcome(response.status_code, body)
            response.request_meta["name"] = f"/classify {priority} {kind}"  # the row it is counted in
            if kind in ("full", "degraded"):
                response.success()
            elif kind == "shed":
                error = (body or {}).get("error") or {}
                response.failure(f"429 shed (cause {error.get('cause')}), Retry-After {response.headers.get('Retry-After')} s: "
                                 f"{error.get('message', '')[:60]}")
            else:
                response.failure(f"HTTP {response.status_code}: {response.text[:120]}")
