"""``rampart.telemetry.accesslog``: the caller never writes the access line itself, and a stalled stderr costs
neither its time nor unbounded memory (lines past the queue are dropped and counted)."""

from __future__ import annotations

import json
import logging
import sys
import threading

import pytest
from prometheus_client import REGISTRY

from rampart.telemetry import accesslog


class StalledStderr:
    """A stderr whose ``write`` blocks until ``release`` is set, as a pipe nobody reads does; ``entered`` is set
    once a write began. It keeps what was written and which thread wrote it."""

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        self.written: list[tuple[str, str]] = []

    def write(self, text: str) -> int:
        self.entered.set()
        self.release.wait()
        self.written.append((threading.current_thread().name, text))
        return len(text)

    def flush(self) -> None:
        pass

    def lines(self) -> list[dict]:
        return [json.loads(line) for _, text in self.written for line in text.splitlines()]


@pytest.fixture
def stalled(monkeypatch):
    """A ``StalledStderr`` (``install()`` it in the test: pytest's capture sets sys.stderr again when the test
    begins) and a fresh ``rampart.access`` handler with a 3-line queue; the handler closed afterwards."""
    stderr = StalledStderr()
    stderr.install = lambda: monkeypatch.setattr(sys, "stderr", stderr)
    logger = logging.getLogger("rampart.access")
    for handler in logger.handlers:  # earlier tests' lines go out now: their writer would write them to this stderr
        if isinstance(handler, accesslog.BatchedStderrHandler):
            handler.write_waiting()
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(accesslog, "_logger", None)
    monkeypatch.setattr(accesslog, "ACCESS_LOG_QUEUE_LINES", 3)
    yield stderr
    stderr.release.set()
    for handler in logger.handlers:
        if isinstance(handler, accesslog.BatchedStderrHandler):
            handler.close()


def log_in_a_thread(first: int, count: int) -> threading.Thread:
    """Log the access lines ``req-first`` .. from a thread named ``caller``; returns it once it ended (or after 10 s)."""
    def log() -> None:
        for i in range(first, first + count):
            accesslog.log_request(f"req-{i}", "/classify", 200, "ok", "normal", 1.0)

    caller = threading.Thread(target=log, name="caller")
    caller.start()
    caller.join(timeout=10)
    return caller


def writer() -> accesslog.BatchedStderrHandler:
    (handler,) = [h for h in logging.getLogger("rampart.access").handlers if isinstance(h, accesslog.BatchedStderrHandler)]
    return handler


def dropped() -> float:
    return REGISTRY.get_sample_value("rampart_access_log_dropped_total") or 0.0


def test_the_caller_returns_while_stderr_is_stalled_and_the_writer_thread_writes_the_lines(stalled):
    stalled.install()
    assert not log_in_a_thread(0, 1).is_alive()
    assert stalled.entered.wait(10)  # the writer took req-0 and is stuck in its write
    assert not log_in_a_thread(1, 2).is_alive()  # the caller did not wait for it
    stalled.release.set()
    writer().close()  # writes what is waiting, then stops
    assert [line["request_id"] for line in stalled.lines()] == ["req-0", "req-1", "req-2"]
    assert {writer for writer, _ in stalled.written} == {"rampart-access-log"}


def test_lines_past_the_queue_are_dropped_and_counted_and_the_rest_written_in_order(stalled, monkeypatch):
    monkeypatch.setattr(accesslog, "ACCESS_LOG_FLUSH_S", 3600.0)  # nothing is written before close
    stalled.install()
    before = dropped()
    assert not log_in_a_thread(0, 10).is_alive()
    assert dropped() - before == 7
    stalled.release.set()
    writer().close()
    assert [line["request_id"] for line in stalled.lines()] == ["req-0", "req-1", "req-2"]
