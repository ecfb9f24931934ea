"""One structured JSON log line per request, and the ``Server-Timing`` header.

Logger ``rampart.access`` writes each line as a bare JSON object to stderr (its own
handler, not propagated to BentoML's prefixed format), so a log shipper can parse
every line as JSON. Fields: ``ts`` (Unix seconds), ``request_id``, ``path``,
``status``, ``code`` (``ok`` or the error code), ``priority``, ``bucket``,
``model``, ``degraded_reason``, ``timings_ms`` (decode, queue, inference, total),
``input_warnings`` (benign damage repaired in the upload; for ``/classify_batch``
those of all its images) and ``duration_ms`` (the whole handler), plus ``images``
for ``/classify_batch``.

The event loop never writes a line itself: ``log_request`` appends it to a bounded queue
(``ACCESS_LOG_QUEUE_LINES``) and a writer thread writes what is waiting to stderr every
``ACCESS_LOG_FLUSH_S``, in one write (``BatchedStderrHandler``). A write to stderr blocks
whenever whatever reads it falls behind (a full pipe to a container runtime's log reader, a
file under writeback): 268 ms of the API worker's loop inside ``StreamHandler.emit`` was
seen here at 5x overload. A line is therefore written shortly after its answer is sent, not
before; lines that would overflow the queue are dropped and counted (``rampart_access_log_dropped_total``), so a stalled reader costs neither
the loop's time nor unbounded memory. The thread is started in the process that logs (again
after a fork) and stopped at exit, after writing what is waiting.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
import time

from rampart.overload.admission import priority_name
from rampart.telemetry import metrics

__all__ = ["ACCESS_LOG_FLUSH_S", "ACCESS_LOG_QUEUE_LINES", "BatchedStderrHandler", "access_logger", "log_request", "server_timing"]

#: Access lines waiting for the writer thread at most (about 400 bytes each): seconds of lines at the
#: highest request rates an API worker answers; past it lines are dropped and counted.
ACCESS_LOG_QUEUE_LINES = 10_000
#: How often the writer thread writes the waiting lines, in seconds: one write for all of them, so a line
#: costs the event loop an append and the writer's wake-ups do not grow with the request rate.
ACCESS_LOG_FLUSH_S = 0.05


class BatchedStderrHandler(logging.Handler):
    """A logging handler that keeps each record's message (a finished line) and leaves the writing to a thread.

    ``emit`` appends the message to a deque, or drops it and counts it in ``rampart_access_log_dropped_total``
    when ``max_lines`` are already waiting. The thread ``rampart-access-log`` writes everything waiting to
    ``sys.stderr`` (as it is then) every ``flush_s`` seconds, in one write; ``close`` writes what is left
    and stops it. In a child forked from a process that had one, the lines are the parent's to write: the
    child starts with none and a thread of its own.
    """

    def __init__(self, max_lines: int, flush_s: float) -> None:
        super().__init__()
        self.max_lines = max_lines
        self.flush_s = flush_s
        self.lines: collections.deque[str] = collections.deque()
        self._start()
        os.register_at_fork(after_in_child=self._after_fork)

    def _start(self) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rampart-access-log", daemon=True)
        self._thread.start()

    def _after_fork(self) -> None:
        self.lines.clear()
        if not self._stopped.is_set():  # a closed handler stays closed in the child
            self._start()

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) >= self.max_lines:
            metrics.ACCESS_LOG_DROPPED.inc()
            return
        self.lines.append(record.getMessage())

    def _run(self) -> None:
        while not self._stopped.wait(self.flush_s):
            self.write_waiting()
        self.write_waiting()

    def write_waiting(self) -> None:
        """Write every waiting line to stderr in one write (a line logged meanwhile waits for the next)."""
        batch = []
        while self.lines:
            batch.append(self.lines.popleft())
        if batch:
            try:
                sys.stderr.write("\n".join(batch) + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed or gone: nowhere to write the lines to
                pass

    def close(self) -> None:
        """Write what is waiting and stop the thread (at exit; idempotent)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        super().close()


_logger: logging.Logger | None = None  # rampart.access once its handler is set up in this process


def access_logger() -> logging.Logger:
    """The ``rampart.access`` logger, with its ``BatchedStderrHandler`` (set up on first use; logging's own
    shutdown at exit closes it, which writes what is waiting)."""
    global _logger
    logger = logging.getLogger("rampart.access")
    if not any(isinstance(handler, BatchedStderrHandler) for handler in logger.handlers):
        logger.addHandler(BatchedStderrHandler(ACCESS_LOG_QUEUE_LINES, ACCESS_LOG_FLUSH_S))
        logger.setLevel(logging.INFO)
        logger.propagate = False
    _logger = logger
    return logger


def log_request(request_id: str, path: str, status: int, code: str, priority: str | bool, duration_ms: float,
                result: dict | None = None, **extra: object) -> None:
    """Emit the access line of one request; ``result`` is a ``/classify`` answer body, if any."""
    result = result or {}
    line = {
        "ts": round(time.time(), 3),
        "request_id": request_id,
        "path": path,
        "status": status,
        "code": code,
        "priority": priority_name(priority),
        "bucket": result.get("bucket"),
        "model": (result.get("model") or {}).get("name"),
        "degraded_reason": result.get("degraded_reason"),
        "timings_ms": result.get("timings_ms"),
        "input_warnings": result.get("input_warnings", []),
        "duration_ms": round(duration_ms, 3),
        **extra,
    }
    (_logger or access_logger()).info(json.dumps(line, separators=(",", ":")))


def server_timing(timings_ms: dict[str, float]) -> str:
    """A ``Server-Timing`` header value (W3C Server Timing), e.g. ``decode;dur=3.1, total;dur=40.2``."""
    return ", ".join(f"{name};dur={ms:.1f}" for name, ms in timings_ms.items())
