"""``rampart.api.arrival.InflightBound``'s body phase: slow bodies hold no in-flight place and are cut, and the
bytes bodies hold at once stay within the worker's budget.

Driven at the ASGI level with the messages uvicorn sends (body chunks, ``more_body``), the bound's own
wrapper in front of a small app that reads its body and then waits to be released.
"""

from __future__ import annotations

import asyncio

import pytest

from rampart.api.arrival import (HEAP_TRIM_BODY_BYTES, RECEIVING_PER_INFLIGHT_PLACE, SLOW_WINDOW_MIN_S, InflightBound,
                                 hold_body_bytes)
from rampart.heap import IdleTrim


def answer(status: int):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    return app


def scope(length: int | None) -> dict:
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    return {"type": "http", "path": "/bounded", "headers": headers}


class Client:
    """One request: its body in ``chunks`` sent every ``every_s``; ``status`` is what it was answered."""

    def __init__(self, chunks: list[bytes], every_s: float = 0.0) -> None:
        self.chunks, self.every_s = list(chunks), every_s
        self.status: int | None = None

    async def receive(self) -> dict:
        if not self.chunks:
            await asyncio.sleep(3600)  # a body already complete: only a disconnect would come
        await asyncio.sleep(self.every_s)
        chunk = self.chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks)}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]


def bound_with(limit: int, rate: float = 0.0, grace_s: float = 0.0):
    """An ``InflightBound`` of ``limit`` in front of an app that reads its body, notes it in ``bodies`` and answers
    200 once ``release`` is set; returns (bound, release, bodies, the wrapped app)."""
    release = asyncio.Event()
    bodies: list[bytes] = []

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        bodies.append(body)
        await release.wait()
        await answer(200)(scope, receive, send)

    bound = InflightBound(lambda: limit, answer(429), ["/bounded"], watch_hang_ups=False, too_slow=answer(408),
                          min_body_bytes_per_s=rate, body_grace_s=grace_s)
    return bound, release, bodies, bound.wrap(app)


def test_a_body_slower_than_the_minimum_rate_after_the_grace_is_cut_with_408():
    async def scenario():
        bound, release, bodies, app = bound_with(limit=4, rate=1000.0, grace_s=0.2)
        slow = Client([b"x"] * 50, every_s=0.1)  # 10 bytes/s
        fast = Client([b"y" * 5000, b"y" * 5000], every_s=0.05)  # 100 kB/s
        tasks = [asyncio.ensure_future(app(scope(50), slow.receive, slow.send)),
                 asyncio.ensure_future(app(scope(10000), fast.receive, fast.send))]
        await asyncio.sleep(0.6)
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 2.0)
        return bound, slow, fast, bodies

    bound, slow, fast, bodies = asyncio.run(scenario())
    assert slow.status == 408 and fast.status == 200 and bodies == [b"y" * 10000]
    assert bound.cut == 1 and bound.receiving == 0 and bound.inflight == 0


def test_bodies_on_their_way_hold_no_in_flight_place_and_one_completing_when_all_are_taken_gets_429():
    async def scenario():
        bound, release, bodies, app = bound_with(limit=1)  # no rate check
        arriving = Client([b"a", b"b", b"c"], every_s=0.1)
        first = asyncio.ensure_future(app(scope(3), arriving.receive, arriving.send))
        await asyncio.sleep(0.05)
        assert (bound.receiving, bound.inflight) == (1, 0)
        whole = Client([b"z"])
        second = asyncio.ensure_future(app(scope(1), whole.receive, whole.send))
        await asyncio.sleep(0.05)
        assert (bound.receiving, bound.inflight) == (1, 1)  # the whole body took the place, not the arriving one
        await asyncio.sleep(0.4)  # the arriving body completes with the only place taken
        refused_at_completion = arriving.status
        release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 2.0)
        return bound, refused_at_completion, whole, bodies

    bound, refused_at_completion, whole, bodies = asyncio.run(scenario())
    assert refused_at_completion == 429 and whole.status == 200 and bodies == [b"z"]
    assert bound.refused == 1 and bound.inflight == 0 and bound.receiving == 0


