"""Two Rampart replicas behind nginx on loopback (deploy/cluster.py): overload, a crash, a drain.

One cluster serves the whole module. It simulates two hosts on one machine: both
replicas share its 2 cores, so CPU-bound capacity would not add up. Each replica's
capacity is made latency-bound instead, as a GPU host's is: batches of 2 and an
injected ``CAPACITY_DELAY_MS`` per batch in both models (the fault file, as in the
drills), so a replica is limited by its own pipeline, not by the shared CPU.

Timing-sensitive: run under the load lock. Nothing asserts a wall-clock time; the
single replica's goodput is measured in the same run.

Test time (about a minute) is mostly the cluster's start and one successor's start, so the
load phases are short: with batches every 250 ms, a phase of a few seconds already holds
dozens of batches per replica.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from bench.harness import free_port
from bench.loadgen import closed_loop, load_bodies, open_loop, summarize, unique
from deploy.cluster import Cluster, Nginx, nginx_binary
from tests.support import SLACK_MS
from tests.support.shedding import SheddingServer

CAPACITY_DELAY_MS = 250
REPLICA_ENV = {"RAMPART_PRIMARY_MAX_BATCH_SIZE": "2", "RAMPART_FALLBACK_MAX_BATCH_SIZE": "2"}
CAPACITY_CLIENTS = 16
CAPACITY_SECONDS = 3.0
OVERLOAD_FACTOR = 5.0
OVERLOAD_SECONDS = 7.0
FAULT_SECONDS = 6.0
FAULT_AT_S = 2.0
DEADLINE_MS = 1000
#: A successor to the drained replica, started while it drains (saves waiting for a server start; not
#: before the signal: its start-up would slow the requests in flight to the drained replica); the
#: SIGKILL test then kills it.
SUCCESSOR: dict[str, object] = {}
#: Requests sent straight to the replica just before its SIGTERM (high priority: admitted, not shed).
IN_FLIGHT = 4
#: Their deadline (ms): long enough that under the 2x overload on a busy 2-core host the primary's queue,
#: or else the fallback, answers them during the drain (with 2000 ms, 1 of 4 in full-suite runs here and
#: 3 of 4 in CI ran out of time in both models; with a neighbour's busy loop beside the test, the replica's
#: log said "primary_timeout, then fallback_timeout"). The drain waits for them all the same.
IN_FLIGHT_DEADLINE_MS = 8000

pytestmark = pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (`make nginx` installs it)")


def test_load_balancer_rules_with_injected_answers(tmp_path):
    """The load-balancer rules alone, with two small servers whose answers are injected."""
    answers = {"busy": (429, 7), "draining": (503, 3)}
    first = SheddingServer(lambda arrival: answers["first"])
    second = SheddingServer(lambda arrival: answers["second"])
    nginx = Nginx(tmp_path, free_port())
    nginx.configure([int(first.url.rsplit(":", 1)[1]), int(second.url.rsplit(":", 1)[1])])
    nginx.start()
    try:
        def post() -> httpx.Response:
            return httpx.post(f"{nginx.url}/classify", content=b"image bytes", timeout=10)

        answers.update(first=answers["busy"], second=(200, None))
        for _ in range(4):  # whichever replica least_conn picks first, the answer is the free one's
            assert post().status_code == 200
        answers.update(first=answers["draining"], second=answers["busy"])
        before = len(first.arrivals) + len(second.arrivals)
        refused = post()  # one replica draining, the other full: the client gets the full one's 429
        assert len(first.arrivals) + len(second.arrivals) - before == 2  # each replica tried once, no more
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded"
        # Its own Retry-After when its 429 came last; nginx's 1 s when the draining 503 came last.
        assert refused.headers["Retry-After"] in ("7", "1")
        answers.update(second=answers["draining"])
        draining = post()
        assert draining.status_code == 503 and draining.json()["error"]["code"] == "unavailable"
        first.close()
        answers.update(second=(200, None))
        assert all(post().status_code == 200 for _ in range(4))  # a dead replica: connection refused, next one
        second.close()
        gone = post()
        assert gone.status_code == 503 and gone.headers["Retry-After"] == "1"
        assert gone.json()["error"]["code"] == "unavailable"  # JSON in Rampart's shape, not nginx's HTML page
    finally:
        nginx.stop()


def test_a_retried_request_carries_the_time_nginx_received_it(tmp_path):
    """A replica tried after another one's late 429 gets the first try's ``X-Request-Start``, so it counts the
    deadline from when nginx received the request, not from its own arrival."""
    def slow_refusal(arrival):
        time.sleep(0.3)  # a 429 given at the request's turn in the queue, after a wait
        return 429, 1

    first, second = SheddingServer(slow_refusal), SheddingServer(lambda arrival: (200, None))
    nginx = Nginx(tmp_path, free_port())
    nginx.configure([int(first.url.rsplit(":", 1)[1]), int(second.url.rsplit(":", 1)[1])])
    nginx.start()
    client = httpx.Client(timeout=10)  # made before the clock is read: building a client takes tens of ms
    wall_minus_monotonic = time.time() - time.monotonic()
    try:
        for _ in range(4):  # least_conn picks either first; whenever the slow one was tried, the other follows
            before = len(first.arrivals), len(second.arrivals)
            sent = time.time()
            assert client.post(f"{nginx.url}/classify", content=b"image bytes").status_code == 200
            tries = sorted(first.arrivals[before[0]:] + second.arrivals[before[1]:], key=lambda a: a.at)
            assert all(a.request_start for a in tries), "nginx sent no X-Request-Start"
            stamps = {float(a.request_start.removeprefix("t=")) for a in tries}
            assert len(stamps) == 1, stamps  # one stamp for every try of this request
            # nginx's receipt (``$msec``, whole ms): after the send, no later than the first try reached a replica,
            # so never the retry's own time (that try arrives at least 0.3 s after the first).
            stamp, first_try = stamps.pop(), tries[0].at + wall_minus_monotonic
            assert sent - 0.002 <= stamp <= first_try + 0.002, (sent, stamp, [a.at + wall_minus_monotonic for a in tries])
        assert first.arrivals, "the slow replica was never tried"
    finally:
        client.close()
        nginx.stop()
        first.close()
        second.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cluster")
    faults = run_dir / "faults.json"
    faults.write_text(json.dumps({"fault_primary_delay_ms": CAPACITY_DELAY_MS,
                                  "fault_fallback_delay_ms": CAPACITY_DELAY_MS}))
    cluster = Cluster(run_dir, replicas=2, port=free_port(), env={**REPLICA_ENV, "RAMPART_FAULT_FILE": str(faults)})
    cluster.start()
    yield cluster
    cluster.stop()
    if "replica" in SUCCESSOR:  # started, never installed (a test failed in between)
        SUCCESSOR.pop("replica").stop()


@pytest.fixture(scope="module")
def capacity(cluster) -> float:
    """One replica's closed-loop capacity (requests/s answered 200), measured on replica 0 directly."""
    samples = asyncio.run(closed_loop(f"{cluster.replicas[0].url}/classify", load_bodies(), CAPACITY_CLIENTS,
                                      CAPACITY_SECONDS, deadline_ms=DEADLINE_MS))
    result = summarize(samples, CAPACITY_SECONDS)
    assert result["errors_5xx"] == 0 and result["throughput_rps"] > 0, result
    return result["throughput_rps"]


