"""Low-priority riders: waiting ``X-Priority: low`` images ride in a runner call that a normal image forms
(``rampart.coalesce.Coalescer.top_up``, ``rampart.overload.admission.AdmissionGate.carry``, ``rampart.lane``),
in-process, with stand-in runners."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import numpy as np

from rampart.coalesce import Boarding, Coalescer
from rampart.inputs.buckets import buckets_for_resolution
from rampart.lane import ModelEndpoint, ModelLane
from rampart.overload.admission import AdmissionGate, Shed, ThroughputMeter
from rampart.overload.deadline import Deadline, Share


class Runner:
    """A stand-in runner call: answers ``("ok", name)`` per item after ``delay_s``; records each call's names."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.calls: list[list[str]] = []

    async def __call__(self, bucket: str, items: list) -> list:
        self.calls.append([item["name"] for item in items])
        await asyncio.sleep(self.delay_s)
        return [("ok", item["name"]) for item in items]


def item(name: str, deadline_s: float = 60.0) -> dict:
    return {"name": name, "deadline": time.time() + deadline_s}


def riding_coalescer(runner: Runner, riders: list[str], fill_to: int, item_cost_s=lambda: None):
    """A coalescer whose ``top_up`` hands out ``riders`` (names, in order) and records each offer's room."""
    coalescer = Coalescer(runner, lambda entry: entry["deadline"], 16, 1, item_cost_s)
    offers: list[tuple[int, int]] = []
    futures: dict[str, asyncio.Future] = {}

    def top_up(boarding: Boarding) -> list:
        room = boarding.room
        offers.append((room, boarding.in_call, round(boarding.done_by - time.time(), 1)))
        taken, riders[:] = riders[:room], riders[room:]
        out = []
        for name in taken:
            futures[name] = asyncio.get_running_loop().create_future()
            out.append((item(name), futures[name]))
        return out

    coalescer.top_up, coalescer.fill_to = top_up, lambda: fill_to
    return coalescer, offers, futures


def test_a_call_is_topped_up_to_fill_to_with_riders_that_go_last_and_get_their_own_results():
    runner = Runner()

    async def scenario():
        c, offers, futures = riding_coalescer(runner, ["low-1", "low-2", "low-3"], fill_to=3)
        answer = await c.call("square", item("normal"))
        return answer, offers, {name: await future for name, future in futures.items()}, c.stats

    answer, offers, riders, stats = asyncio.run(scenario())
    assert runner.calls == [["normal", "low-1", "low-2"]]
    assert answer == ("ok", "normal") and riders == {"low-1": ("ok", "low-1"), "low-2": ("ok", "low-2")}
    assert offers == [(2, 1, 0.0)]
    assert (stats.calls, stats.items, stats.riders) == (1, 3, 2)


def test_a_full_call_or_fill_to_one_takes_no_riders():
    runner = Runner()

    async def scenario(fill_to: int, names: str):
        c, offers, _ = riding_coalescer(runner, ["low"], fill_to=fill_to)
        first = asyncio.ensure_future(c.call("square", item("first")))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(c.call("square", item(name))) for name in names]
        await asyncio.gather(first, *rest)
        return offers, c.stats.riders

    assert asyncio.run(scenario(1, "ab")) == ([], 0)  # the default: no riders
    runner.calls.clear()
    offers, riders = asyncio.run(scenario(2, "ab"))
    assert runner.calls == [["first", "low"], ["a", "b"]] and offers == [(1, 1, 0.0)] and riders == 1


def test_riders_never_make_the_call_late_for_an_image_in_it():
    """At 0.1 s an item, a normal image with 0.25 s left takes one rider (two items fit), not three."""
    runner = Runner(delay_s=0.01)

    async def scenario():
        c, offers, _ = riding_coalescer(runner, ["low-1", "low-2", "low-3"], fill_to=4, item_cost_s=lambda: 0.1)
        await c.call("square", item("normal", deadline_s=0.25))
        return offers

    assert asyncio.run(scenario()) == [(1, 1, 0.2)]  # done by: two items at 0.1 s
    assert runner.calls == [["normal", "low-1"]]


