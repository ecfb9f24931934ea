"""Start-up and graceful drain of Rampart's processes (entry service and model runners).

``bentoml serve`` runs every process under one circus arbiter. On SIGTERM the
arbiter sends SIGTERM to all of them at once (``circus.arbiter._stop_watchers``),
and each is a uvicorn server that closes its listening socket at once (BentoML
also deleted the runners' socket files at once; ``rampart.compat.circus_arbiter``
``keep_runner_sockets_until_stopped`` defers that). Left as is, the runners
vanish while the entry service still has requests in flight, and those requests
find no model. Rampart therefore takes over the exit signal in every process
(``intercept_exit_signals``) and orders the exit:

- The entry service's worker (``Lifecycle``) drains: ``/readyz`` turns 503 and
  new requests get 503 ``shutting_down`` at once, while every request already
  admitted runs to its answer. Admitted requests end by their deadline, so the
  drain takes at most ``max_deadline_ms``. Then uvicorn exits as usual.
- Each runner keeps serving until no entry-service worker is alive any more
  (``entry_workers_alive``), at most ``max_deadline_ms`` + ``RUNNER_EXIT_MARGIN_S``,
  then exits as usual.

So the arbiter exits about ``max_deadline_ms`` after SIGTERM at worst, and at
once when idle. Later signals during a drain are ignored (a terminal's Ctrl+C
reaches every process twice: directly and from the arbiter); SIGKILL still
stops everything. Before the runners have warmed up, ``Lifecycle`` refuses
requests with 503 ``not_ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rampart.errors import NotReady, ShuttingDown

__all__ = [
    "logger",
    "ENTRY_SERVICE_NAME",
    "RUNNER_EXIT_MARGIN_S",
    "EXIT_GRACE_S",
    "Lifecycle",
    "intercept_exit_signals",
    "entry_workers_alive",
    "entry_worker_pids",
    "mark_worker_ready",
    "all_entry_workers_ready",
    "wait_for_entry_workers",
]

#: Start-up and drain events. BentoML's server logging passes only WARNING and up from loggers
#: other than its own, so this one is set to INFO: these few lines are what an operator needs.
logger = logging.getLogger("rampart.api.lifecycle")
logger.setLevel(logging.INFO)

#: The entry service's BentoML name; runners look for its worker processes by it.
ENTRY_SERVICE_NAME = "rampart"
#: How much longer than ``max_deadline_ms`` a runner waits for the entry service to exit (s):
#: the entry service's own shutdown after its drain (closing connections, cleanup hooks).
RUNNER_EXIT_MARGIN_S = 5.0
#: Once a drain is over, uvicorn waits at most this long (s) for connections still open
#: (a client slow to read its answer) instead of forever (uvicorn's default).
EXIT_GRACE_S = 2.0
#: Retry-After (s) of ``not_ready`` and ``shutting_down``: warm-up ends within seconds, and a
#: draining server's clients should go to another replica at once.
RETRY_AFTER_S = 1.0
_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Lifecycle:
    """The entry service worker's state: starting, ready, draining; and its admitted requests.

    ``admit()`` is called when a request arrives (before its body is read). It
    raises ``NotReady`` (503 ``not_ready``) before ``mark_ready()``,
    ``ShuttingDown`` (503 ``shutting_down``) after ``begin_drain()``, and otherwise
    counts the request in flight until the context manager it returns exits.
    Use from the event loop thread only.
    """

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    @property
    def state(self) -> str:
        """``starting``, ``ready`` or ``draining``."""
        return "draining" if self.draining else "ready" if self.ready else "starting"

    def mark_ready(self) -> None:
        """Both runners are warm: admit requests from now on (until a drain)."""
        self.ready = True

    def begin_drain(self) -> None:
        """Refuse new requests from now on; requests already admitted go on."""
        self.draining = True

    def admit(self) -> contextlib.AbstractContextManager[None]:
        """Admit one request: raises ``ShuttingDown`` or ``NotReady``, else counts it in flight until the
        ``with`` block of the returned context manager ends."""
        if self.draining:
            raise ShuttingDown("this server is shutting down; send the request to another replica", RETRY_AFTER_S)
        if not self.ready:
            raise NotReady("the models are still warming up; retry shortly", RETRY_AFTER_S)
        self.in_flight += 1
        return contextlib.closing(self)

    def close(self) -> None:
        """One admitted request has ended (called by the context manager ``admit`` returns)."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no admitted request is in flight, at most ``timeout_s`` s; True when none is left."""
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


