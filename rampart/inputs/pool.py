"""A bounded, priority-ordered pool of decode workers: processes that can be killed, or threads.

Decoding and resizing run on ``workers`` workers. At most ``queue`` more jobs may
wait; an upload beyond that gets ``Overloaded`` (429 with Retry-After) at once,
so memory held by waiting uploads stays bounded. Waiting jobs start high
priority first, then by ``rank`` (lower first), then in arrival order.

Time is bounded twice: a job that has not *started* within the caller's budget is
cancelled (no work is spent on a request whose deadline has passed) and answered
``Overloaded``; a job that has started but runs past ``run_limit_s`` or the budget
raises ``JobTimeout``. What happens to the overrunning job depends on the mode:

- ``processes=True`` (the service's default): each worker is a process started
  from a ``forkserver`` (safe inside a threaded server, unlike ``fork``; a
  replacement starts in tens of milliseconds because the server has already
  imported ``preload``). A job that overruns is killed with SIGKILL, its slot is
  free at once, and a new process takes its place; a worker that dies on its own
  (a decoder crash, the OOM killer) is replaced the same way and its job raises
  ``WorkerDied``. Jobs must be picklable: a module-level function and its
  arguments go in, its return value comes back through a Unix socket pair. The
  hand-off is lean (``_send`` / ``_receive``): pickle protocol 5 with large
  ``bytes`` (the upload) and numpy arrays (the pixels) sent as raw frames beside a
  small header, never copied into a pickle stream or a message (one gathered
  ``sendmsg`` a message; each frame read whole into its own ``bytes``), and objects
  given to ``share`` (the decode plan) sent once per worker process, then named by
  a key.
- ``processes=False``: workers are threads of this process. A thread cannot be
  killed, so a timed-out job keeps its slot until it really ends; the bound on
  memory still holds.

Each worker (thread or process) runs at niceness ``nice``, so the event loop,
which answers and sheds, stays ahead of decoding for the CPU.
"""

from __future__ import annotations

import asyncio
import atexit
import heapq
import io
import itertools
import logging
import multiprocessing
import multiprocessing.util  # registers its exit hook before ours, so ours (LIFO) runs first
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import types
import weakref
from concurrent.futures import Future
from typing import Callable, TypeVar

from rampart.compat.forkserver import ignore_stop_signals_in_forkserver
from rampart.errors import Overloaded
from rampart.hangup import hung_up

__all__ = ["BoundedPool", "JobTimeout", "WorkerDied"]

logger = logging.getLogger("rampart.inputs.pool")

T = TypeVar("T")


class JobTimeout(Exception):
    """A started job outlived its limit. ``by_run_limit``: the job's own limit (not the caller's budget) ran out."""

    def __init__(self, ran_s: float, by_run_limit: bool) -> None:
        super().__init__(f"job still running after {ran_s * 1000:.0f} ms")
        self.ran_s = ran_s
        self.by_run_limit = by_run_limit


class WorkerDied(Exception):
    """The worker process running the job died without being asked to (exit code or signal in the message).

    ``killed``: it was ended by SIGKILL from outside the pool (the OOM killer, an operator), which says
    nothing certain about the job; a crash (SIGSEGV, SIGABRT, an exit) does."""

    def __init__(self, message: str, killed: bool = False) -> None:
        super().__init__(message)
        self.killed = killed


class _Abandoned(Exception):
    """The job's process was killed on purpose; nobody waits for its result any more."""


#: How often (s) an idle worker's thread looks whether its process is still alive: one that died (the OOM
#: killer, a signal) while it had no job is replaced within this, not only when the next upload comes.
IDLE_CHECK_S = 1.0
#: ``bytes`` at least this long travel as raw frames beside the pickle header (``_send``).
_RAW_FRAME_BYTES = 16 << 10
_DEFINE, _JOB = b"D", b"J"


def _as_is(frame):
    """Unpickling a raw frame: the received ``bytes`` object itself, no copy."""
    return frame


class _Pickler(pickle.Pickler):
    """Protocol 5: numpy arrays and large ``bytes`` go out of band; objects in ``shared`` by their key."""

    def __init__(self, file, buffers: list, shared: dict[int, str]) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self.shared = shared

    def reducer_override(self, obj):
        if type(obj) is bytes and len(obj) >= _RAW_FRAME_BYTES:
            return _as_is, (pickle.PickleBuffer(obj),)
        return NotImplemented

    def persistent_id(self, obj):
        return self.shared.get(id(obj))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, buffers: list, known: dict[str, object]) -> None:
        super().__init__(file, buffers=buffers)
        self.known = known

    def persistent_load(self, key):
        return self.known[key]


