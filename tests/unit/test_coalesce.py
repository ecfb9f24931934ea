"""``rampart.coalesce.Coalescer``: images bound for one runner bucket share a call, each keeping its own outcome."""

from __future__ import annotations

import asyncio
import time

import pytest

from rampart.coalesce import Coalescer, ExpiredBeforeSend


class Runner:
    """A stand-in runner call: answers ``("ok", item)`` per item after ``delay_s``; records every call.
    ``fail_when(items)`` true makes that call raise."""

    def __init__(self, delay_s: float = 0.05, fail_when=lambda items: False, short_by: int = 0) -> None:
        self.delay_s, self.fail_when, self.short_by = delay_s, fail_when, short_by
        self.calls: list[tuple[str, list]] = []

    async def __call__(self, bucket: str, items: list) -> list:
        self.calls.append((bucket, [item["name"] for item in items]))
        await asyncio.sleep(self.delay_s)
        if self.fail_when(items):
            raise RuntimeError("the runner call failed")
        return [("ok", item["name"]) for item in items][: len(items) - self.short_by]


def coalescer(runner: Runner, max_items: int = 16, in_flight: int = 1, item_cost_s=lambda: None) -> Coalescer:
    return Coalescer(runner, lambda item: item["deadline"], max_items, in_flight, item_cost_s)


def item(name: str, deadline_s: float = 60.0) -> dict:
    return {"name": name, "deadline": time.time() + deadline_s}


def test_an_idle_bucket_sends_at_once_and_a_busy_one_sends_what_waited_in_one_call_in_order():
    runner = Runner()

    async def scenario():
        c = coalescer(runner)
        first = asyncio.ensure_future(c.call("square", item("a")))
        await asyncio.sleep(0.01)  # "a" is out; these arrive while it computes
        rest = [asyncio.ensure_future(c.call("square", item(name))) for name in "bcd"]
        other = asyncio.ensure_future(c.call("landscape", item("x")))  # another bucket is not held up
        return await asyncio.gather(first, *rest, other), c.stats

    results, stats = asyncio.run(scenario())
    assert results == [("ok", "a"), ("ok", "b"), ("ok", "c"), ("ok", "d"), ("ok", "x")]
    assert runner.calls == [("square", ["a"]), ("landscape", ["x"]), ("square", ["b", "c", "d"])]
    assert (stats.calls, stats.items) == (3, 5)


def test_a_call_carries_at_most_max_items_and_the_rest_go_next():
    runner = Runner()

    async def scenario():
        c = coalescer(runner, max_items=2)
        tasks = [asyncio.ensure_future(c.call("square", item(name))) for name in "abcde"]
        return await asyncio.gather(*tasks)

    assert asyncio.run(scenario()) == [("ok", name) for name in "abcde"]
    assert runner.calls == [("square", ["a"]), ("square", ["b", "c"]), ("square", ["d", "e"])]


def test_in_flight_calls_per_bucket_are_bounded():
    runner = Runner()

    async def scenario():
        c = coalescer(runner, in_flight=2)
        tasks = [asyncio.ensure_future(c.call("square", item(name))) for name in "abcd"]
        return await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert runner.calls == [("square", ["a"]), ("square", ["b"]), ("square", ["c", "d"])]


def test_an_item_whose_deadline_passed_while_it_waited_is_dropped_before_the_call():
    runner = Runner(delay_s=0.1)

    async def scenario():
        c = coalescer(runner)
        first = asyncio.ensure_future(c.call("square", item("a")))
        await asyncio.sleep(0.01)
        late = asyncio.ensure_future(c.call("square", item("late", deadline_s=0.03)))
        keep = asyncio.ensure_future(c.call("square", item("keep")))
        return await asyncio.gather(first, late, keep, return_exceptions=True), c.stats

    results, stats = asyncio.run(scenario())
    assert results[0] == ("ok", "a") and results[2] == ("ok", "keep")
    assert isinstance(results[1], ExpiredBeforeSend) and isinstance(results[1], TimeoutError)  # not runner progress
    assert runner.calls == [("square", ["a"]), ("square", ["keep"])] and stats.expired == 1


