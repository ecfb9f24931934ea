"""``rampart.compat.bentoml_runner_calls``: a runner's batch calls answered in front of BentoML's app, byte for byte as
BentoML's app answers them.

A small runner service (a batchable API over ``RunnerItem``, deterministic answers) is served in process by
BentoML's own ``ServiceAppFactory``, with Rampart's patches applied as in every runner; each request is sent
once through BentoML's whole app and once through the lean route, and the two answers (status, headers, body)
must be equal.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
import time

import bentoml
import numpy as np
import pytest

from _bentoml_impl.serde import Payload, PickleSerde
from bench.runner_call_bench import asgi_call, pickled_call
from rampart.compat import apply_all
from rampart.compat.bentoml_private import service_app_factory
from rampart.compat.bentoml_runner_calls import PICKLE_MEDIA_TYPE, lean_batch_routes
from rampart.config import Settings
from runners.common import RunnerItem, RunnerResult, runner_tracing_config


@bentoml.service(name="rampart_lean_route_check", workers=1, threads=1, traffic={"timeout": 30},
                 logging={"access": {"enabled": False}}, **runner_tracing_config(Settings()))
class Tiny:
    """Answers each item with its pixels' mean over three classes; an item named ``boom`` fails the batch.
    Configured as ``runners.common.define_runner`` configures a runner (timeout, no access log, no spans)."""

    @bentoml.api(route="/square", batchable=True, max_batch_size=8, max_latency_ms=1000)
    def square(self, items: list[RunnerItem]) -> list[RunnerResult]:
        if any(item.request_id == "boom" for item in items):
            raise ValueError("boom")
        return [RunnerResult(probs=np.full(3, item.pixels.mean(), np.float32), batch_size=len(items))
                for item in items]


SERDE = PickleSerde()


def call_body(names: list[str]) -> tuple[bytes, dict[str, str]]:
    """A call as BentoML's proxy (and ``rampart.runner_client``) sends it: the API's input model, pickled."""
    items = [RunnerItem(pixels=np.full((4, 4, 3), i, np.uint8), deadline_epoch_s=time.time() + 60, request_id=name)
             for i, name in enumerate(names)]
    return pickled_call(Tiny.apis["square"].input_spec, items)


def bad_body() -> tuple[bytes, dict[str, str]]:
    """A pickled input whose item lacks ``pixels``: BentoML's validation refuses it."""
    payload = SERDE.serialize_value({"items": [{"deadline_epoch_s": 1.0}]})
    return b"".join(bytes(part) for part in payload.data), {"content-type": PICKLE_MEDIA_TYPE, **payload.headers}


async def request(app, body: bytes, headers: dict[str, str], method: str = "POST") -> tuple[int, list, bytes]:
    """(status, sorted headers, body) of one ASGI request to ``/square``."""
    return await asgi_call(app, "/square", body, headers, method)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``served(check)`` runs ``await check(app)`` against BentoML's app of ``Tiny``, started (its lifespan) once per
    process on an event loop of its own: BentoML's metrics middleware registers its series once per process."""
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(tmp_path_factory.mktemp("metrics")))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(60)

    apply_all()  # Rampart's patches, as service.py applies them in every runner process
    Tiny.inject_config()
    app = service_app_factory()(Tiny, is_main=False, enable_metrics=True)()
    lifespan = app.router.lifespan_context(app)
    run(lifespan.__aenter__())
    run(request(app, *call_body(["warm"])))  # BentoML's app builds its middleware stack at its first request
    yield lambda check: run(check(app))
    run(lifespan.__aexit__(None, None, None))
    run(_cancel_the_rest())  # BentoML's dispatcher controllers
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


async def _cancel_the_rest() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_lean_routes_answer_as_bentomls_app_byte_for_byte(served):
    async def check(app) -> None:
        routes = lean_batch_routes(app)
        assert set(routes) == {"/square"}
        lean = routes["/square"]
        for case in (call_body(["a"]), call_body(["a", "b", "c"]), call_body(["a", "boom"]), bad_body()):
            expected = await request(app, *case)
            assert await request(lean, *case) == expected
        ok = await request(lean, *call_body(["a", "b"]))
        assert ok[0] == 200 and [r.probs[0] for r in _results(ok)] == [0.0, 1.0]
        assert (await request(lean, *call_body(["boom"])))[0] == 500
        assert (await request(lean, *bad_body()))[0] == 400

    served(check)


def test_other_requests_and_other_stacks_go_to_bentomls_app(served):
    async def check(app) -> None:
        body, headers = call_body(["a"])
        lean = lean_batch_routes(app)["/square"]
        as_json = (b'{"items": []}', {"content-type": "application/json"})
        assert await request(lean, *as_json) == await request(app, *as_json)  # not BentoML's pickle: its app answers
        assert await request(lean, body, headers, "PUT") == await request(app, body, headers, "PUT")
        assert lean_batch_routes(app, tracing_excluded=False) == {}  # its spans wanted: BentoML's app traces them
        wrapped = copy.copy(app)
        wrapped.middleware_stack = _Unknown(app.middleware_stack)
        assert lean_batch_routes(wrapped) == {}  # a middleware it does not know (an access log, a limit)
        wrapped.middleware_stack = None
        assert lean_batch_routes(wrapped) is None  # before BentoML's app has built its stack: ask again later

    served(check)


def test_a_lean_call_is_counted_in_bentomls_runner_metrics(served):
    """The series BentoML's runner traffic middleware writes for a call: count and duration by status, the call in
    progress while it runs (back to where it was after), the last request's time."""

    async def check(app) -> None:
        lean = lean_batch_routes(app)["/square"]
        total, duration, in_progress, last = _series(lean, 200)
        before = (total.get(), duration.get(), in_progress.get(), last.get())
        await request(lean, *call_body(["a"]))
        assert total.get() == before[0] + 1 and duration.get() == before[1] + 1
        assert in_progress.get() == before[2] and last.get() >= before[3]
        failed_total = _series(lean, 500)[0]
        failed_before = failed_total.get()
        await request(lean, *call_body(["boom"]))
        assert failed_total.get() == failed_before + 1 and total.get() == before[0] + 1

    served(check)


class _Unknown:
    """A middleware BentoML's default runner stack does not have."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def _results(answer: tuple[int, list, bytes]) -> list[RunnerResult]:
    """The results of an answer, read by BentoML's pickle serde as its client reads them."""
    headers = {k.decode(): v.decode() for k, v in answer[1]}
    return [RunnerResult.model_validate(item) for item in SERDE.deserialize_value(Payload((answer[2],), headers))]


def _series(lean, status: int) -> tuple:
    """Values (``get()``) of BentoML's runner series for ``/square`` answered ``status``: request count, duration
    count, in progress, last request's time, as BentoML's middleware labels them."""
    from bentoml._internal.context import server_context

    middleware = lean.metrics.middleware
    base = {"service_name": server_context.bento_name, "service_version": server_context.bento_version,
            "runner_name": server_context.service_name}
    labels = {"endpoint": "/square", "http_response_code": status, **base}
    duration = middleware.metrics_request_duration.labels(**labels)
    return (middleware.metrics_request_total.labels(**labels)._value, _HistogramCount(duration),
            middleware.metrics_request_in_progress.labels(endpoint="/square", **base)._value,
            middleware.metrics_last_request_timestamp.labels(**base)._value)


class _HistogramCount:
    """A histogram's observation count (the sum of its buckets, which prometheus_client keeps one per range), read
    like a value."""

    def __init__(self, histogram) -> None:
        self.histogram = histogram

    def get(self) -> float:
        return sum(bucket.get() for bucket in self.histogram._buckets)
