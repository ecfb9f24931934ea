"""Suite-wide guard: no process a test started outlives the suite.

A leaked child can keep the interpreter from exiting (multiprocessing joins its
children at exit), so a run that passed would then stall until CI's limit. At the
end of the session every descendant still alive, other than multiprocessing's own
helpers (forkserver, resource tracker, which it stops itself), is named on the
terminal and killed.
"""

from __future__ import annotations

import psutil

_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def _leftovers() -> list[psutil.Process]:
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if not any(helper in " ".join(child.cmdline()) for helper in _HELPERS):
                left.append(child)
        except psutil.Error:
            pass
    return left


def pytest_sessionfinish(session, exitstatus) -> None:
    left = _leftovers()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for child in left:
        try:
            line = f"{child.pid} {' '.join(child.cmdline())[:160]}"
            child.kill()
        except psutil.Error:
            continue
        if reporter is not None:
            reporter.write_line(f"left running by the tests, killed: {line}", yellow=True)
