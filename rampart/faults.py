"""Fault injection for drills and tests, off by default.

Settings ``fault_primary_delay_ms``, ``fault_primary_error_rate``,
``fault_primary_hang`` and ``fault_fallback_error_rate`` (environment
``RAMPART_FAULT_*``) make a runner slow, failing or hung, so the tests and the
users' own drills can prove the fallback chain on a real server.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

__all__ = ["InjectedFault", "FaultInjector"]

#: How long an injected hang blocks a batch, in seconds: longer than any deadline.
HANG_SECONDS = 3600.0


class InjectedFault(RuntimeError):
    """Raised by ``FaultInjector.before_batch`` when an injected error fires."""


@dataclass
class FaultInjector:
    """Faults applied before each batch: a delay (ms), an error probability, or a hang."""

    delay_ms: float = 0.0
    error_rate: float = 0.0
    hang: bool = False
    rng: random.Random = field(default_factory=random.Random)

    def before_batch(self) -> None:
        """Block or raise ``InjectedFault`` as configured; returns at once when inactive."""
        if self.hang:
            time.sleep(HANG_SECONDS)
        if self.delay_ms > 0:
            time.sleep(self.delay_ms / 1000.0)
        if self.error_rate > 0 and self.rng.random() < self.error_rate:
            raise InjectedFault(f"injected fault (error rate {self.error_rate:g})")