def test_receivers_are_bounded_apart_and_a_request_without_a_body_is_in_flight_from_its_head():
    async def scenario():
        bound, release, bodies, app = bound_with(limit=1)
        trickling = [Client([b"t"] * 100, every_s=0.1) for _ in range(RECEIVING_PER_INFLIGHT_PLACE)]
        tasks = [asyncio.ensure_future(app(scope(100), c.receive, c.send)) for c in trickling]
        await asyncio.sleep(0.05)
        one_more = Client([b"u"] * 100, every_s=0.1)
        await app(scope(100), one_more.receive, one_more.send)  # refused at its head: receivers are full
        bodiless = Client([b""])
        get = asyncio.ensure_future(app(scope(None), bodiless.receive, bodiless.send))
        await asyncio.sleep(0.05)
        in_flight = bound.inflight
        release.set()
        await asyncio.wait_for(get, 1.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return bound, one_more, bodiless, in_flight

    bound, one_more, bodiless, in_flight = asyncio.run(scenario())
    assert one_more.status == 429 and bodiless.status == 200 and in_flight == 1
    assert bound.receiving == 0 and bound.inflight == 0


# --- the budget of body bytes held at once ---

#: The status the stand-in front answers a body over the budget with (Rampart's is 429 ``overloaded``).
OVER_BUDGET = 430


def budget_bound(max_held: int, small: int, rate: float = 0.0, grace_s: float = 0.0):
    """``bound_with`` of a generous in-flight limit and a budget of ``max_held`` bytes (``small``: one upload's worth)."""
    bound, release, bodies, app = bound_with(limit=16, rate=rate, grace_s=grace_s)
    bound.over_budget, bound.max_held_bytes, bound.small_body_bytes = answer(OVER_BUDGET), max_held, small
    return bound, release, bodies, app


async def peak_held(bound: InflightBound, peak: list[int]) -> None:
    while True:
        peak[0] = max(peak[0], bound.held)
        await asyncio.sleep(0.001)


def test_of_large_bodies_growing_together_the_oldest_completes_and_the_others_are_refused_within_the_budget():
    async def scenario():
        bound, release, bodies, app = budget_bound(max_held=1000, small=100)
        clients = [Client([bytes([65 + n]) * 50] * 10, every_s=0.01) for n in range(3)]  # 500 bytes each
        peak = [0]
        watcher = asyncio.ensure_future(peak_held(bound, peak))
        tasks = []
        for client in clients:
            tasks.append(asyncio.ensure_future(app(scope(500), client.receive, client.send)))
            await asyncio.sleep(0.002)  # the first is the oldest
        await asyncio.sleep(0.3)
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 2.0)
        watcher.cancel()
        return bound, clients, bodies, peak[0]

    bound, clients, bodies, peak = asyncio.run(scenario())
    assert [client.status for client in clients] == [200, OVER_BUDGET, OVER_BUDGET]
    assert bodies == [b"A" * 500] and bound.over_budget_refused == 2
    assert peak <= 1000 and bound.held == 0 and bound.receiving == 0 and bound.inflight == 0


def test_large_bodies_leave_a_quarter_of_the_budget_to_single_uploads():
    async def scenario():
        bound, release, bodies, app = budget_bound(max_held=1000, small=100)
        oldest = Client([b"o" * 700])  # large, the oldest: it may fill the whole budget
        first = asyncio.ensure_future(app(scope(700), oldest.receive, oldest.send))
        await asyncio.sleep(0.01)
        large = Client([b"l" * 60, b"l" * 60])  # past one upload's worth at 820 of 1000: over the large share (750)
        single = Client([b"s" * 90])  # one upload's worth: fits in the rest
        others = [asyncio.ensure_future(app(scope(120), large.receive, large.send)),
                  asyncio.ensure_future(app(scope(90), single.receive, single.send))]
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.wait_for(asyncio.gather(first, *others), 2.0)
        return bound, oldest, large, single, bodies

    bound, oldest, large, single, bodies = asyncio.run(scenario())
    assert (oldest.status, large.status, single.status) == (200, OVER_BUDGET, 200)
    assert sorted(bodies) == [b"o" * 700, b"s" * 90] and bound.held == 0