#: A message's fixed head: its kind (1 byte), its raw frame count (4), the pickle header's length (8).
_HEAD = struct.Struct("<cIQ")
_FRAME_SIZE = struct.Struct("<Q")


def _send(sock: socket.socket, kind: bytes, obj, shared: dict[int, str] | None = None) -> None:
    """Send ``obj`` over ``sock`` as the fixed head, the frames' sizes, the pickle header and the raw frames (numpy
    arrays, large ``bytes``), gathered into one ``sendmsg``: no frame is copied into a message first."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, buffers, shared or {}).dump(obj)
    header = stream.getbuffer()
    frames = [buffer.raw() for buffer in buffers]
    head = _HEAD.pack(kind, len(frames), header.nbytes) + b"".join(_FRAME_SIZE.pack(f.nbytes) for f in frames)
    parts = [memoryview(head), header, *frames]
    while parts:  # a blocking stream socket may still take part of a large message (a signal between its pieces)
        sent = sock.sendmsg(parts)
        while parts and sent >= parts[0].nbytes:
            sent -= parts[0].nbytes
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock`` (one ``recv`` with ``MSG_WAITALL``, more only if a signal cut it short);
    ``EOFError`` when the other end closed first."""
    data = sock.recv(size, socket.MSG_WAITALL)
    while len(data) < size:
        more = sock.recv(size - len(data), socket.MSG_WAITALL)
        if not more:
            raise EOFError("the other end of the decode pipe closed")
        data += more
    return data


def _receive(sock: socket.socket, known: dict[str, object] | None = None) -> tuple[bytes, object]:
    """The (kind, object) ``_send`` sent; shared objects are looked up in ``known``. Each raw frame is read
    straight into its own ``bytes`` (numpy arrays are made on it, read-only, without a copy)."""
    kind, count, header_size = _HEAD.unpack(_receive_exactly(sock, _HEAD.size))
    rest = _receive_exactly(sock, _FRAME_SIZE.size * count + header_size)
    sizes = [_FRAME_SIZE.unpack_from(rest, _FRAME_SIZE.size * i)[0] for i in range(count)]
    frames = [_receive_exactly(sock, size) for size in sizes]
    header = memoryview(rest)[_FRAME_SIZE.size * count:]
    return kind, _Unpickler(io.BytesIO(header), frames, known or {}).load()


def _serve(sock: socket.socket, nice: int, setup: tuple[Callable, tuple] | None = None) -> None:
    """A worker process: run ``setup`` (``(fn, args)``) once, then each job ``(fn, args)`` from ``sock`` and send
    back ``("ok", result)`` or ``("error", exc)``; a definition ``(key, obj)`` is kept for the jobs that name
    ``key`` (``BoundedPool.share``)."""
    # Ctrl-C and SIGTERM on `bentoml serve` are the parent's to handle: during its graceful drain
    # (rampart.api.lifecycle) circus signals the API worker's children too, and decoding must go on.
    # The worker still ends with its parent: the socket closes and ``_receive`` raises EOFError.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError:
            pass
    if setup is not None:
        setup[0](*setup[1])
    known: dict[str, object] = {}
    while True:
        try:
            kind, message = _receive(sock, known)
        except (EOFError, OSError):  # the parent is gone
            return
        if kind == _DEFINE:
            key, value = message
            known[key] = value
            continue
        fn, args = message
        try:
            reply = ("ok", fn(*args))
        except Exception as exc:
            reply = ("error", exc)
        try:
            _send(sock, _JOB, reply)
        except Exception as exc:  # an unpicklable result or exception
            _send(sock, _JOB, ("error", RuntimeError(f"{type(exc).__name__}: {exc}")))


# The forkserver imports this module first (the pool's preload): there, SIGTERM is ignored too, as the workers
# ignore it, so that a signal to the whole process group leaves the pool whole for the drain (rampart.compat.forkserver).
ignore_stop_signals_in_forkserver()

_START_LOCK = threading.Lock()
_LIVE: "weakref.WeakSet[_Process]" = weakref.WeakSet()


@atexit.register
def _kill_live_workers() -> None:
    """At interpreter exit, kill every worker process still running.

    Without this, exit hangs: multiprocessing's own exit hook sends daemon children
    SIGTERM, which ``_serve`` ignores, and then joins them; they wait for the pipe
    the parent holds open. atexit runs hooks last-registered first, so this one
    (registered after ``multiprocessing.util``'s) runs before it.
    """
    for worker in list(_LIVE):
        worker.close()


