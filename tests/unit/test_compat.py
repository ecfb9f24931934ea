"""``rampart.compat``, the compat package: the version guard, the upstream source each patch was written for,
what each patch does, that no code outside the package imports a third-party private module, and that the
in-flight bound (``rampart.api.arrival``) holds on uvicorn's h11 protocol with no httptools patch."""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rampart import compat
from rampart.compat.targets import TARGETS, source_sha256, upstream_source

ROOT = Path(__file__).resolve().parents[2]

#: Every patch, as ``module.function`` in ``rampart.compat``: those ``apply_all`` applies, and
#: ``wake_on_release``, which ``runners.common`` applies (``RUNNER_DISPATCH_WAKE``).
PATCHES = {
    "bentoml_server.cancel_request_timers", "bentoml_server.bound_endpoint_labels",
    "bentoml_server.cache_io_media_types", "bentoml_batching.dispatch_when_free", "bentoml_batching.wake_on_release",
    "circus_arbiter.keep_runner_sockets_until_stopped", "uvicorn_httptools.limit_request_heads",
    "uvicorn_httptools.stamp_arrivals", "uvicorn_app.serve_behind_bound", "bentoml_wire.RunnerWire",
    "bentoml_wire.runner_address", "uvicorn_cycle.connection_closed", "bentoml_runner_calls.lean_batch_routes",
}


# -- the version guard --------------------------------------------------------------------------------------------

def test_the_installed_versions_are_the_pinned_ones():
    compat.check_versions()  # raises RuntimeError otherwise
    assert {name: importlib.metadata.version(name) for name in compat.PINS} == compat.PINS


def test_another_version_is_refused_with_the_expected_and_found_versions():
    found = {**compat.PINS, "bentoml": "1.4.30"}
    with pytest.raises(RuntimeError, match=r"bentoml 1\.4\.30 \(expected 1\.4\.29\)") as refused:
        compat.check_versions(found.__getitem__)
    assert "uvicorn" not in str(refused.value) and "docs/compat.md" in str(refused.value)

    def without_httptools(name: str) -> str:
        if name == "httptools":
            raise importlib.metadata.PackageNotFoundError(name)
        return compat.PINS[name]

    with pytest.raises(RuntimeError, match=r"httptools not installed \(expected 0\.9\.0\)"):
        compat.check_versions(without_httptools)


def test_apply_all_refuses_before_patching_anything_on_another_version(monkeypatch):
    from uvicorn import config

    protocols = dict(config.HTTP_PROTOCOLS)
    monkeypatch.setitem(compat.PINS, "uvicorn", "0.0.1")
    with pytest.raises(RuntimeError, match=r"uvicorn 0\.54\.0 \(expected 0\.0\.1\)"):
        compat.apply_all()
    assert config.HTTP_PROTOCOLS == protocols


