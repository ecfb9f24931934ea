"""A request leaves nothing for the cycle collector: what it built is freed by reference counting when it ends.

Under overload most requests end in an exception (a shed, a timeout), and an exception's traceback
holds the frames it passed through: a frame that also holds the exception, its task or the request
makes a reference cycle, and then the request's whole object graph (its ASGI closures, its task, its
body) waits for a collection. At 5x overload that was over 100 garbage objects per request, and the
API worker's full collections took 100-220 ms each, stalls that land on answers due at their deadline
(docs/overload.md, "Event-loop stalls"). Each check runs with the collector off, so a cycle shows.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import types
import weakref
from pathlib import Path

import pytest
from starlette.requests import Request

import rampart
from rampart.hangup import serve_until_hang_up
from rampart.inputs.pool import BoundedPool
from rampart.overload.admission import Shed
from rampart.overload.deadline import run_within
from tests.unit.standins import CAT, COFFEE, fill

#: The folder of Rampart's package, with a trailing separator: a frame of a file under it is Rampart's code. A
#: path merely containing "/rampart/" is not: a clone at ``…/rampart/`` has its virtualenv's libraries under it.
RAMPART_SOURCE = str(Path(rampart.__file__).parent) + "/"


@pytest.fixture
def no_collector():
    """The cycle collector off for the test (what a cycle holds stays held), on again after it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_shed_at_the_gate_is_freed_when_it_is_handled(rig, no_collector):
    gate = rig.pipeline.primary.gate
    tickets = fill(gate)
    try:
        with pytest.raises(Shed) as raised:
            gate.reserve(False, 60.0)
        shed = weakref.ref(raised.value)
        raised = None  # pytest's ExceptionInfo holds the exception, as an except clause's name would
        assert shed() is None, "the shed's traceback holds a frame that holds the shed"
    finally:
        for ticket in tickets:
            ticket.cancel()


def test_a_call_that_raised_within_its_time_is_freed_with_its_task():
    tasks: list[weakref.ref] = []

    async def shed_call():
        tasks.append(weakref.ref(asyncio.current_task()))
        raise Shed("predicted_late", "a gate's refusal at the request's turn")

    async def main() -> weakref.ref:
        try:
            await run_within(shed_call(), 1.0)
        except Shed as shed:
            return weakref.ref(shed)
        raise AssertionError("run_within did not raise the call's exception")

    gc.collect()
    gc.disable()
    try:
        shed = asyncio.run(main())
        assert shed() is None and tasks[0]() is None, "run_within's frame holds the task whose exception it raised"
    finally:
        gc.enable()


def test_a_watched_request_is_freed_when_it_ends(no_collector):
    """``serve_until_hang_up`` starts a watcher task once the body is in; BentoML keeps the Starlette request in
    a context variable while the request runs (``bentoml.context``), which the watcher's context copies: the request must not hold the
    watcher through ``receive`` once the request has ended."""
    current_request: contextvars.ContextVar[Request] = contextvars.ContextVar("current_request")
    requests: list[weakref.ref] = []

    async def app(scope, receive, send) -> None:  # as BentoML's ServiceContext.in_request sets the variable
        request = Request(scope, receive)
        token = current_request.set(request)
        try:
            requests.append(weakref.ref(request))
            await request.body()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        finally:
            current_request.reset(token)

    async def main() -> None:
        messages = [{"type": "http.request", "body": CAT, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)  # the connection stays open: no disconnect

        async def send(message: dict) -> None:
            pass

        scope = {"type": "http", "method": "POST", "path": "/classify", "headers": [], "query_string": b""}
        await asyncio.create_task(serve_until_hang_up(app, scope, receive, send))
        await asyncio.sleep(0)  # the cancelled watcher unwinds

    asyncio.run(main())
    assert requests and requests[0]() is None, "the ended request is held in a cycle through its watcher"


def rampart_objects_in_cycles() -> list[str]:
    """Objects of Rampart's modules, and frames of its code, that a collection found unreachable and in a cycle."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        garbage = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    ids = {id(item) for item in garbage}

    def ours(item) -> str | None:
        if isinstance(item, types.FrameType):
            name = item.f_code.co_filename
            return f"frame {Path(name).name}:{item.f_code.co_name}" if name.startswith(RAMPART_SOURCE) else None
        module = type(item).__module__ or ""
        return f"{module}.{type(item).__qualname__}" if module.split(".")[0] == "rampart" else None

    def in_cycle(start) -> bool:
        seen, todo = {id(start)}, [start]
        while todo:
            for referent in gc.get_referents(todo.pop()):
                if referent is start:
                    return True
                if id(referent) in ids and id(referent) not in seen:
                    seen.add(id(referent))
                    todo.append(referent)
        return False

    found = sorted({name for item in garbage if (name := ours(item)) is not None and in_cycle(item)})
    garbage.clear()
    return found


def test_answers_sheds_and_degraded_answers_through_the_app_leave_no_rampart_cycle(rig, no_collector):
    """The in-process app: a full answer, a primary failure handed to the fallback, a primary gate shed and a
    429 with both gates full; then a collection finds no Rampart object or frame in a cycle."""
    assert rig.client.post("/classify", content=CAT).status_code == 200
    rig.primary.mode = "error"
    assert rig.client.post("/classify", content=COFFEE).json()["degraded_reason"] == "primary_error"
    rig.primary.mode = "ok"
    tickets = fill(rig.pipeline.primary.gate)
    assert rig.client.post("/classify", content=COFFEE + b"\0").json()["degraded_reason"] == "primary_overloaded"
    tickets += fill(rig.pipeline.fallback.gate)
    assert rig.client.post("/classify", content=COFFEE + b"\0\0").status_code == 429
    for ticket in tickets:
        ticket.cancel()
    assert rampart_objects_in_cycles() == []


def test_a_job_that_raised_in_a_decode_worker_process_leaves_no_rampart_cycle(no_collector):
    """An upload that its decode worker refuses (a 400) raised there, and the exception came back through the
    pool's thread and the caller's coroutine: frames of each held it, and the upload with it, in a cycle. Twenty
    concurrent 19 MB uploads refused so left about 400 MB in the API worker until a full collection."""
    pool = BoundedPool(workers=1, queue=2, processes=True, name="rampart-cycles")

    async def refused(**limits) -> None:
        try:
            await pool.run(int, "not a number", **limits)  # ValueError, raised in the worker process
        except ValueError:
            return
        raise AssertionError("the job did not raise")

    try:
        asyncio.run(refused())
        asyncio.run(refused(budget_s=30.0, run_limit_s=30.0))  # the path that watches the run limit
        assert rampart_objects_in_cycles() == []
    finally:
        pool.close()
