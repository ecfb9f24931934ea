"""Faults injected into a real server through its fault file (``RAMPART_FAULT_FILE``)."""

from __future__ import annotations

import json
import os


def write_faults(path, **faults) -> None:
    """Replace the fault file atomically (the runners re-read it when it changes)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults))
    os.replace(tmp, path)