def pins_in(path: Path) -> dict[str, str]:
    """``name==version`` lines of a pip requirements or constraints file, names lower-cased."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def test_the_guard_pins_what_requirements_and_constraints_pin():
    for pin_file in ("requirements.txt", "constraints.txt"):
        pinned = pins_in(ROOT / pin_file)
        assert {name: pinned.get(name) for name in compat.PINS} == compat.PINS, pin_file


# -- the upstream source of every patch ---------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t.module}.{t.qualname}")
def test_each_patched_upstream_object_is_the_source_the_patch_was_written_for(target):
    assert source_sha256(target.module, target.qualname) == target.sha256, (
        f"{target.module}.{target.qualname} changed since the pinned version: read rampart.compat."
        f"{target.patch} again against it (docs/compat.md, Upgrading BentoML), then record the new hash")


def test_every_patch_names_its_upstream_objects():
    assert {target.patch for target in TARGETS} == PATCHES
    for patch in PATCHES:
        module, function = patch.split(".")
        assert callable(getattr(__import__(f"rampart.compat.{module}", fromlist=[function]), function)), patch


def test_the_source_is_read_from_the_file_not_the_patched_object():
    from bentoml._internal.server.http.traffic import TimeoutMiddleware

    from rampart.compat.bentoml_server import cancel_request_timers

    cancel_request_timers()
    assert getattr(TimeoutMiddleware.__call__, "_rampart_fixed", False)
    source = upstream_source("bentoml._internal.server.http.traffic", "TimeoutMiddleware.__call__")
    assert "call_later" in source and "asyncio.timeout" not in source  # BentoML's own, not the patch
    assert upstream_source("uvicorn.config", "HTTP_PROTOCOLS").startswith("HTTP_PROTOCOLS")
    for module, qualname in (("uvicorn.config", "Config.no_such_method"), ("no_such_module_here", "x")):
        with pytest.raises(LookupError):
            upstream_source(module, qualname)


def test_apply_all_applies_every_patch_and_marks_what_it_replaced(monkeypatch):
    """Each patched attribute is saved first (``monkeypatch`` puts it back): the other tests see uvicorn as it was."""
    from _bentoml_sdk.io_models import IOMixin
    from bentoml._internal.marshal.dispatcher import CorkDispatcher, Optimizer
    from bentoml._internal.server.http import instruments, traffic
    from bentoml._internal.utils import circus as bentoml_circus
    from uvicorn import config
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    patched = [(traffic.TimeoutMiddleware, "__call__", "_rampart_fixed"),
               (instruments.RunnerTrafficMetricsMiddleware, "__call__", "_rampart_fixed"),
               (instruments.HTTPTrafficMetricsMiddleware, "__call__", "_rampart_fixed"),
               (IOMixin, "mime_type", "_rampart_cached"),
               (Optimizer, "trigger_refresh", "_rampart_fixed"),
               (CorkDispatcher, "train_optimizer", "_rampart_fixed"),
               (bentoml_circus.Arbiter, "stop", "_rampart_fixed"),
               (HttpToolsProtocol, "on_message_begin", "_rampart_stamped"),
               (config.Config, "load", "_rampart_front")]
    for owner, name, _ in patched:
        if name in vars(owner):
            monkeypatch.setattr(owner, name, vars(owner)[name])
    monkeypatch.setattr(bentoml_circus.Arbiter, "stop_controller_and_close_sockets",
                        bentoml_circus.Arbiter.stop_controller_and_close_sockets)
    for name in ("auto", "httptools"):
        monkeypatch.setitem(config.HTTP_PROTOCOLS, name, config.HTTP_PROTOCOLS[name])

    compat.apply_all()
    compat.apply_all()  # idempotent: nothing is wrapped twice
    for owner, name, mark in patched:
        assert getattr(getattr(owner, name), mark, False), (owner, name)
    assert config.HTTP_PROTOCOLS["auto"] == config.HTTP_PROTOCOLS["httptools"] == \
        "rampart.compat.uvicorn_httptools:HeadLimitedProtocol"


# -- what the patches do (BentoML's batching and timeout middleware) -----------------------------------------------

def test_bentoml_dispatcher_learns_no_batching_wait():
    import runners.common  # noqa: F401  (applies dispatch_when_free)
    from bentoml._internal.marshal.dispatcher import Optimizer

    optimizer = Optimizer(max_latency=60.0)
    for _ in range(60):  # batches that waited 300 ms for a busy model, as under overload
        optimizer.log_outbound(n=16, wait=0.3, duration=0.2)
    optimizer.trigger_refresh()
    assert optimizer.wait == 0.0
    assert optimizer.o_a > 0  # the batch-cost fit is kept


def held_while_training(patched: bool) -> list[float]:
    """In a child process: a fresh BentoML ``CorkDispatcher`` (max batch 4) in front of a 50 ms model, called
    one request at a time through the optimizer's 11 training batches and 4 more. Returns each call's time
    over the model's own time, less 1: how long the dispatcher held the request, in model times."""
    code = f"""
import asyncio, json, time
from bentoml._internal.marshal import dispatcher
from rampart.compat.bentoml_batching import dispatch_when_free
if {patched}:
    dispatch_when_free()
computed = []
def model(batch):
    started = time.perf_counter()
    time.sleep(0.05)
    computed.append(time.perf_counter() - started)
    return list(batch)
async def main():
    call = dispatcher.CorkDispatcher(60_000, 4, fallback=lambda: None, get_batch_size=lambda x: 1)(model)
    held = []
    for i in range(15):
        started = time.perf_counter()
        assert await call(i) == i
        held.append((time.perf_counter() - started) / computed[-1] - 1)
    print(json.dumps(held), flush=True)
asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_bentoml_dispatcher_never_holds_a_lone_request_to_train_on_a_batch():
    """Upstream's training calls for batches of 2 and 3 hold a lone request for 3a and 4a (a: the fitted cost per
    image, half a model time here: 1.5 and 2 model times); patched, every call after the first (which starts the
    dispatcher, a third of a model time either way) takes about the model's own time."""
    upstream = held_while_training(patched=False)
    patched = held_while_training(patched=True)
    assert sum(h > 1.0 for h in upstream) >= 2, upstream
    assert max(patched[1:]) < 0.5, patched


