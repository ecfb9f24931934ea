"""Fault injection for drills and tests, off by default.

Settings ``fault_primary_delay_ms``, ``fault_primary_error_rate``,
``fault_primary_hang`` and ``fault_fallback_error_rate`` (environment
``RAMPART_FAULT_*``) make a runner slow, failing or hung, so the tests and the
users' own drills can prove the fallback chain on a real server.
``fault_decode_hang`` makes every decode hang before it starts (in the decode
worker, ``rampart.inputs.decode_job``), which drills the decode timeout: the worker is
killed and replaced.

``fault_file`` names a JSON object with the same keys (for example
``{"fault_primary_hang": true}``). It is re-read whenever it changes and its keys
override the settings, so a drill can start and end a fault on a running server;
a hang ends as soon as the file no longer asks for it. The file may also set
``fault_fallback_delay_ms`` and ``fault_fallback_hang``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass

__all__ = ["InjectedFault", "FaultSpec", "FaultInjector"]

logger = logging.getLogger("rampart.faults")

#: Longest an injected hang blocks a batch, in seconds: longer than any deadline.
HANG_SECONDS = 3600.0
#: How often a hang re-reads the fault file, in seconds.
HANG_POLL_SECONDS = 0.05


class InjectedFault(RuntimeError):
    """Raised by ``FaultInjector.before_batch`` when an injected error fires."""


@dataclass(frozen=True)
class FaultSpec:
    """Faults for one model: ``delay_ms`` per batch, ``error_rate`` in 0..1, ``hang``."""

    delay_ms: float = 0.0
    error_rate: float = 0.0
    hang: bool = False


class FaultInjector:
    """Applies the faults configured for ``model`` (``primary``, ``fallback`` or ``decode``) before each batch.

    ``base`` comes from the settings; ``fault_file``, when set, overrides it key by key.
    """

    def __init__(self, model: str, base: FaultSpec, fault_file: str = "", rng: random.Random | None = None) -> None:
        self.model = model
        self.base = base
        self.fault_file = fault_file
        self.rng = rng or random.Random()
        self._file_state: tuple[tuple[int, int, int], FaultSpec] | None = None

    def spec(self) -> FaultSpec:
        """The faults in force now."""
        if not self.fault_file:
            return self.base
        try:
            stat = os.stat(self.fault_file)
        except OSError:
            return self.base
        version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if self._file_state is None or self._file_state[0] != version:
            self._file_state = (version, self._read_file())
        return self._file_state[1]

    def _read_file(self) -> FaultSpec:
        try:
            with open(self.fault_file, encoding="utf-8") as handle:
                values = json.load(handle)
            prefix = f"fault_{self.model}_"
            return FaultSpec(
                delay_ms=float(values.get(prefix + "delay_ms", self.base.delay_ms)),
                error_rate=float(values.get(prefix + "error_rate", self.base.error_rate)),
                hang=bool(values.get(prefix + "hang", self.base.hang)),
            )
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            logger.warning("ignoring unreadable fault file %s: %s", self.fault_file, exc)
            return self.base

    def hold_while_hung(self) -> None:
        """Block while a hang is asked for (at most ``HANG_SECONDS``); returns at once when none is."""
        started = time.monotonic()
        while self.spec().hang and time.monotonic() - started < HANG_SECONDS:
            time.sleep(HANG_POLL_SECONDS)

    def before_batch(self) -> None:
        """Block or raise ``InjectedFault`` as configured; returns at once when inactive."""
        self.hold_while_hung()
        spec = self.spec()
        if spec.delay_ms > 0:
            time.sleep(spec.delay_ms / 1000.0)
        if spec.error_rate > 0 and self.rng.random() < spec.error_rate:
            raise InjectedFault(f"injected fault in the {self.model} (error rate {spec.error_rate:g})")