def intercept_exit_signals(drain: Callable[[int], Awaitable[None]]) -> bool:
    """Run ``await drain(signum)`` on the first SIGTERM/SIGINT, then let uvicorn exit as that signal asks.

    Call from a BentoML worker's start-up (``__init__`` or an ``on_startup`` hook),
    on the main thread with the event loop running: uvicorn has then installed its
    own handler (``uvicorn.Server.handle_exit``), which is kept and called once
    ``drain`` returns (or raises). Signals after the first are logged and ignored.
    Returns False, changing nothing, anywhere else (a runner built in-process by a
    test, ``--development``, a thread).
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    uvicorn_handler = signal.getsignal(signal.SIGTERM)
    server = getattr(uvicorn_handler, "__self__", None)
    if type(server).__name__ != "Server" or not type(server).__module__.startswith("uvicorn"):
        return False
    received: list[int] = []

    async def drain_then_exit(signum: int) -> None:
        try:
            await drain(signum)
        except Exception:
            logger.exception("drain failed; exiting now")
        if server.config.timeout_graceful_shutdown is None:
            server.config.timeout_graceful_shutdown = EXIT_GRACE_S
        uvicorn_handler(signum, None)

    def handle(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) > 1:
            logger.info("signal %d ignored: already draining (SIGKILL stops at once)", signum)
            return
        # A fresh context: the handler interrupts whichever request task is running, and the drain
        # must not inherit that request's context (its trace id in every drain log line).
        loop.call_soon_threadsafe(lambda: loop.create_task(drain_then_exit(signum)), context=contextvars.Context())

    for sig in _EXIT_SIGNALS:
        signal.signal(sig, handle)
    return True


#: This process's parent when it started: the circus arbiter of ``bentoml serve``.
_PARENT_PID = os.getppid()


def entry_worker_pids() -> list[int]:
    """The pids of the sibling processes (children of this process's parent, the circus arbiter)
    that are entry-service workers: BentoML starts them with ``--service-name rampart``. Empty
    once the arbiter is gone (this process was re-parented), since its siblings are then unknown."""
    import psutil

    if os.getppid() != _PARENT_PID:
        return []
    try:
        siblings = psutil.Process(os.getppid()).children()
    except psutil.Error:
        return []
    pids = []
    for process in siblings:
        try:
            args = process.cmdline()
            if process.status() != psutil.STATUS_ZOMBIE and _names_service(args, ENTRY_SERVICE_NAME):
                pids.append(process.pid)
        except psutil.Error:
            continue  # it exited meanwhile
    return pids


def entry_workers_alive() -> int:
    """How many entry-service workers are alive (``entry_worker_pids``)."""
    return len(entry_worker_pids())


def _ready_marks() -> Path:
    """The directory where this ``bentoml serve``'s entry workers mark themselves ready: one per arbiter."""
    return Path(tempfile.gettempdir()) / f"rampart-ready-{_PARENT_PID}"


def mark_worker_ready(ready: bool = True) -> None:
    """Mark this entry worker ready (warm) for ``all_entry_workers_ready``, or no longer (``ready=False``, drain)."""
    marks = _ready_marks()
    mark = marks / str(os.getpid())
    try:
        if ready:
            marks.mkdir(exist_ok=True)
            mark.touch()
        else:
            mark.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("cannot %s the ready mark %s: %s", "write" if ready else "remove", mark, exc)


def all_entry_workers_ready(expected: int) -> bool:
    """Whether every entry worker of this ``bentoml serve`` is alive and marked ready, and there are at least
    ``expected`` (``api_workers``) of them.

    Each worker answers ``/readyz`` for itself, and they warm up a few hundred ms apart;
    without this a load balancer (or a test) told "ready" by one worker could send the
    next request to one that still answers 503 ``not_ready``. A few ms (one ``/proc``
    scan), only on ``/readyz``; with one worker nothing is checked.
    """
    if expected <= 1:
        return True
    pids = entry_worker_pids()
    marks = _ready_marks()
    return len(pids) >= expected and all((marks / str(pid)).exists() for pid in pids)


def _names_service(args: list[str], name: str) -> bool:
    return any(a == "--service-name" and b == name for a, b in zip(args, args[1:]))


async def wait_for_entry_workers(timeout_s: float, poll_s: float = 0.1) -> bool:
    """Wait until no entry-service worker is alive, at most ``timeout_s`` s; True when none is left."""
    end = time.monotonic() + timeout_s
    while await asyncio.to_thread(entry_workers_alive):
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(poll_s)
    return True