def dispatcher_polls_while_a_batch_computes(patched: bool) -> tuple[int, int, list]:
    """In a child process: BentoML's ``CorkDispatcher`` (max batch 4) with a 50 ms batch and 8 callers, so
    that requests wait while a batch computes. Returns (1 ms polls of the controller, batches, answers)."""
    code = f"""
import asyncio, json, time
from bentoml._internal.marshal import dispatcher
from rampart.compat.bentoml_batching import dispatch_when_free, wake_on_release
dispatch_when_free()
if {patched}:
    wake_on_release()
polls, batches = [0], [0]
sleep = asyncio.sleep
async def counting_sleep(delay, *args):
    if delay == dispatcher.CorkDispatcher.TICKET_INTERVAL:
        polls[0] += 1
    return await sleep(delay, *args)
dispatcher.asyncio.sleep = counting_sleep  # the module's own reference: only the dispatcher's sleeps count
def model(batch):
    batches[0] += 1
    time.sleep(0.05)
    return [x * 10 for x in batch]
async def main():
    cork = dispatcher.CorkDispatcher(60_000, 4, fallback=lambda: None, get_batch_size=lambda x: 1)
    call = cork(model)
    for i in range(12):  # the optimizer's 11 training batches, one request each (they poll either way)
        await call(i)
    polls[0] = batches[0] = 0
    answers = await asyncio.gather(*(call(i) for i in range(24)))
    print(json.dumps([polls[0], batches[0], answers]), flush=True)
asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    polls, batches, answers = json.loads(done.stdout.strip().splitlines()[-1])
    return polls, batches, answers


def test_bentoml_dispatcher_waits_for_the_batch_slot_instead_of_polling():
    """Upstream polls every 1 ms while its one batch slot is taken and requests wait; the patch waits for the
    release. Both dispatch every request, in batches of at most 4, and answer each with its own result."""
    upstream = dispatcher_polls_while_a_batch_computes(patched=False)
    released = dispatcher_polls_while_a_batch_computes(patched=True)
    assert upstream[0] >= 5 * upstream[1], upstream  # tens of polls per 50 ms batch upstream
    assert released[0] == 0, released
    for _, batches, answers in (upstream, released):
        assert answers == [i * 10 for i in range(24)] and 6 <= batches <= 24


def test_bentoml_timeout_middleware_still_answers_504_when_nothing_was_sent_in_time():
    from bentoml._internal.server.http.traffic import TimeoutMiddleware

    from rampart.compat.bentoml_server import cancel_request_timers

    cancel_request_timers()

    async def silent(scope, receive, send):
        await asyncio.sleep(3600)

    async def slow_body(scope, receive, send):  # starts answering at once, finishes after the timeout
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario(app):
        sent = []

        async def send(message):
            sent.append(message.get("status"))

        await TimeoutMiddleware(app, timeout=0.05)({"type": "http"}, None, send)
        return sent

    assert asyncio.run(scenario(silent))[0] == 504
    assert asyncio.run(scenario(slow_body)) == [200, None]


def test_bentoml_timeout_middleware_no_longer_keeps_finished_requests_alive():
    from bentoml._internal.server.http.traffic import TimeoutMiddleware

    from rampart.compat.bentoml_server import cancel_request_timers

    cancel_request_timers()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario():
        middleware = TimeoutMiddleware(app, timeout=70)

        async def send(message):
            pass

        for _ in range(100):
            await middleware({"type": "http"}, None, send)
        loop = asyncio.get_running_loop()
        return sum(1 for handle in loop._scheduled if not handle.cancelled())  # asyncio's timer heap

    assert asyncio.run(scenario()) == 0  # unpatched BentoML 1.4.29: 100 timers pending for 70 s


# -- no private import outside rampart.compat ---------------------------------------------------------------------

#: Third-party modules whose insides are private: importing one (or a name from one) is for rampart.compat only.
PRIVATE = re.compile(r"^(_bentoml_impl|_bentoml_sdk|bentoml\._internal|circus|httptools|uvicorn\.|starlette\._)")
#: ``from X import Y`` where ``X.Y`` is private although ``X`` is not.
PRIVATE_FROM = {"bentoml": {"_internal"}, "uvicorn": {"config", "protocols", "lifespan", "loops", "middleware",
                                                       "supervisors", "_types", "importer", "server", "main"}}
SKIPPED = {"tests", ".venv", ".git", "node_modules", "__pycache__"}


def private_imports(path: Path) -> list[str]:
    """``file:line module`` for each import of a private third-party module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names
                                       if alias.name in PRIVATE_FROM.get(node.module, ())]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {module}" for module in modules if PRIVATE.match(module)]
    return found


def python_files() -> list[Path]:
    """Every ``*.py`` of the project outside ``SKIPPED`` folders, not symlinks. The walk prunes those folders
    rather than filtering after: ``Path.rglob`` would read all of ``.venv`` (tens of thousands of files) first."""
    found = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED]
        found += [path for name in names if name.endswith(".py") and not (path := Path(folder, name)).is_symlink()]
    return found


def test_no_code_outside_rampart_compat_imports_a_private_module():
    outside = [found for path in python_files() if path.relative_to(ROOT).parts[:2] != ("rampart", "compat")
               for found in private_imports(path)]
    assert outside == []
    inside = [found for path in (ROOT / "rampart" / "compat").glob("*.py") for found in private_imports(path)]
    assert len(inside) >= 8  # the check sees the imports it is meant to find


