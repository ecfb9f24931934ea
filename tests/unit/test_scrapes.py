"""Cheap monitoring in-process: ``Refreshed`` (the runners' counters behind ``/stats``) and ``CoalescedMetrics``
(``/metrics``), directly and through the app (``rampart.telemetry.scrapes``).

A storm of scrapes must cost at most one runner call per runner and one rendering of the metrics per
interval, and every answer must still say what it would have said alone: the runner figures with their
age, every metric written before the scrape arrived.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from rampart.api.app import attach
from rampart.telemetry.scrapes import CoalescedMetrics, Refreshed


class Clock:
    """A settable monotonic clock, s."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingRunners:
    """``runner_stats(role)`` that counts its calls per role, takes ``delay_s`` and raises while ``failing``."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.calls = {"primary": 0, "fallback": 0}
        self.failing = False

    async def __call__(self, role: str) -> dict:
        self.calls[role] += 1
        call = self.calls[role]
        await asyncio.sleep(self.delay_s)
        if self.failing:
            raise ConnectionError(f"{role} runner unreachable")
        return {"role": role, "call": call}


# --- Refreshed --------------------------------------------------------------------------------------


def test_a_kept_value_is_served_with_its_age_until_it_is_older_than_max_age():
    clock, runners = Clock(), CountingRunners()
    cache = Refreshed(runners, 0.5, clock)

    async def scenario() -> list[tuple[dict, float]]:
        seen = [await cache.get("primary")]
        clock.now += 0.3
        seen.append(await cache.get("primary"))
        clock.now += 0.25  # 0.55 s after the fetch began: older than max_age
        seen.append(await cache.get("primary"))
        return seen

    (first, age0), (second, age1), (third, age2) = asyncio.run(scenario())
    assert first == second == {"role": "primary", "call": 1} and third == {"role": "primary", "call": 2}
    assert age0 == 0.0 and age1 == pytest.approx(0.3) and age2 == 0.0
    assert runners.calls == {"primary": 2, "fallback": 0} and cache.fetches == 2


def test_concurrent_gets_share_one_fetch_per_key():
    runners = CountingRunners(delay_s=0.05)
    cache = Refreshed(runners, 10.0)

    async def storm() -> list[tuple[dict, float]]:
        return await asyncio.gather(*(cache.get(role) for _ in range(50) for role in ("primary", "fallback")))

    answers = asyncio.run(storm())
    assert runners.calls == {"primary": 1, "fallback": 1}
    assert {answer["call"] for answer, _ in answers} == {1}
    assert all(age >= 0.04 for _, age in answers)  # the age counts from when the shared fetch began


def test_with_max_age_0_every_get_after_a_fetch_ends_fetches_again():
    runners = CountingRunners()
    cache = Refreshed(runners, 0.0)

    async def twice() -> None:
        await cache.get("fallback")
        await cache.get("fallback")

    asyncio.run(twice())
    assert runners.calls["fallback"] == 2


def test_a_failing_fetch_reaches_every_waiter_and_is_not_kept():
    runners = CountingRunners(delay_s=0.02)
    runners.failing = True
    cache = Refreshed(runners, 10.0)

    async def scenario() -> tuple[list, dict]:
        failed = await asyncio.gather(*(cache.get("primary") for _ in range(5)), return_exceptions=True)
        runners.failing = False
        return failed, (await cache.get("primary"))[0]

    failed, recovered = asyncio.run(scenario())
    assert all(isinstance(error, ConnectionError) for error in failed) and len(failed) == 5
    assert recovered == {"role": "primary", "call": 2} and runners.calls["primary"] == 2


def test_a_cancelled_waiter_does_not_cancel_the_shared_fetch():
    runners = CountingRunners(delay_s=0.05)
    cache = Refreshed(runners, 10.0)

    async def scenario() -> tuple[dict, float]:
        impatient = asyncio.ensure_future(cache.get("primary"))
        await asyncio.sleep(0.01)
        impatient.cancel()
        return await cache.get("primary")

    value, _ = asyncio.run(scenario())
    assert value == {"role": "primary", "call": 1} and runners.calls["primary"] == 1


def test_a_negative_max_age_is_refused():
    with pytest.raises(ValueError, match="max_age_s"):
        Refreshed(CountingRunners(), -1.0)


# --- /stats through the app -------------------------------------------------------------------------


def test_concurrent_stats_scrapes_make_one_runner_call_per_role_per_interval(make_rig):
    rig = make_rig(stats_runner_refresh_ms=1000)
    runners = CountingRunners(delay_s=0.2)
    attach(rig.client.app.app, runner_stats=runners)
    with ThreadPoolExecutor(16) as pool:
        bodies = list(pool.map(lambda _: rig.client.get("/stats").json(), range(32)))
    assert runners.calls == {"primary": 1, "fallback": 1}
    for body in bodies:
        for role in ("primary", "fallback"):
            assert body[role]["runner"] == {"role": role, "call": 1}
            assert 150 <= body[role]["runner_age_ms"] < 1000, body[role]  # fetched by the shared call, 0.2 s long
    time.sleep(1.05)  # the figures are now older than the interval: the next scrape asks again
    fresh = rig.client.get("/stats").json()
    assert fresh["primary"]["runner"]["call"] == 2 and runners.calls == {"primary": 2, "fallback": 2}


def test_stats_report_how_old_the_runner_figures_are(make_rig):
    rig = make_rig(stats_runner_refresh_ms=2000)
    attach(rig.client.app.app, runner_stats=CountingRunners())
    first = rig.client.get("/stats").json()
    time.sleep(0.3)
    second = rig.client.get("/stats").json()
    assert first["primary"]["runner"] == second["primary"]["runner"] == {"role": "primary", "call": 1}
    assert first["primary"]["runner_age_ms"] < 250 <= second["primary"]["runner_age_ms"] < 2000
    assert second["fallback"]["runner_age_ms"] >= 250


def test_a_failing_runner_stats_call_leaves_stats_answering_with_null(make_rig):
    rig = make_rig(stats_runner_refresh_ms=0)
    runners = CountingRunners()
    runners.failing = True
    attach(rig.client.app.app, runner_stats=runners)
    response = rig.client.get("/stats")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["primary"]["runner"] is None and body["fallback"]["runner"] is None
    assert body["primary"]["model"]["name"] == "rampart-primary"  # the worker's own state is all there
    runners.failing = False
    assert rig.client.get("/stats").json()["primary"]["runner"] == {"role": "primary", "call": 2}


def test_attaching_other_runner_stats_forgets_the_figures_of_the_old_ones(make_rig):
    rig = make_rig(stats_runner_refresh_ms=60_000)
    attach(rig.client.app.app, runner_stats=CountingRunners())
    assert rig.client.get("/stats").json()["primary"]["runner"]["call"] == 1

    async def other(role: str) -> dict:
        return {"other": role}

    attach(rig.client.app.app, runner_stats=other)
    assert rig.client.get("/stats").json()["primary"]["runner"] == {"other": "primary"}


# --- CoalescedMetrics -------------------------------------------------------------------------------


class Exposition:
    """A stand-in for BentoML's ``/metrics``: renders ``value`` (read when a rendering begins) in ``delay_s``."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.value = 0
        self.renders = 0
        self.failing = False

    async def render(self, request: Request) -> Response:
        self.renders += 1
        value = self.value
        await asyncio.sleep(self.delay_s)
        if self.failing:
            raise RuntimeError("metric files unreadable")
        return PlainTextResponse(f"rampart_value {value}\n", headers={"X-Render": str(self.renders)})


