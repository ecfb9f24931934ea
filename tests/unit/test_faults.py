"""``rampart.faults``: the fault file overrides the settings while it is readable, and ends a hang."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rampart.faults import FaultInjector, FaultSpec, InjectedFault


def test_fault_file_overrides_settings_and_ends_a_hang(tmp_path):
    path = tmp_path / "faults.json"
    injector = FaultInjector("primary", FaultSpec(), str(path))
    injector.before_batch()  # no file yet: the (empty) settings apply
    path.write_text(json.dumps({"fault_primary_error_rate": 1.0}))
    with pytest.raises(InjectedFault):
        injector.before_batch()
    path.write_text(json.dumps({"fault_primary_hang": True}))
    threading.Timer(0.3, lambda: path.write_text("{}")).start()
    start = time.monotonic()
    injector.before_batch()  # returns once the file stops asking for a hang
    assert time.monotonic() - start >= 0.25
    path.write_text("not json")
    injector.before_batch()  # an unreadable file falls back to the settings