def gate() -> AdmissionGate:
    """Window 32 (two batches of 16), low window 1, 10 ms an image."""
    return AdmissionGate("m", max_batch_size=16, concurrent_batches=1, queue_delay_ms=1000,
                         meter=ThroughputMeter(override_ips=100))


async def _low_waiting(g: AdmissionGate, bucket: str, cargo: object) -> tuple:
    """Reserve a low ticket and wait for its turn in ``bucket`` with ``cargo``; return whether it was carried and
    the cargo it still holds (none, once dispatched)."""
    ticket = g.reserve("low", 60)
    async with ticket.turn(lambda: 60.0, bucket, cargo):
        return ticket.carried is not None, ticket.cargo


def hold_the_low_window(g: AdmissionGate) -> tuple[asyncio.Event, asyncio.Task]:
    """A low ticket takes ``g``'s low window, so the next low tickets wait, until the returned event is set; the
    returned task holds it."""
    busy = g.reserve("low", 60)
    hold = asyncio.Event()

    async def holding():
        async with busy.turn(lambda: 60.0, "square", "busy"):
            await hold.wait()
    return hold, asyncio.create_task(holding())


def test_the_gate_carries_waiting_low_tickets_of_the_bucket_only_while_the_call_is_its_only_higher_work():
    async def scenario():
        g = gate()
        hold, holder = hold_the_low_window(g)
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(_low_waiting(g, bucket, bucket + str(i)))
                   for i, bucket in enumerate(["square", "landscape", "square", "square"])]
        await asyncio.sleep(0.01)
        normal = g.reserve("normal", 60)
        async with normal.turn(lambda: 60.0, "square"):
            assert g.carry("square", 2, in_call=0) == []  # a call of no higher-class image carries nobody
            other = g.reserve("normal", 60)
            async with other.turn(lambda: 60.0, "landscape"):
                assert g.carry("square", 2, in_call=1) == []  # another normal image is with the runner too
            carried = g.carry("square", 2, in_call=1)
            assert [cargo for _, cargo in carried] == ["square0", "square2"]  # oldest first, this bucket only
            assert all(t.carried is not None and not t.queued and t.cargo is None for t, _ in carried)
            assert g.dispatched == 4 and g.dispatched_low == 3
            for ticket, _ in carried:
                ticket.carried.set_result("answer")
            done = await asyncio.gather(*waiting[:1], waiting[2])
        hold.set()
        await holder
        waiting[1].cancel()
        waiting[3].cancel()
        return done, g

    done, g = asyncio.run(scenario())
    assert done == [(True, None), (True, None)]
    assert g.dispatched == 0 and g.dispatched_low == 0


def test_low_tickets_ride_past_at_most_riders_ahead_images_in_calls_out_and_never_ahead_of_waiting_images():
    """Normal images already in calls out are ahead of the call being formed: with ``riders_ahead`` 1 a rider may
    board past one of them, not two, and with 0 past none; an image still waiting in the coalescer for a later call
    (``behind``) would be delayed, so nobody boards."""
    async def scenario(ahead: int, out: int, behind: int = 0) -> list:
        g = AdmissionGate("m", max_batch_size=16, concurrent_batches=1, queue_delay_ms=1000,
                          meter=ThroughputMeter(override_ips=100), riders_ahead=ahead)
        hold, holder = hold_the_low_window(g)
        await asyncio.sleep(0)
        waiting = asyncio.create_task(_low_waiting(g, "square", "rider"))
        await asyncio.sleep(0.01)
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(out):  # in calls out, ahead of the one being formed
                await stack.enter_async_context(g.reserve("normal", 60).turn(lambda: 60.0, "landscape"))
            await stack.enter_async_context(g.reserve("normal", 60).turn(lambda: 60.0, "square"))  # forms the call
            riders = g.carry("square", 1, in_call=1, behind=behind)
            for ticket, _ in riders:
                ticket.carried.set_result("answer")
            if riders:
                await waiting
        hold.set()
        await holder
        waiting.cancel()
        return [cargo for _, cargo in riders]

    assert asyncio.run(scenario(ahead=1, out=1)) == ["rider"]
    assert asyncio.run(scenario(ahead=1, out=2)) == []
    assert asyncio.run(scenario(ahead=1, out=1, behind=1)) == []
    assert asyncio.run(scenario(ahead=0, out=1)) == []
    assert asyncio.run(scenario(ahead=0, out=0)) == ["rider"]