def metrics_app(exposition: Exposition, interval_s: float) -> CoalescedMetrics:
    """``CoalescedMetrics`` around an app serving ``exposition`` on ``/metrics`` (GET, PUT) and ``/other``."""
    return CoalescedMetrics(Starlette(routes=[Route("/metrics", exposition.render, methods=["GET", "PUT"]),
                                              Route("/other", exposition.render)]), interval_s)


def scrape(app, requests):
    """Run ``requests(client)`` (a coroutine function) against ``app`` in-process; its result."""

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://rampart") as client:
            return await requests(client)

    return asyncio.run(run())


def test_a_storm_of_metrics_scrapes_shares_one_rendering():
    exposition = Exposition()
    coalesced = metrics_app(exposition, 0.5)
    answers = scrape(coalesced, lambda client: asyncio.gather(*(client.get("/metrics") for _ in range(40))))
    assert exposition.renders == 1 == coalesced.renders
    assert {(a.status_code, a.text, a.headers["x-render"], a.headers["content-type"]) for a in answers} == {
        (200, "rampart_value 0\n", "1", "text/plain; charset=utf-8")}


def test_a_scrape_gets_a_rendering_begun_after_it_arrived_at_most_one_per_interval():
    exposition = Exposition(delay_s=0.3)
    coalesced = metrics_app(exposition, 0.3)

    async def requests(client) -> tuple:
        started = time.monotonic()
        early = asyncio.ensure_future(client.get("/metrics"))
        await asyncio.sleep(0.1)  # the first rendering is under way (it read value 0)
        exposition.value = 1  # written before the late scrapes arrive: they must show it
        late = await asyncio.gather(*(client.get("/metrics") for _ in range(10)))
        return await early, late, time.monotonic() - started

    early, late, took_s = scrape(coalesced, requests)
    assert early.text == "rampart_value 0\n"
    assert {answer.text for answer in late} == {"rampart_value 1\n"} and exposition.renders == 2
    assert took_s >= 0.3 + 0.3  # the second rendering began an interval after the first, and took 0.3 s
    again = scrape(coalesced, lambda client: client.get("/metrics"))
    assert again.text == "rampart_value 1\n" and exposition.renders == 3


def test_a_failed_rendering_fails_every_scrape_that_waited_for_it_and_the_next_one_renders_again():
    exposition = Exposition()
    exposition.failing = True
    coalesced = metrics_app(exposition, 0.05)

    async def failing(client) -> list:
        return await asyncio.gather(*(client.get("/metrics") for _ in range(5)), return_exceptions=True)

    failed = scrape(coalesced, failing)
    assert len(failed) == 5 and all(isinstance(error, RuntimeError) for error in failed)
    exposition.failing = False
    assert scrape(coalesced, lambda client: client.get("/metrics")).status_code == 200
    assert exposition.renders == 2


def test_other_methods_paths_and_interval_0_pass_through():
    exposition = Exposition(delay_s=0.0)
    coalesced = metrics_app(exposition, 0.5)

    async def others(client) -> list:
        return [await client.put("/metrics"), await client.head("/metrics"), await client.get("/other"),
                await client.get("/other")]

    assert [answer.status_code for answer in scrape(coalesced, others)] == [200] * 4
    assert exposition.renders == 4 and coalesced.renders == 0
    off = metrics_app(exposition, 0.0)
    scrape(off, lambda client: asyncio.gather(*(client.get("/metrics") for _ in range(3))))
    assert exposition.renders == 7 and off.renders == 0


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        CoalescedMetrics(Starlette(), -0.1)