def test_the_in_flight_bound_hooks_in_without_httptools():
    """The in-flight bound's hook (``serve_behind_bound``) works on a uvicorn without httptools at all."""
    code = ("import sys; sys.modules['httptools'] = None\n"
            "import uvicorn\n"
            "from rampart.compat.uvicorn_app import serve_behind_bound\n"
            "serve_behind_bound()\n"
            "async def app(scope, receive, send): pass\n"
            "config = uvicorn.Config(app, http='auto', lifespan='off', log_config=None)\n"
            "config.load()\n"
            "assert config.loaded_app._rampart_front, config.loaded_app\n"
            "assert config.http_protocol_class.__name__ == 'H11Protocol', config.http_protocol_class\n"
            "print('in-flight bound on', config.http_protocol_class.__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "in-flight bound on H11Protocol" in done.stdout, done.stderr


# -- the in-flight bound in front of uvicorn's app, whichever protocol serves -------------------------------------

class InProcessServer:
    """uvicorn on a free loopback port, in a thread, serving ``app`` with protocol ``http`` (a uvicorn protocol
    name or class); ``config``, ``port``, ``connect()``, ``stop()``."""

    def __init__(self, app, http) -> None:
        import socket

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.config = uvicorn.Config(app, http=http, loop="asyncio", lifespan="off", log_config=None)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        started = time.monotonic()
        while not self.server.started and time.monotonic() - started < WAIT_S:
            time.sleep(0.01)
        assert self.server.started, "the in-process uvicorn did not start"

    def connect(self, timeout_s: float = 5.0):
        import socket

        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


#: Longest wait (s) for the in-process server to start or for a request to reach the app.
WAIT_S = 5.0


def first_line(sock, request: bytes) -> bytes:
    """Send ``request`` on ``sock`` and return the status line of its answer."""
    sock.sendall(request)
    return sock.recv(65536).split(b"\r\n")[0]


@pytest.mark.parametrize("protocol", ["h11", "httptools-patched"])
def test_the_in_flight_bound_holds_on_uvicorns_h11_protocol_without_the_httptools_patch(protocol, monkeypatch):
    """The bound (``rampart.api.arrival.bound_inflight``) is entered through ``Config.load``
    (``rampart.compat.uvicorn_app``), not through the httptools protocol's ``on_message_begin``: on uvicorn's own
    h11 protocol, with a bound of 1, a second request to a bounded path while one is in flight is refused 429
    before the app runs, a request to another path still passes, and the next one after is served. The same
    holds on the patched httptools protocol ``bentoml serve`` runs."""
    from uvicorn import config
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from rampart.api import arrival
    from rampart.compat.uvicorn_app import serve_behind_bound
    from rampart.compat.uvicorn_httptools import HeadLimitedProtocol

    monkeypatch.setattr(config.Config, "load", config.Config.load)  # put uvicorn back for the other tests
    monkeypatch.setattr(arrival, "_bound", arrival._bound)  # and the bound installed before, if any
    serve_behind_bound()
    entered, release = [], threading.Event()

    async def hello(scope, receive, send):
        if scope["type"] != "http":
            return
        entered.append(scope["path"])
        if scope["path"] == "/bounded" and len(entered) == 1:
            await asyncio.get_running_loop().run_in_executor(None, release.wait, WAIT_S)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def refuse(scope, receive, send):
        await send({"type": "http.response.start", "status": 429, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    bound = arrival.bound_inflight(lambda: 1, refuse, ["/bounded"])
    server = InProcessServer(hello, "h11" if protocol == "h11" else HeadLimitedProtocol)
    try:
        if protocol == "h11":
            assert server.config.http_protocol_class is H11Protocol
            assert not issubclass(server.config.http_protocol_class, HeadLimitedProtocol)
        first = server.connect()
        first.sendall(b"GET /bounded HTTP/1.1\r\nHost: x\r\n\r\n")
        waited = time.monotonic()
        while bound.inflight < 1 and time.monotonic() - waited < WAIT_S:  # the first request is in the app
            time.sleep(0.01)
        replies = []
        for path in (b"/bounded", b"/other"):
            with server.connect() as sock:
                replies.append(first_line(sock, b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path))
        release.set()
        replies.append(first.recv(65536).split(b"\r\n")[0])
        first.close()
        with server.connect() as sock:
            replies.append(first_line(sock, b"GET /bounded HTTP/1.1\r\nHost: x\r\n\r\n"))
    finally:
        release.set()
        server.stop()
    assert replies == [b"HTTP/1.1 429 Too Many Requests", b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]
    assert entered == ["/bounded", "/other", "/bounded"] and bound.refused == 1 and bound.inflight == 0
