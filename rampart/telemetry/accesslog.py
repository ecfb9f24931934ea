"""One structured JSON log line per request, and the ``Server-Timing`` header.

Logger ``rampart.access`` writes each line as a bare JSON object to stderr (its own
handler, not propagated to BentoML's prefixed format), so a log shipper can parse
every line as JSON. Fields: ``ts`` (Unix seconds), ``request_id``, ``path``,
``status``, ``code`` (``ok`` or the error code), ``priority``, ``bucket``,
``model``, ``degraded_reason``, ``timings_ms`` (decode, queue, inference, total),
``input_warnings`` (benign damage repaired in the upload; for ``/classify_batch``
those of all its images) and ``duration_ms`` (the whole handler), plus ``images``
for ``/classify_batch``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from rampart.overload.admission import priority_name

__all__ = ["access_logger", "log_request", "server_timing"]


def access_logger() -> logging.Logger:
    """The ``rampart.access`` logger, with its JSON-lines handler on stderr (set up once)."""
    logger = logging.getLogger("rampart.access")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
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
    access_logger().info(json.dumps(line, separators=(",", ":")))


def server_timing(timings_ms: dict[str, float]) -> str:
    """A ``Server-Timing`` header value (W3C Server Timing), e.g. ``decode;dur=3.1, total;dur=40.2``."""
    return ", ".join(f"{name};dur={ms:.1f}" for name, ms in timings_ms.items())