class _Process:
    """One worker process and the pipe to it.

    ``close`` and ``replace`` hold ``_lock``, so a close that comes while a
    replacement starts waits for it and then kills the new process, and a
    replacement after ``close`` starts nothing. ``kill`` never waits for the lock.
    """

    def __init__(self, context, nice: int, name: str, shared: dict[int, tuple[str, object]],
                 setup: tuple[Callable, tuple] | None = None) -> None:
        self.context, self.nice, self.name, self.setup = context, nice, name, setup
        self.shared = shared  # the pool's: id(obj) -> (key, obj)
        self.defined: set[str] = set()  # keys this process has been sent
        self.start_ms = 0.0
        self.closed = False
        self._lock = threading.Lock()
        self._start()
        _LIVE.add(self)

    def _start(self) -> None:
        started = time.perf_counter()
        self.conn, child = socket.socketpair()
        self.defined = set()
        self.process = self.context.Process(target=_serve, args=(child, self.nice, self.setup), name=self.name, daemon=True)
        with _START_LOCK:
            # A forkserver child re-imports the parent's __main__ (CPython multiprocessing.spawn.prepare):
            # under `bentoml serve` that is BentoML's worker entry point, seconds of imports per
            # worker. The worker needs nothing from it, so it is shown an empty __main__.
            main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
            try:
                self.process.start()
            finally:
                sys.modules["__main__"] = main
        child.close()
        self.start_ms = (time.perf_counter() - started) * 1000.0

    def call(self, fn: Callable, args: tuple):
        """Run ``fn(*args)`` in the process; raises what it raised, or ``EOFError``/``OSError`` if it died.

        Shared objects among ``args`` are sent first if this process has not had them yet."""
        keys = {}
        for arg in args:
            entry = self.shared.get(id(arg))
            if entry is not None:
                key, value = entry
                if key not in self.defined:
                    _send(self.conn, _DEFINE, (key, value))
                    self.defined.add(key)
                keys[id(arg)] = key
        _send(self.conn, _JOB, (fn, args), keys)
        _, (status, value) = _receive(self.conn)
        if status == "error":
            try:
                raise value
            finally:
                value = None  # the exception's traceback holds this frame: no cycle through ``value``
        return value

    def kill(self) -> bool:
        """SIGKILL the process (its job is abandoned; ``replace`` starts the next one); whether it did.

        Never waits: the event loop calls it. While a replacement (or ``close``) holds the process, nothing
        is signalled and False is returned; the pool's thread, which is replacing it, checks whether the job
        it is about to send was abandoned meanwhile (``BoundedPool._call``)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self.closed:
                return False
            self.process.kill()
            return True
        finally:
            self._lock.release()

    def replace(self) -> bool:
        """Reap this process (killing it if needed) and start a new one in its place; False once closed."""
        with self._lock:
            if self.closed:
                return False
            self.conn.close()
            self.process.kill()
            self.process.join()
            self._start()
            return True

    def close(self) -> None:
        """Kill the process and its pipe for good; waits for a replacement under way to finish first."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.process.kill()
            self.process.join(timeout=5.0)
            self.conn.close()

    def describe_death(self) -> str:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code}"


class _Slot:
    """One worker: its thread, its process (process mode) and the job it runs now."""

    def __init__(self) -> None:
        self.process: _Process | None = None
        self.job: Future | None = None
        self.abandoned = False