def test_a_boarding_counts_the_items_left_waiting_for_later_calls_in_every_bucket():
    """Two buckets each with a call out and an image waiting for the next: when the square call returns, the call
    formed from its waiting image is offered riders with the landscape image still waiting behind it."""
    boardings: list[Boarding] = []

    async def send(bucket: str, items: list) -> list:
        await asyncio.sleep(0.05 if bucket == "square" else 0.2)
        return [("ok", entry["name"]) for entry in items]

    async def scenario():
        c = Coalescer(send, lambda entry: entry["deadline"], 16)
        c.fill_to = lambda: 2
        c.top_up = lambda boarding: boardings.append(boarding) or []
        calls = [asyncio.ensure_future(c.call(bucket, item(name))) for bucket, name in
                 [("square", "s1"), ("landscape", "l1"), ("square", "s2"), ("landscape", "l2")]]
        await asyncio.gather(*calls)

    asyncio.run(scenario())
    assert [(b.bucket, b.in_call, b.behind) for b in boardings] == [
        ("square", 1, 0), ("landscape", 1, 0), ("square", 1, 1), ("landscape", 1, 0)]


def test_no_low_ticket_is_carried_while_a_higher_class_waits_for_dispatch():
    async def scenario():
        g = AdmissionGate("m", max_batch_size=2, concurrent_batches=1, queue_delay_ms=1000,
                          meter=ThroughputMeter(override_ips=100))  # window 4, low window 1
        first = g.reserve("normal", 60)
        async with first.turn(lambda: 60.0, "square"):
            low = asyncio.create_task(_low_waiting(g, "square", "low"))
            await asyncio.sleep(0.01)
            g.dispatched += 3  # the window is full: the next normal ticket waits for dispatch
            waiting = asyncio.create_task(_normal_turn(g))
            await asyncio.sleep(0.01)
            carried = g.carry("square", 1, in_call=1)
            g.dispatched -= 3
        low.cancel()
        waiting.cancel()
        return carried

    assert asyncio.run(scenario()) == []


async def _normal_turn(g: AdmissionGate) -> None:
    ticket = g.reserve("normal", 60)
    async with ticket.turn(lambda: 60.0, "square"):
        await asyncio.sleep(0)


def run_through_lane(second_low_deadline_ms: float, item_cost_s: float | None = None):
    """A lane on a coalescing endpoint: a low image occupies the low window, a second (``second_low_deadline_ms``)
    waits; a normal image (10 s deadline) then forms a call that may carry it. Returns each request's answer,
    the runner's calls (each image's value, in order), the coalescer and the lane."""
    calls: list[list[float]] = []

    async def send(bucket: str, items: list) -> list:
        calls.append([float(entry.pixels[0, 0, 0]) for entry in items])
        await asyncio.sleep(0.05)
        return [SimpleNamespace(expired=False, probs=np.full(3, entry.pixels[0, 0, 0], np.float32), inference_ms=1.0,
                                batch_size=len(items)) for entry in items]

    coalescer = Coalescer(send, lambda entry: entry.deadline_epoch_s, max_items=16, item_cost_s=lambda: item_cost_s)

    async def call(bucket: str, pixels: np.ndarray, deadline_epoch_s: float):
        from rampart.lane import RunnerResult
        return RunnerResult.from_wire(await coalescer.call(bucket, SimpleNamespace(pixels=pixels,
                                                                                    deadline_epoch_s=deadline_epoch_s)))

    def accept_riders(source, fill_to):
        coalescer.top_up = lambda boarding: [(SimpleNamespace(pixels=pixels, deadline_epoch_s=deadline), future)
                                             for pixels, deadline, future in source(boarding)]
        coalescer.fill_to = fill_to

    buckets = buckets_for_resolution(32)
    endpoint = ModelEndpoint("m", "v1", ["a", "b", "c"], buckets, call, accept_riders=accept_riders)
    lane = ModelLane("primary", endpoint, gate(), None, Share.PRIMARY)
    lane.seed({"warmup_ms_per_image": 10.0, "compute_batch_size": 2})
    square = buckets["square"]

    async def request(priority: str, value: int, deadline_ms: float = 10_000, delay_s: float = 0.0):
        await asyncio.sleep(delay_s)
        ticket = lane.reserve(priority, Deadline(deadline_ms))
        assert not isinstance(ticket, Shed)
        attempt = await lane.attempt(ticket, (square, np.full((4, 4, 3), value, np.uint8)), Deadline(deadline_ms))
        return float(attempt.answer.probs[0])

    async def scenario():
        return await asyncio.gather(request("low", 1), request("low", 2, second_low_deadline_ms, 0.01),
                                    request("normal", 3, delay_s=0.02))

    return asyncio.run(scenario()), calls, coalescer, lane


