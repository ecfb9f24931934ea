"""multiprocessing's forkserver, which starts the decode workers (``rampart.inputs.pool``), kept alive through SIGTERM.

A signal sent to the whole process group of ``bentoml serve`` (``kill -- -PGID``, a supervisor or a shell
that stops a job's group) reaches every process in it. The decode workers ignore SIGTERM and SIGINT: the API
worker drains first and they must keep decoding for it. The forkserver they were forked from ignores SIGINT
(CPython sets that in ``multiprocessing.forkserver.main``) but not SIGTERM, so it died. A worker's exit status
is read from its forkserver, and with the forkserver gone CPython reports 255 for each child
(``popen_forkserver.Popen.poll``): the pool then saw every idle, healthy worker as dead, logged "exited with
code 255 while idle", and started replacements (and a new forkserver) in the middle of the drain.

``ignore_stop_signals_in_forkserver`` makes the forkserver ignore SIGTERM as well. It is called when
``rampart.inputs.pool`` is imported, which the forkserver does first (the pool's preload), and acts only in
that case: when ``multiprocessing.forkserver.main`` is on the stack. The forkserver still ends with its parent,
as before: ``main`` exits when the pipe from its parent closes. It relies on ``main`` importing the preload
before it sets its own signal handlers, and setting only SIGCHLD's and SIGINT's. That is CPython's standard
library, whose patch release Rampart does not pin, so the check is by behaviour rather than by a hash in
``rampart.compat.targets``: ``tests/unit/test_pool.py`` sends SIGTERM to a real pool's forkserver and checks
that it lives on and that no worker is replaced.
"""

from __future__ import annotations

import signal
import sys

__all__ = ["ignore_stop_signals_in_forkserver"]

#: The module and function of CPython's forkserver process, whose preload imports call this.
FORKSERVER_MAIN = ("multiprocessing.forkserver", "main")


def ignore_stop_signals_in_forkserver() -> bool:
    """When called (through an import) from the forkserver's ``main``, ignore SIGTERM in this process and return
    True; anywhere else, change nothing and return False."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == FORKSERVER_MAIN:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return True
        frame = frame.f_back
    return False
