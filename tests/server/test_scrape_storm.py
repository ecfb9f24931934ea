"""A storm of monitoring scrapes does not slow classification: the shared default server, one run.

Ordinary ``/classify`` traffic (``CLIENTS`` closed-loop clients sending a real photo) is
measured for ``ARM_S`` seconds without and then with a scrape storm (``STORM_LOOPS``
concurrent loops, each alternating ``GET /stats`` and ``GET /metrics``), the arms
alternating A B A B so that a drift of the host during the run reaches both. The client-side
P95 with the storm, as the median over its arms, must be at most ``STORM_P95_RATIO`` times
the one without (``rampart.telemetry.scrapes``: ``/stats`` asks each runner at most once per
``STATS_RUNNER_REFRESH_MS``, ``/metrics`` merges the metric files at most once per
``METRICS_RENDER_INTERVAL_MS``). No wall-clock latency is asserted, only the ratio within
the run.

The storm comes from a process of its own at the lowest CPU priority (nice 19), as if its
clients were elsewhere: httpx costs about 2 ms of CPU per request, so on the 2-core host 20
loops in this process would take CPU the server needs and their bursts of answers would hold
up the classify clients' own event loop; what is measured is what the server pays for them.
Before the caching, 20 loops scraping both took ordinary P50/P95 on the 2-core host from
44/48 ms to 300/450 ms.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
import numpy as np

from bench.loadgen import unique
from tests.support import encode, photo

CLIENTS = 4
STORM_LOOPS = 20
ARM_S = 6.0
WARM_UP_S = 2.0
#: How long before a storm arm its process is told to start: it opens its connections meanwhile.
STORM_LEAD_S = 1.0
#: P95 with the storm / P95 without it, medians over the arms. Measured on the shared 2-core host, 2026-12-01,
#: P95 of the arms A B A B in ms (ratio). The storm in its own process, the host otherwise idle: 208 243 185 240
#: (1.23; P50 186 188 171 197; 241 /stats and 241 /metrics answers per storm arm, runner_age_ms at most 500).
#: Earlier, the storm's loops in the classify clients' own process and other suites running beside it:
#: 387 485 435 723 (1.47) and 278 398 285 399 (1.42). Four clients saturate that host (P50 about 180 ms).
STORM_P95_RATIO = 1.5


async def classify_loop(client: httpx.AsyncClient, body: bytes, stop: float, latencies_ms: list[float],
                        statuses: list[int]) -> None:
    """One closed-loop client: POST ``body`` (made unique) to ``/classify`` until ``stop`` (``time.perf_counter()``)."""
    while time.perf_counter() < stop:
        started = time.perf_counter()
        response = await client.post("/classify", content=unique(body))
        latencies_ms.append((time.perf_counter() - started) * 1000.0)
        statuses.append(response.status_code)


async def classify_arm(url: str, body: bytes, duration_s: float, start_at: float | None = None) -> dict:
    """``CLIENTS`` classify loops for ``duration_s`` s, from ``start_at`` (``time.time()``) when given:
    their latencies (ms) and statuses."""
    latencies_ms: list[float] = []
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        await asyncio.gather(*(client.get("/livez") for _ in range(CLIENTS)))  # connections open
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        stop = time.perf_counter() + duration_s
        await asyncio.gather(*(classify_loop(client, body, stop, latencies_ms, statuses) for _ in range(CLIENTS)))
    return {"latencies_ms": latencies_ms, "statuses": statuses}


async def scrape_loop(client: httpx.AsyncClient, stop: float, answers: list[tuple[str, int, dict | None]]) -> None:
    """One scraper: GET ``/stats`` then ``/metrics`` until ``stop``; keeps (path, status, /stats runner figures)."""
    while time.perf_counter() < stop:
        stats = await client.get("/stats")
        runners = None
        if stats.status_code == 200:
            body = stats.json()
            runners = {role: (body[role]["runner"] is not None, body[role]["runner_age_ms"])
                       for role in ("primary", "fallback")}
        answers.append(("/stats", stats.status_code, runners))
        metrics = await client.get("/metrics")
        answers.append(("/metrics", metrics.status_code, None))


def storm(url: str, start_at: float, duration_s: float) -> dict:
    """In the storm's process: ``STORM_LOOPS`` scrapers from ``start_at`` (``time.time()``) for ``duration_s`` s.

    Returns ``late_s`` (how late they began), the count of answers by path and status, and per role
    whether every ``/stats`` had runner figures and the oldest ``runner_age_ms`` seen."""

    async def run() -> tuple[float, list]:
        answers: list[tuple[str, int, dict | None]] = []
        limits = httpx.Limits(max_connections=STORM_LOOPS, max_keepalive_connections=STORM_LOOPS)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            await asyncio.gather(*(client.get("/livez") for _ in range(STORM_LOOPS)))
            await asyncio.sleep(max(0.0, start_at - time.time()))
            late_s = time.time() - start_at
            stop = time.perf_counter() + duration_s
            await asyncio.gather(*(scrape_loop(client, stop, answers) for _ in range(STORM_LOOPS)))
        return late_s, answers

    late_s, answers = asyncio.run(run())
    counts: dict[str, int] = {}
    for path, status, _ in answers:
        counts[f"{path} {status}"] = counts.get(f"{path} {status}", 0) + 1
    figures = [runners for path, _, runners in answers if runners is not None]
    return {"late_s": round(late_s, 3), "answers": counts,
            "runner_figures": {role: all(f[role][0] for f in figures) for role in ("primary", "fallback")},
            "max_runner_age_ms": max((f[role][1] for f in figures for role in f), default=None)}


def lowest_priority() -> None:
    """The storm process's initializer: nice 19, the lowest CPU priority."""
    os.nice(19 - os.nice(0))


