"""The client's back-off (rampart_client.backoff) against a small real HTTP server that sheds on purpose,
and the SDK as a package installed in a fresh venv.

The server here is a plain ``http.server`` on 127.0.0.1 whose capacity and failures
are injected (a token bucket, 429 + Retry-After, 503): the overload is a fault put
there on purpose, so each rule of the policy is seen on the wire, in seconds, not
minutes of a real overload. Rampart itself answers the SDK in tests/server/test_client.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

from bench.harness import free_port
from rampart_client import AsyncClient, BackoffPolicy, Client, ConnectionFailed, Overloaded, ServiceError, Throttled
from rampart_client.backoff import Backoff
from tests.support import ROOT, encode, photo
from tests.support.shedding import Arrival, SheddingServer


@pytest.fixture
def serve():
    servers: list[SheddingServer] = []

    def start(decide) -> SheddingServer:
        servers.append(SheddingServer(decide))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


IMAGE = b"\xff\xd8 stub bytes: the stub server does not decode"
#: A retry budget that never binds (10 retries per call), to see the other rules alone.
NO_BUDGET = BackoffPolicy(throttle=False, retry_budget_ratio=10.0)


def token_bucket(rate_per_s: float, burst: float, retry_after: float = 1.0):
    """A capacity of ``rate_per_s`` accepted requests per second with room for ``burst`` at once
    (Rampart's queue: throughput x queue delay); the rest get 429 with ``Retry-After``."""
    state = {"tokens": burst, "at": time.monotonic()}

    def decide(arrival: Arrival):
        state["tokens"] = min(burst, state["tokens"] + (arrival.at - state["at"]) * rate_per_s)
        state["at"] = arrival.at
        if state["tokens"] >= 1.0:
            state["tokens"] -= 1.0
            return 200, None
        return 429, retry_after

    return decide


def test_reject_probability_is_the_sre_formula_over_a_sliding_window():
    now = [0.0]
    # Counts, never refuses; the formula applies from min_requests answered requests on.
    backoff = Backoff(BackoffPolicy(window_s=10, throttle=False, min_requests=10), clock=lambda: now[0])
    in_flight = [backoff.start(1000) for _ in range(10)]
    for call in in_flight:
        call.begin_attempt()
    assert backoff.reject_probability() == 0.0  # requests count once answered: a burst is not a refusal
    for i, call in enumerate(in_flight):
        if i < 2:
            call.succeeded()
        else:
            call.failed(Overloaded("full", retry_after=1.0, status=429))
    assert backoff.reject_probability() == pytest.approx((10 - 2 * 2) / (10 + 1))
    fewer = Backoff(BackoffPolicy(window_s=10, throttle=False, min_requests=11), clock=lambda: now[0])
    for _ in range(10):
        fewer.start(1000).failed(Overloaded("full", retry_after=1.0, status=429))
    assert fewer.reject_probability() == 0.0  # 10 refusals of 10, but fewer than min_requests
    now[0] = 11.5  # everything left the window
    assert backoff.reject_probability() == 0.0
    with pytest.raises(ValueError, match="max_attempts=0"):
        BackoffPolicy(max_attempts=0)


def calls_through_an_outage(policy: BackoffPolicy, outage_s: float = 30.0, after_s: float = 90.0,
                            rate_per_s: float = 20.0) -> list[tuple[float, bool]]:
    """An application calling ``rate_per_s`` times a second through a service that is down for ``outage_s``
    (every attempt a transport failure) and then answers everything: (seconds after the recovery, whether the
    call got an answer) for each call after it. A fake clock: no time passes."""
    now = [0.0]
    backoff = Backoff(policy, clock=lambda: now[0], rng=random.Random(1))
    after = []
    for i in range(int((outage_s + after_s) * rate_per_s)):
        now[0] = i / rate_per_s
        call = backoff.start(1000)
        try:
            call.begin_attempt()
        except Throttled:
            answered = False
        else:
            answered = now[0] >= outage_s
            if answered:
                call.succeeded()
            else:
                call.failed(ConnectionFailed("refused"))
        if now[0] >= outage_s:
            after.append((now[0] - outage_s, answered))
    return after


def test_a_client_that_kept_calling_through_an_outage_gets_through_soon_after_the_service_is_back():
    """Its own refusals count as requests (the SRE rule), so once the odds were high they stayed high: with two
    minutes of window and no cap, not one call of the next 90 s got through. Capped at 0.9 over 30 s, most
    calls of the third 15 s after the recovery get through and all of the fourth."""
    def share(after: list[tuple[float, bool]], start_s: float, end_s: float) -> float:
        window = [answered for at, answered in after if start_s <= at < end_s]
        return sum(window) / len(window)

    book = calls_through_an_outage(BackoffPolicy(window_s=120.0, max_reject_probability=1.0))
    assert share(book, 0, 90) == 0.0
    default = calls_through_an_outage(BackoffPolicy())
    assert share(default, 0, 15) > 0.05  # some attempts always go out
    assert share(default, 45, 60) > 0.9 and share(default, 60, 90) == 1.0


def test_sustained_overload_throttles_locally_and_bounds_what_the_server_receives(serve):
    capacity, offered, seconds = 25.0, 250.0, 4.0
    server = serve(token_bucket(capacity, burst=capacity * 0.2))
    outcomes = []
    with Client(server.url, timeout=5) as client:
        start = time.monotonic()
        for i in range(int(offered * seconds)):
            time.sleep(max(0.0, start + i / offered - time.monotonic()))
            try:
                client.classify(IMAGE, deadline_ms=1000)
                outcomes.append("ok")
            except Throttled:
                outcomes.append("throttled")
            except Overloaded:
                outcomes.append("shed")
        stats = client.backoff_stats()
    accepted, received = server.count(200), server.count()
    report = {"accepted": accepted, "received": received, **stats}
    half = len(outcomes) // 2
    # Local rejects grow as the window fills with refusals, and take over most of the load.
    assert outcomes[half:].count("throttled") > outcomes[:half].count("throttled") > 0, report
    assert stats["throttled"] > 0.5 * len(outcomes) and stats["reject_probability"] > 0.5, report
    # The SRE bound, once sustained (the first half fills the window): the server receives about
    # K = 2 times what it accepts (10 times without the throttle). Measured 2.1-2.2: the early
    # accepts (the burst) still in the window let a little more through.
    later = [a for a in server.arrivals if a.at >= start + seconds / 2]
    later_accepted = sum(1 for a in later if a.status == 200)
    report["second_half"] = (len(later), later_accepted)
    assert len(later) <= 2.5 * later_accepted, report
    assert received <= 3 * accepted, report
    assert accepted >= 0.5 * capacity * seconds, report  # throttling did not starve the capacity there is
    # Retry-After (1 s) never fits a 1 s deadline: no retry was sent.
    assert stats["retries"] == 0 and stats["retries_denied_deadline"] > 0, report
    assert stats["attempts"] == received and stats["accepts"] == accepted, report


def test_retries_stay_within_the_budget_and_the_attempt_limit(serve):
    seen: set[str | None] = set()

    def first_attempt_fails(arrival: Arrival):  # a replica that is gone: 503 without Retry-After
        first = arrival.request_id not in seen
        seen.add(arrival.request_id)
        return (503, None) if first else (200, None)

    server = serve(first_attempt_fails)
    calls = 200
    with Client(server.url, timeout=5, backoff=BackoffPolicy(throttle=False)) as client:
        failed = 0
        for i in range(calls):
            try:
                client.classify(IMAGE, deadline_ms=2000, request_id=f"r{i}")
            except ServiceError as exc:
                assert exc.status == 503
                failed += 1
        stats = client.backoff_stats()
    retries_on_the_wire = server.count() - calls
    assert retries_on_the_wire == stats["retries"] == calls - failed, stats
    assert 0 < stats["retries"] <= 0.1 * calls, stats  # at most 10% extra load
    assert stats["retries_denied_budget"] == failed, stats

    always_down = serve(lambda arrival: (503, None))
    with Client(always_down.url, timeout=5, backoff=NO_BUDGET) as client:
        with pytest.raises(ServiceError):
            client.classify(IMAGE, deadline_ms=2000)
        assert client.backoff_stats()["retries_denied_attempts"] == 1
    assert always_down.count() == 3  # max_attempts: the first and two retries


def test_retry_after_is_honoured_and_no_retry_leaves_after_the_deadline(serve):
    server = serve(lambda arrival: (429, 0.5))
    deadline_ms = 1000
    with Client(server.url, timeout=5, backoff=NO_BUDGET) as client:
        started = time.monotonic()
        with pytest.raises(Overloaded) as shed:
            client.classify(IMAGE, deadline_ms=deadline_ms)
        stats = client.backoff_stats()
    assert shed.value.retry_after == 0.5
    first, second = server.arrivals  # the third attempt would leave after 1 s: denied
    assert stats["retries"] == 1 and stats["retries_denied_deadline"] == 1, stats
    assert second.at - first.at >= 0.5  # waited for Retry-After
    assert first.deadline_ms == deadline_ms
    # The retry carries what was left of the caller's deadline, and arrives within it.
    assert 0 < second.deadline_ms <= deadline_ms - 500
    assert (second.at - started) * 1000 + second.deadline_ms <= deadline_ms + 50

    with Client(f"http://127.0.0.1:{free_port()}", timeout=2, backoff=NO_BUDGET) as nowhere:
        started = time.monotonic()
        with pytest.raises(ServiceError):
            nowhere.classify(IMAGE, deadline_ms=500)  # connection refused: retried at once, jittered
        assert nowhere.backoff_stats()["retries"] == 2
        assert time.monotonic() - started < 0.5


def test_async_client_retries_a_draining_replica_after_its_retry_after(serve):
    answers = iter([(503, 0.2), (200, None)])
    server = serve(lambda arrival: next(answers))

    async def run():
        async with AsyncClient(server.url, timeout=5, backoff=NO_BUDGET) as client:
            prediction = await client.classify(IMAGE, deadline_ms=3000)
            return prediction, client.backoff_stats()

    prediction, stats = asyncio.run(run())
    assert prediction.top.label == "espresso" and stats["retries"] == 1
    first, second = server.arrivals
    assert second.at - first.at >= 0.2 and second.deadline_ms <= 3000 - 200


@pytest.mark.parametrize("retry_after", ["nan", "-1", "inf"])
def test_a_retry_after_that_is_no_delay_is_taken_as_absent_by_both_clients(serve, retry_after):
    """A ``Retry-After`` of ``nan`` or ``-1`` reached ``time.sleep`` (ValueError) and ``asyncio.sleep`` (an
    AsyncClient call that never returned, whatever its deadline and timeout). Now it counts as absent: a 429
    without one is retried after 1 s (Rampart's least), within the call's deadline, and the retry is answered."""
    answers = iter([(429, retry_after), (200, None)] * 2)  # each client's first attempt is refused
    server = serve(lambda arrival: next(answers))
    with Client(server.url, timeout=5, backoff=NO_BUDGET) as client:
        assert client.classify(IMAGE, deadline_ms=2500).top.label == "espresso"

    async def call_async():
        async with AsyncClient(server.url, timeout=5, backoff=NO_BUDGET) as client:
            return await asyncio.wait_for(client.classify(IMAGE, deadline_ms=2500), 10)  # it hung for good

    assert asyncio.run(call_async()).top.label == "espresso"
    refused, answered, refused_async, answered_async = server.arrivals
    assert [a.status for a in server.arrivals] == [429, 200, 429, 200]
    assert answered.at - refused.at >= 1.0 and answered_async.at - refused_async.at >= 1.0


def test_the_sdk_installs_as_a_package_in_a_fresh_venv(tmp_path, server):
    """``pip install ./rampart_client`` works outside the repository: built, installed, run from elsewhere."""
    source = tmp_path / "src" / "rampart_client"
    shutil.copytree(ROOT / "rampart_client", source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # Offline: the project venv's setuptools builds the wheel; the fresh venv gets it without dependencies.
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(source)],
                   check=True, capture_output=True, timeout=120, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheels").glob("rampart_client-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=120)
    # Its dependencies come from the project venv, placed after the fresh venv's own site-packages.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    deps = sysconfig.get_paths()["purelib"]
    probe = (f"import sys; sys.path.append({deps!r}); import importlib.metadata as m, rampart_client; "
             "print(rampart_client.__file__); print(m.version('rampart-client')); print(m.requires('rampart-client'))")
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    location, version, requires = out.stdout.splitlines()
    assert location.startswith(str(venv)) and version == "0.2.0"
    assert {r.split(">")[0].split("=")[0] for r in eval(requires)} == {"httpx", "aiohttp", "pydantic"}  # noqa: S307 (our own print)

    image = tmp_path / "coffee.jpg"
    image.write_bytes(encode(photo("coffee")))
    cli = (f"import sys; sys.path.append({deps!r}); from rampart_client.__main__ import main; "
           f"sys.exit(main(['classify', {str(image)!r}, '--url', {server.url!r}, '--top-k', '3']))")
    out = subprocess.run([str(python), "-c", cli], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert out.returncode == 0 and "espresso" in out.stdout, out.stdout + out.stderr


def test_a_fresh_client_does_not_throttle_itself_after_one_refusal(serve):
    """The throttle starts once the window holds ``min_requests``: one 429 among a client's first calls
    refuses none of its next ones (without the minimum: p = 0.50, 0.67, 0.75 for the next three)."""
    answers = iter([(429, 0.0)])
    server = serve(lambda arrival: next(answers, (200, None)))
    one_attempt = BackoffPolicy(max_attempts=1)  # throttle on, no retry: each call is one attempt
    with Client(server.url, timeout=5, backoff=one_attempt) as client:
        with pytest.raises(Overloaded) as first:
            client.classify(IMAGE, deadline_ms=1000)
        assert first.value.cause == "capacity" and not isinstance(first.value, Throttled)
        for _ in range(3):
            assert client.classify(IMAGE, deadline_ms=1000).top.label == "espresso"
        stats = client.backoff_stats()
    assert stats["throttled"] == 0 and server.count() == 4, stats

    # Past the minimum the formula applies: min_requests refusals in a row, then the client refuses locally.
    refusing = serve(lambda arrival: (429, 0.0))
    policy = BackoffPolicy(max_attempts=1)
    with Client(refusing.url, timeout=5, backoff=policy) as client:
        outcomes = []
        for _ in range(policy.min_requests + 20):
            try:
                client.classify(IMAGE, deadline_ms=1000)
            except Throttled:
                outcomes.append("throttled")
            except Overloaded:
                outcomes.append("shed")
    assert outcomes[:policy.min_requests] == ["shed"] * policy.min_requests
    assert "throttled" in outcomes[policy.min_requests:], outcomes


def test_a_429_for_the_request_s_own_deadline_is_not_overload(serve):
    """``cause: deadline``: the request's own deadline was used up before the server started on it.
    It is an answer about the request: counted as accepted, never retried, and it never throttles."""
    server = serve(lambda arrival: (429, 1, "deadline"))
    with Client(server.url, timeout=5, backoff=BackoffPolicy(retry_budget_ratio=10.0)) as client:  # throttle on
        for _ in range(BackoffPolicy().min_requests + 10):
            with pytest.raises(Overloaded) as refused:
                client.classify(IMAGE, deadline_ms=5000)
            assert refused.value.cause == "deadline" and not isinstance(refused.value, Throttled)
        stats = client.backoff_stats()
    assert stats["throttled"] == 0 and stats["retries"] == 0 and stats["reject_probability"] == 0.0, stats
    assert stats["accepts"] == stats["attempts"] == server.count() == BackoffPolicy().min_requests + 10, stats


def test_an_async_call_refused_by_the_throttle_yields_to_the_event_loop():
    """A local refusal raised without an await: an application retrying at once in a loop never let its own calls in
    flight run (stalls of seconds)."""
    now = [0.0]
    backoff = Backoff(BackoffPolicy(min_requests=0, max_reject_probability=1.0), clock=lambda: now[0],
                      rng=random.Random(0))
    for _ in range(50):
        backoff.start(1000).failed(ConnectionFailed("refused"))  # odds near 1: every next attempt is refused

    async def scenario() -> tuple[int, int]:
        ticks = [0]

        async def ticker() -> None:
            while True:
                ticks[0] += 1
                await asyncio.sleep(0)

        running = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        refused = 0
        for _ in range(100):
            try:
                await backoff.call_async(lambda header: asyncio.sleep(0), 1000)
            except Throttled:
                refused += 1
        running.cancel()
        return refused, ticks[0]

    refused, ticks = asyncio.run(scenario())
    assert refused >= 90 and ticks >= refused // 2, (refused, ticks)  # before: a tick only per call let through