def test_a_handler_holds_bytes_through_the_scope_and_is_told_when_they_do_not_fit():
    async def scenario():
        bound, release, bodies, app = budget_bound(max_held=1000, small=2000)
        answers: list[bool] = []

        async def inflating(scope_, receive, send):
            answers.append(hold_body_bytes(scope_, 600))  # fits: nothing else is held
            await release.wait()
            await answer(200)(scope_, receive, send)

        async def second(scope_, receive, send):
            answers.append(hold_body_bytes(scope_, 600))  # 1200 of 1000 beside the first's 600
            await answer(200)(scope_, receive, send)

        first_client, second_client = Client([b""]), Client([b""])
        first = asyncio.ensure_future(bound.wrap(inflating)(scope(None), first_client.receive, first_client.send))
        await asyncio.sleep(0.01)
        held_while_first_runs = bound.held
        await bound.wrap(second)(scope(None), second_client.receive, second_client.send)
        release.set()
        await asyncio.wait_for(first, 2.0)
        return bound, answers, held_while_first_runs

    bound, answers, held_while_first_runs = asyncio.run(scenario())
    assert answers == [True, False] and held_while_first_runs == 600 and bound.held == 0
    assert hold_body_bytes({"type": "http"}, 10**12)  # no bound in front: nothing to count against


class Stalling(Client):
    """A body that sends ``burst`` at once, then nothing more (``trickle_every_s`` None) or one byte every
    ``trickle_every_s``: ahead of any minimum rate for a long time, and holding its burst meanwhile."""

    def __init__(self, burst: bytes, trickle_every_s: float | None = None) -> None:
        super().__init__([burst])
        self.trickle_every_s, self.sent_burst = trickle_every_s, False

    async def receive(self) -> dict:
        if not self.sent_burst:
            self.sent_burst = True
            return {"type": "http.request", "body": self.chunks[0], "more_body": True}
        await asyncio.sleep(3600 if self.trickle_every_s is None else self.trickle_every_s)
        return {"type": "http.request", "body": b"t", "more_body": True}


@pytest.mark.parametrize("trickle_every_s", [None, 0.3], ids=["stalled", "trickling"])
def test_slow_holders_give_way_when_an_upload_needs_their_room(trickle_every_s):
    """Three bodies send 300 bytes each and then stall (or trickle a byte now and then): far ahead of the
    100 B/s minimum, they hold 900 of the 1000 bytes. An upload of 250 needs 150 more: the slowest holder is cut
    with 408 (the most bytes among equally slow ones), and only it; the upload is answered."""

    async def scenario():
        bound, release, bodies, app = budget_bound(max_held=1000, small=2000, rate=100.0, grace_s=0.2)
        stalling = [Stalling(bytes([65 + n]) * 300, trickle_every_s) for n in range(3)]
        tasks = [asyncio.ensure_future(app(scope(10_000), c.receive, c.send)) for c in stalling]
        peak = [0]
        watcher = asyncio.ensure_future(peak_held(bound, peak))
        await asyncio.sleep(SLOW_WINDOW_MIN_S + 0.1)  # their last window brought (almost) nothing
        upload = Client([b"u" * 250])
        done = asyncio.ensure_future(app(scope(250), upload.receive, upload.send))
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.wait_for(done, 2.0)
        statuses = [c.status for c in stalling]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        watcher.cancel()
        return bound, statuses, upload, bodies, peak[0]

    bound, statuses, upload, bodies, peak = asyncio.run(scenario())
    assert upload.status == 200 and bodies == [b"u" * 250]
    assert sorted(statuses, key=str) == [408, None, None] and bound.slow_cut_for_room == 1
    assert peak <= 1000 and bound.held == 0 and bound.receiving == 0 and bound.inflight == 0