def test_a_caller_that_stops_waiting_takes_its_item_back_unsent():
    runner = Runner()

    async def scenario():
        c = coalescer(runner)
        first = asyncio.ensure_future(c.call("square", item("a")))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(c.call("square", item("gone")))
        keep = asyncio.ensure_future(c.call("square", item("keep")))
        await asyncio.sleep(0.01)
        gone.cancel()
        results = await asyncio.gather(first, keep)
        with pytest.raises(asyncio.CancelledError):
            await gone
        return results, c.stats

    results, stats = asyncio.run(scenario())
    assert results == [("ok", "a"), ("ok", "keep")]
    assert runner.calls == [("square", ["a"]), ("square", ["keep"])] and stats.abandoned == 1


def test_a_failed_call_fails_each_of_its_items_and_no_other_call():
    runner = Runner(fail_when=lambda items: any(i["name"] == "bad" for i in items))

    async def scenario():
        c = coalescer(runner)
        first = asyncio.ensure_future(c.call("square", item("a")))
        await asyncio.sleep(0.01)
        shared = [asyncio.ensure_future(c.call("square", item(name))) for name in ("bad", "b")]
        outcomes = await asyncio.gather(first, *shared, return_exceptions=True)
        after = await c.call("square", item("c"))  # the bucket works again
        return outcomes, after

    outcomes, after = asyncio.run(scenario())
    assert outcomes[0] == ("ok", "a")
    assert all(isinstance(o, RuntimeError) for o in outcomes[1:]), outcomes  # each caller hears its own failure
    assert after == ("ok", "c")


def test_a_length_mismatch_fails_the_call_and_names_both_lengths():
    runner = Runner(short_by=1)

    async def scenario():
        return await coalescer(runner).call("square", item("a"))

    with pytest.raises(RuntimeError, match="0 results for 1 items"):
        asyncio.run(scenario())


def test_a_call_carries_no_more_than_the_model_computes_before_the_earliest_deadline_in_it():
    """At 0.1 s an item, items with 0.35 s left go three to a call, never all six in one late call."""
    runner = Runner(delay_s=0.02)

    async def scenario():
        c = coalescer(runner, item_cost_s=lambda: 0.1)
        first = asyncio.ensure_future(c.call("square", item("a")))
        await asyncio.sleep(0.005)
        rest = [asyncio.ensure_future(c.call("square", item(name, deadline_s=0.35))) for name in "bcdefg"]
        return await asyncio.gather(first, *rest, return_exceptions=True)

    asyncio.run(scenario())
    assert [len(names) for _, names in runner.calls] == [1, 3, 3]


def test_bounds_below_one_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        coalescer(Runner(), max_items=0)


def test_the_breaker_counts_one_failure_per_item_of_a_failed_call():
    """Through the pipeline: two requests share a failing call; the primary's breaker hears two failures."""
    import numpy as np

    from rampart.config import Settings
    from rampart.inputs.buckets import buckets_for_resolution
    from rampart.inputs.pool import BoundedPool
    from rampart.overload.deadline import Deadline
    from rampart.pipeline import Pipeline, ModelEndpoint, RunnerResult
    from tests.support import encode, photo

    labels = [f"class {i}" for i in range(1000)]
    sent: list[int] = []

    async def failing(bucket, items):
        sent.append(len(items))
        await asyncio.sleep(0.05)
        raise RuntimeError("primary is broken")

    async def answering(bucket, items):
        probs = np.full(1000, 1e-3, dtype=np.float32)
        return [RunnerResult(probs=probs, inference_ms=1.0, batch_size=len(items)) for _ in items]

    def endpoint(name, resolution, send):
        c = Coalescer(send, lambda item: item[1], max_items=16)
        return ModelEndpoint(name, "v1", labels, buckets_for_resolution(resolution),
                             lambda bucket, pixels, deadline: c.call(bucket, (pixels, deadline)))

    chain = Pipeline(Settings(), endpoint("primary", 260, failing), endpoint("fallback", 224, answering),
                     BoundedPool(2, 8))
    data = [encode(photo("chelsea")), encode(photo("coffee")), encode(photo("rocket"))]

    async def scenario():
        return await asyncio.gather(*(chain.classify(body, 3, Deadline(5_000)) for body in data))

    answers = asyncio.run(scenario())
    assert all(a["degraded_reason"] == "primary_error" for a in answers)
    assert sum(sent) == 3 and chain.primary.failures["error"] == 3  # one per item, however the calls were formed