def odd_lines(cluster: Cluster, samples=()) -> list[str]:
    """nginx's log lines for answers other than 200 and 429 (with the replicas tried and their statuses),
    the requests of ``samples`` that got no HTTP answer (sent at, waited ms), and nginx's error log."""
    time.sleep(1.5)  # nginx flushes its access log every second
    lines = cluster.nginx.access_log.read_text().splitlines() if cluster.nginx.access_log.exists() else []
    errors = cluster.nginx.run_dir / "nginx-error.log"
    failed = [f"no answer: sent at {s.sent_s:.3f} s, after {s.latency_ms:.0f} ms" for s in samples if s.status == 0]
    return ([line for line in lines if line.split()[1] not in ("200", "429")][-20:] + failed
            + (errors.read_text().splitlines()[-10:] if errors.exists() else []))


def late_samples(samples) -> list[dict]:
    """The answers later than their deadline and the slack: when sent, what came back, and how long it took."""
    return [{"sent_s": round(s.sent_s, 3), "status": s.status, "model": s.model, "reason": s.degraded_reason,
             "latency_ms": round(s.latency_ms), "server_ms": s.server_ms, "deadline_ms": s.deadline_ms}
            for s in samples if s.latency_ms > s.deadline_ms + SLACK_MS]


def overload(url: str, rate: float, seconds: float, at_s: float | None = None, action=None):
    """Open-loop Poisson load on ``url``; ``action()`` runs ``at_s`` seconds in, on a thread."""
    timer = threading.Timer(at_s, action) if action else None
    if timer:
        timer.start()
    try:
        return asyncio.run(open_loop(f"{url}/classify", load_bodies(), rate, seconds, deadline_ms=DEADLINE_MS, seed=3))
    finally:
        if timer:
            timer.join()


def test_two_replicas_behind_nginx_serve_more_under_five_times_overload(cluster, capacity):
    rate = OVERLOAD_FACTOR * capacity
    single = summarize(overload(cluster.replicas[0].url, rate, OVERLOAD_SECONDS), OVERLOAD_SECONDS, slack_ms=SLACK_MS)
    samples = overload(cluster.url, rate, OVERLOAD_SECONDS)
    both = summarize(samples, OVERLOAD_SECONDS, slack_ms=SLACK_MS)
    report = {"capacity_rps": capacity, "single": single, "cluster": both}
    assert both["requests"] >= 0.8 * rate * OVERLOAD_SECONDS, report  # the load really was offered
    assert {s.status for s in samples} <= {200, 429}, (report, odd_lines(cluster, samples))  # a result or a shed, never a 5xx
    assert both["late"] == 0, (report, late_samples(samples))
    assert both["goodput_rps"] >= 1.6 * single["goodput_rps"], report
    print(json.dumps(report))  # the numbers docs/deploy.md quotes (pytest -rP shows them)
    retried = [line for line in cluster.nginx.access_log.read_text().splitlines() if '"429, ' in line]
    assert retried, "nginx never passed a 429 on to the other replica"