def test_bodies_arriving_at_the_minimum_rate_keep_their_room_and_no_slow_one_is_cut_in_vain():
    """A body arriving at 200 B/s (above the 100 B/s minimum) holds about 420 of 1000 bytes and a stalled one 200:
    an upload of 650 would need more room than the stalled one holds, so nobody is cut and the upload is refused."""

    async def scenario():
        bound, release, bodies, app = budget_bound(max_held=1000, small=2000, rate=100.0, grace_s=0.2)
        arriving = Client([b"a" * 200] + [b"a" * 20] * 40, every_s=0.1)
        stalled = Stalling(b"s" * 200)
        tasks = [asyncio.ensure_future(app(scope(10_000), arriving.receive, arriving.send)),
                 asyncio.ensure_future(app(scope(10_000), stalled.receive, stalled.send))]
        await asyncio.sleep(SLOW_WINDOW_MIN_S + 0.2)
        upload = Client([b"u" * 650])
        await asyncio.wait_for(app(scope(650), upload.receive, upload.send), 2.0)
        statuses = (arriving.status, stalled.status)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return bound, statuses, upload

    bound, statuses, upload = asyncio.run(scenario())
    assert upload.status == OVER_BUDGET and statuses == (None, None) and bound.slow_cut_for_room == 0


def test_front_routes_answer_their_paths_and_are_asked_for_until_the_app_can_tell(monkeypatch):
    """``route_at_front``: the app's own routes are not known at first (``None``: asked again at the next request);
    then a request to a given path goes to its front route, any other to the app."""
    from rampart.api import arrival

    answered: list[str] = []
    asked: list[object] = []

    def by(name: str):
        async def app(scope, receive, send) -> None:
            answered.append(name)
        return app

    served = by("app")

    def routes_of(app):
        asked.append(app)
        return None if len(asked) < 3 else {"/square": by("front")}

    monkeypatch.setattr(arrival, "_bound", None)
    arrival.route_at_front(routes_of)
    try:
        front = arrival.behind_bound(served)
        for path in ("/square", "/square", "/square", "/stats", "/square"):
            asyncio.run(front({"type": "http", "path": path}, None, None))
    finally:
        arrival.route_at_front(None)
    assert answered == ["app", "app", "front", "app", "front"]
    assert asked == [served] * 3  # asked until it could tell, then never again


def test_a_request_that_held_a_large_body_marks_the_heap_trim_when_it_ends_and_a_small_one_does_not():
    """The heap that large bodies leave is given back once no such request has ended for a while (``IdleTrim``):
    each request holding at least ``HEAP_TRIM_BODY_BYTES`` marks work when it ends; smaller ones never do."""
    trims: list[float] = []
    clock = [0.0]
    heap_trim = IdleTrim(2.0, release=lambda: trims.append(clock[0]), clock=lambda: clock[0])

    async def scenario(size: int) -> int | None:
        bound, release, _, app = bound_with(limit=4)
        bound.heap_trim = heap_trim
        release.set()
        client = Client([b"x" * (size // 4)] * 4)
        await asyncio.wait_for(app(scope(size), client.receive, client.send), 2.0)
        return client.status

    assert asyncio.run(scenario(HEAP_TRIM_BODY_BYTES - 4)) == 200
    clock[0] = 10.0
    assert not heap_trim.check() and trims == []  # a small body left nothing to trim
    assert asyncio.run(scenario(HEAP_TRIM_BODY_BYTES)) == 200
    clock[0] = 11.0
    assert not heap_trim.check()  # a large one ended a second ago: not idle yet
    clock[0] = 12.5
    assert heap_trim.check() and trims == [12.5]