class BoundedPool:
    """``workers`` workers (processes or threads, at niceness ``nice``) plus a wait queue of ``queue`` jobs.

    ``retry_after_s`` goes into 429s. ``preload``: modules the process mode's
    forkserver imports once, so each (re)started worker has them already. ``process_setup``:
    ``(fn, args)``, a picklable module-level function that each worker process (new or
    replaced) runs once before its first job, for what belongs to the process (not to threads:
    the thread mode ignores it).
    """

    def __init__(self, workers: int, queue: int, retry_after_s: float = 1.0, name: str = "rampart-decode",
                 nice: int = 0, processes: bool = False, preload: tuple[str, ...] = (),
                 process_setup: tuple[Callable, tuple] | None = None) -> None:
        self.workers = workers
        self.capacity = workers + queue
        self.retry_after_s = retry_after_s
        self.nice = nice
        self.processes = processes
        self.replaced = 0
        self._shared: dict[int, tuple[str, object]] = {}
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, int, Future, Callable, tuple, list[float]]] = []
        self._seq = itertools.count()
        self._pending = 0
        self._slots = [_Slot() for _ in range(workers)]
        if processes:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__, *preload])
            for index, slot in enumerate(self._slots):
                slot.process = _Process(context, nice, f"{name}-{index}", self._shared, process_setup)
        self._threads = [
            threading.Thread(target=self._work, args=(slot,), name=f"{name}-{i}", daemon=True)
            for i, slot in enumerate(self._slots)
        ]
        for thread in self._threads:
            thread.start()

    def share(self, obj: T) -> T:
        """Send ``obj`` to each worker process once, not with every job that takes it; returns ``obj``.

        A job argument that *is* ``obj`` (the same object) is then passed by a key; a
        replaced worker is sent it again before its first such job. ``obj`` must not
        change afterwards (the workers keep their copy). Threads need nothing: they
        get the object itself.
        """
        self._shared[id(obj)] = (f"shared-{len(self._shared)}", obj)
        return obj

    @property
    def pending(self) -> int:
        """Jobs running or waiting now."""
        return self._pending

    def stats(self) -> dict:
        """For ``GET /stats``: mode, workers configured and alive, replacements so far, jobs pending,
        and the slowest start, in ms, among the current worker processes."""
        if self.processes:
            alive = sum(1 for slot in self._slots if slot.process.process.is_alive())
            start_ms = round(max(slot.process.start_ms for slot in self._slots), 1)
        else:
            alive, start_ms = sum(1 for thread in self._threads if thread.is_alive()), None
        return {"mode": "processes" if self.processes else "threads", "configured": self.workers, "alive": alive,
                "replaced": self.replaced, "pending": self._pending, "worker_start_ms": start_ms}

    async def run(
        self, fn: Callable[..., T], *args: object, high: bool = False, rank: int = 0,
        budget_s: float | None = None, run_limit_s: float | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the pool (``high`` priority first, then lower ``rank``) and return its result.

        Raises ``Overloaded`` when the pool is full, or when the job has not started
        within ``budget_s`` seconds (it is then cancelled). Raises ``JobTimeout`` when
        it started but is still running after ``run_limit_s`` seconds of its own or
        when ``budget_s`` runs out; a process worker is then killed and replaced, a
        thread keeps its slot until the job ends. Raises ``WorkerDied`` when a
        worker process dies during the job, and whatever ``fn`` raised.
        """
        started_at: list[float] = []  # the worker thread appends the job's start time; nothing wakes the loop for it
        future: Future = Future()
        with self._cond:
            if self._pending >= self.capacity:
                raise Overloaded(f"decoding capacity is exhausted ({self.capacity} uploads in progress)", self.retry_after_s)
            self._pending += 1
            heapq.heappush(self._heap, (0 if high else 1, rank, next(self._seq), future, fn, args, started_at))
            self._cond.notify()
        submitted = time.monotonic()
        result = asyncio.wrap_future(future)
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception was never retrieved"
        try:
            if budget_s is None and run_limit_s is None:
                return await result
            budget_end = submitted + (float("inf") if budget_s is None else max(budget_s, 0.0))
            run_limit_s = float("inf") if run_limit_s is None else run_limit_s
            now = submitted
            while True:
                # A job that has not started yet cannot end its run limit before now + run_limit_s: waking then (or at
                # the budget's end) and looking again finds every limit in time without a wake-up at the start.
                run_end = started_at[0] + run_limit_s if started_at else now + max(run_limit_s, 0.001)
                done, _ = await asyncio.wait([result], timeout=max(min(run_end, budget_end) - now, 0.0))
                if done:
                    return result.result()
                now = time.monotonic()
                if future.running() or future.done():  # started: it may still be about to note its start time
                    run_end = (started_at[0] if started_at else now) + run_limit_s
                    if now >= min(run_end, budget_end):
                        break
                elif now >= budget_end and future.cancel():
                    raise Overloaded(
                        f"no decoder became free within the request's deadline ({budget_s * 1000:.0f} ms)",
                        self.retry_after_s,
                    )
        except asyncio.CancelledError:  # the request stopped waiting: free its worker too
            if future.cancel():
                raise
            if not hung_up():
                self._abandon(future)
            elif run_limit_s is not None and run_limit_s < float("inf"):
                # A client gone: its running job ends by itself, in ms, or at its run limit (a stuck decode
                # would otherwise keep its worker with nobody left to kill it).
                run_end = (started_at[0] if started_at else time.monotonic()) + run_limit_s
                asyncio.get_running_loop().call_later(max(run_end - time.monotonic(), 0.0), self._abandon, future)
            raise
        except Exception:  # what the job raised (a refused upload): its traceback holds this frame, whose futures
            future = result = done = None  # hold it: a cycle that kept the upload until a full collection
            raise
        self._abandon(future)
        ran_s = now - (started_at[0] if started_at else submitted)
        raise JobTimeout(ran_s, by_run_limit=run_end <= budget_end)

    def _abandon(self, future: Future) -> None:
        """Kill the process running ``future``'s job, if it still runs one (process mode only). Never waits
        (``_Process.kill``): the event loop calls it."""
        if not self.processes:
            return
        with self._cond:
            for slot in self._slots:
                if slot.job is future and not slot.abandoned:
                    slot.abandoned = True
                    slot.process.kill()

    def _work(self, slot: _Slot) -> None:
        if self.nice > 0 and not self.processes:
            try:  # Linux: niceness is per thread
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:
                pass
        while True:
            job = self._next_job(slot)
            if job is None:  # its process died while it had no job: replace it now, not at the next upload
                self._replace_if_died_idle(slot)
                continue
            future, fn, args, running = job
            outcome: tuple[bool, object] | None = None
            if running:
                try:
                    outcome = (True, self._call(slot, fn, args))
                except BaseException as exc:
                    outcome = (False, exc)
            with self._cond:  # the slot is free before the caller hears the outcome
                self._pending -= 1
                abandoned, slot.job, slot.abandoned = slot.abandoned, None, False
            if outcome is not None and outcome[0]:
                future.set_result(outcome[1])
            elif outcome is not None:
                future.set_exception(outcome[1])
            # An exception's traceback holds this frame, which would hold the exception (a cycle), and the job's
            # arguments (the upload) would stay held until the next job.
            job = future = fn = args = outcome = None
            if abandoned:  # killed on purpose, perhaps just after it answered: start a fresh one
                self._replace(slot)

    def _next_job(self, slot: _Slot) -> tuple[Future, Callable, tuple, bool] | None:
        """Wait for the next job and take it: ``(future, fn, args, running)``, ``running`` False when it was
        cancelled while it waited (else ``slot.job`` is set and its start time noted). None when, while
        waiting, the slot's process was found dead (checked every ``IDLE_CHECK_S``; a closed pool's are not)."""
        idle_check_s = IDLE_CHECK_S if slot.process is not None else None
        with self._cond:
            while not self._heap:
                if not self._cond.wait(timeout=idle_check_s) and not self._heap and self._died_idle(slot):
                    return None
            _, _, _, future, fn, args, started_at = heapq.heappop(self._heap)
            running = future.set_running_or_notify_cancel()
            if running:
                started_at.append(time.monotonic())
                slot.job, slot.abandoned = future, False
        return future, fn, args, running

    @staticmethod
    def _died_idle(slot: _Slot) -> bool:
        return slot.process is not None and not slot.process.closed and not slot.process.process.is_alive()

    def _replace_if_died_idle(self, slot: _Slot) -> bool:
        """Replace the slot's process (logging how it died) if it died while it had no job; whether it had."""
        if not self._died_idle(slot):
            return False
        logger.warning("decode worker %s %s while idle; replacing it", slot.process.name, slot.process.describe_death())
        self._replace(slot)
        return True

    def _call(self, slot: _Slot, fn: Callable, args: tuple):
        if slot.process is None:
            return fn(*args)
        # A worker found dead is replaced first; a caller that gave up meanwhile (``kill`` does not wait for a
        # replacement) does not get its job sent to the new one.
        if self._replace_if_died_idle(slot) and slot.abandoned:
            raise _Abandoned("the job's time ran out while its worker was being replaced")
        try:
            return slot.process.call(fn, args)
        except (EOFError, OSError) as exc:
            if slot.abandoned:
                raise _Abandoned("the job ran past its limit and its worker was killed") from None
            death = slot.process.describe_death()
            killed = slot.process.process.exitcode == -signal.SIGKILL  # read before the replacement takes its place
            logger.warning("decode worker %s %s during a job; replacing it", slot.process.name, death)
            self._replace(slot)
            raise WorkerDied(f"the decode worker {death}", killed=killed) from exc

    def _replace(self, slot: _Slot) -> None:
        try:
            if not slot.process.replace():  # the pool was closed
                return
        except Exception:  # keep the thread alive; the next job retries the start
            logger.exception("could not start a decode worker")
            return
        self.replaced += 1
        logger.info("decode worker %s replaced in %.0f ms", slot.process.name, slot.process.start_ms)

    def close(self) -> None:
        """Kill the worker processes for good, a replacement under way included (the threads are
        daemons and end with the interpreter). Idempotent; interpreter exit does it too."""
        for slot in self._slots:
            if slot.process is not None:
                slot.process.close()