def test_through_the_lane_a_waiting_low_image_rides_with_a_normal_one_and_both_get_their_answers():
    """The waiting low image rides in the normal image's call: the runner sees [normal, low] in one call, and each
    request gets its own answer."""
    answers, calls, coalescer, lane = run_through_lane(10_000)
    assert answers == [1.0, 2.0, 3.0]
    assert calls == [[1.0], [3.0, 2.0]]  # the waiting low image rode with the normal one
    assert coalescer.stats.riders == 1 and lane.gate.dispatched == 0 and lane.fill_to == 2


def test_a_low_image_that_would_come_back_late_from_the_call_does_not_board_it():
    """At 1 s an image, the normal image's call topped up to two is predicted done in 2 s: a low image with 1.5 s
    left stays waiting (it would only be dropped by the runner as late) and gets its own turn after the call."""
    answers, calls, coalescer, lane = run_through_lane(1_500, item_cost_s=1.0)
    assert answers == [1.0, 2.0, 3.0]
    assert calls == [[1.0], [3.0], [2.0]]
    assert coalescer.stats.riders == 0 and lane.gate.dispatched == 0


class Pixels:
    """A stand-in for a decoded image a ticket carries (weakly referable, to see whether anything still holds it)."""


def test_a_ticket_that_leaves_the_queue_keeps_no_cargo_and_the_heap_drops_such_tickets():
    """A low ticket waiting at the top of the heap while the low window is taken holds back every entry behind it;
    requests that hung up behind it must not keep their pixels alive, nor grow the heap without bound."""
    import gc
    import weakref

    async def scenario():
        g = gate()
        g.dispatched = g.dispatched_low = 1  # a low image is with the runner: the next low tickets wait
        head = asyncio.create_task(_low_waiting(g, "portrait", ("head", 0.0)))
        await asyncio.sleep(0)
        refs = []
        for _ in range(500):
            pixels = Pixels()
            refs.append(weakref.ref(pixels))
            waiting = asyncio.create_task(_low_waiting(g, "square", (pixels, 0.0)))
            del pixels
            await asyncio.sleep(0)
            waiting.cancel()  # the client hung up
            await asyncio.gather(waiting, return_exceptions=True)
        gc.collect()
        # The last request's own frames stay alive a little longer (asyncio keeps its CancelledError's traceback);
        # the gate must hold none of the others.
        alive, heap = sum(ref() is not None for ref in refs[:-1]), len(g._heap)
        head.cancel()
        await asyncio.gather(head, return_exceptions=True)
        return alive, heap, g

    alive, heap, g = asyncio.run(scenario())
    assert alive == 0
    assert heap <= 2 * 1 + AdmissionGate.HEAP_SLACK + 1  # the head ticket, and at most the slack of stale entries