def test_a_scrape_storm_leaves_ordinary_p95_within_the_ratio(server):
    body = encode(photo("chelsea"))
    spawn = multiprocessing.get_context("spawn")  # no fork of this process's threads and sockets
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=lowest_priority) as storms:
        storms.submit(lowest_priority).result()  # the storm process started and imported, before any arm
        asyncio.run(classify_arm(server.url, body, WARM_UP_S))  # warm paths and connections, not measured
        arms, scrapes = [], []
        for stormy in (False, True, False, True):
            start_at = time.time() + STORM_LEAD_S
            scraped = storms.submit(storm, server.url, start_at, ARM_S) if stormy else None
            arms.append(asyncio.run(classify_arm(server.url, body, ARM_S, start_at)))
            scrapes.append(scraped.result() if scraped is not None else None)
    p95 = [round(float(np.percentile(a["latencies_ms"], 95)), 1) for a in arms]
    p50 = [round(float(np.percentile(a["latencies_ms"], 50)), 1) for a in arms]
    quiet, stormy = statistics.median(p95[0::2]), statistics.median(p95[1::2])
    report = {"p95_ms": p95, "p50_ms": p50, "requests": [len(a["latencies_ms"]) for a in arms],
              "storms": scrapes[1::2], "ratio": round(stormy / quiet, 2)}
    print("scrape storm:", report)  # the measured values, for the comment at STORM_P95_RATIO (pytest -s)

    for one in arms:
        assert set(one["statuses"]) == {200}, (report, sorted(set(one["statuses"])))
    for one in scrapes[1::2]:  # the storm really came, over the whole arm, and every scrape was answered
        assert one["late_s"] < 0.5, report
        assert set(one["answers"]) == {"/stats 200", "/metrics 200"}, report
        assert one["answers"]["/stats 200"] >= STORM_LOOPS * 2, report
        assert one["runner_figures"] == {"primary": True, "fallback": True}, report
    assert stormy <= STORM_P95_RATIO * quiet, report