def test_sigterm_drains_one_replica_mid_load(cluster, capacity):
    """Needs the graceful drain (SIGTERM: /readyz 503, new requests 503 + Retry-After, admitted ones answered)."""
    draining = cluster.replicas[1]
    port = f":{draining.port}"
    body = load_bodies()[0]
    signalled, in_flight = {}, []
    # One client per sender with its connection open before the load starts, so that on a busy
    # machine the requests reach the replica within the 0.2 s before the signal (no client or
    # connection set-up then).
    clients = [httpx.Client(timeout=30) for _ in range(IN_FLIGHT)]
    for client in clients:
        assert client.get(f"{draining.url}/livez").status_code == 200

    def send_direct(client: httpx.Client) -> None:  # straight to the replica: nginx must not resend what it drops
        try:
            response = client.post(f"{draining.url}/classify", content=unique(body),
                                   headers={"X-Priority": "high", "X-Deadline-Ms": str(IN_FLIGHT_DEADLINE_MS)})
            in_flight.append((response.status_code, response.json().get("degraded_reason")))
        except (httpx.HTTPError, ValueError) as exc:  # dropped: reset, refused, or not JSON
            in_flight.append((0, f"{type(exc).__name__}: {exc}"))

    def terminate() -> None:
        senders = [threading.Thread(target=send_direct, args=(client,)) for client in clients]
        for sender in senders:
            sender.start()
        time.sleep(0.2)  # their bodies are in and their places taken: admitted
        signalled["at"] = time.time()
        draining.terminate()
        for sender in senders:
            sender.join()
        # The successor starts once the in-flight requests are answered: its start-up (imports, model
        # load, warm-up) takes a core for seconds, and beside it on 2 cores they ran late and got the
        # static answer.
        SUCCESSOR["replica"] = cluster.spawn(1)

    try:
        samples = overload(cluster.url, 2 * capacity, FAULT_SECONDS, FAULT_AT_S, terminate)
    finally:
        for client in clients:
            client.close()
    report = summarize(samples, FAULT_SECONDS, slack_ms=SLACK_MS)
    # Through nginx, every request got a result or a shed, none a 5xx or a reset.
    assert {s.status for s in samples} <= {200, 429}, (report, odd_lines(cluster, samples), draining.log()[-2000:])
    # The requests in flight at the replica when SIGTERM came were answered by a model (not the
    # static answer of a pipeline whose runners had gone), or shed on arrival; none was dropped.
    assert len(in_flight) == IN_FLIGHT and {status for status, _ in in_flight} <= {200, 429}, in_flight
    assert any(status == 200 for status, _ in in_flight), in_flight
    assert all(reason != "no_model_available" for status, reason in in_flight if status == 200), in_flight
    draining.process.wait(timeout=90)
    # The draining replica answered nginx's requests after SIGTERM too (admitted before it).
    time.sleep(1.5)  # nginx flushes its access log every second
    answered_after = [
        line for line in cluster.nginx.access_log.read_text().splitlines()
        if float(line.split()[0]) > signalled["at"] and line.split()[1] == "200"
        and line.split('"')[1].split(", ")[-1].endswith(port)
    ]
    assert answered_after, (report, draining.log()[-2000:])


def test_sigkill_of_one_replica_mid_load(cluster, capacity):
    victim = cluster.replicas[1]
    if victim.process.poll() is not None:  # drained by the test above: its successor takes its place
        victim = cluster.install(1, SUCCESSOR.pop("replica", None) or cluster.spawn(1))
        # A replica restarted on the same host reads the batch-size timings its predecessor measured.
        runners = httpx.get(f"{victim.url}/stats", timeout=10).json()
        assert {runners[role]["runner"]["timings_source"] for role in ("primary", "fallback")} == {"cache"}, runners
    samples = overload(cluster.url, 2 * capacity, FAULT_SECONDS, FAULT_AT_S, victim.kill)
    killed_at = FAULT_AT_S  # at the latest: the timer starts before the load's clock does
    report = summarize(samples, FAULT_SECONDS, slack_ms=SLACK_MS)
    assert victim.process.poll() is not None, "the replica is still running"
    assert {s.status for s in samples} <= {200, 429}, (report, odd_lines(cluster, samples))  # no 5xx, no broken connection
    after = [s for s in samples if s.sent_s > killed_at + 0.5 and s.status == 200]
    # The survivor kept answering. Until the kill each replica had about half the cores, and its
    # throughput meter (time constant 5 s) needs longer than the 3.5 s after the kill to learn the
    # whole machine, so it admits about half of one replica's capacity measured alone (0.45 and 0.48
    # in the two fresh-clone runs where this fell below 0.5): at least 0.35 of it, not a full replica's.
    assert len(after) >= 0.35 * capacity * (FAULT_SECONDS - killed_at - 0.5), report
