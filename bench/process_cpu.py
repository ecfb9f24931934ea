"""CPU time and resident memory of a server's processes, by role, read with psutil: the one place the
benchmarks (``bench.ceiling``, ``bench.cpu_budget``, ``bench.workers_bench``, ``bench.engine_bench``,
``bench.knee_budget``) tell a ``bentoml serve`` tree's processes apart.

Roles (``process_role``) of ``bentoml serve service:Rampart`` and its descendants:

- ``api``: the entry service's worker processes (``--service-name rampart``);
- ``primary``, ``fallback``, ``shadow``: the runner services' workers
  (``--service-name rampart_<role>``; any other service name counts as its own role);
- ``decode``: processes under an entry worker (the decode workers, their forkserver and
  multiprocessing's resource tracker);
- ``supervisor``: anything else (``bentoml serve``'s own process).

A one-process server (the naive baseline's uvicorn) is measured with ``root_role`` ``api``.
"""

from __future__ import annotations

import re
import psutil

from rampart.api.lifecycle import ENTRY_SERVICE_NAME

__all__ = ["ROLES", "process_role", "server_processes", "tree_memory", "ServerCpu"]

MIB = 1 << 20

#: The roles of a Rampart server's processes (module doc); ``ServerCpu.stop`` reports each.
ROLES = ("api", "decode", "primary", "fallback", "shadow", "supervisor")

_SERVICE_NAME = re.compile(r"--service-name (\S+)")


def process_role(process: psutil.Process, entry_pids: set[int]) -> str:
    """The role of one process of a ``bentoml serve`` tree (module doc); ``entry_pids``: the pids of
    the entry service's workers, whose descendants are ``decode``. Raises ``psutil.Error`` when the
    process is gone."""
    match = _SERVICE_NAME.search(" ".join(process.cmdline()))
    if match:
        name = match.group(1)
        return "api" if name == ENTRY_SERVICE_NAME else name.removeprefix(f"{ENTRY_SERVICE_NAME}_")
    if any(parent.pid in entry_pids for parent in process.parents()):
        return "decode"
    return "supervisor"


def server_processes(root_pid: int, root_role: str = "supervisor") -> dict[int, tuple[str, psutil.Process]]:
    """``{pid: (role, process)}`` of the process ``root_pid`` (role ``root_role``) and its descendants alive now."""
    root = psutil.Process(root_pid)
    descendants = root.children(recursive=True)
    entry = set()
    for process in descendants:
        try:
            if process_role(process, set()) == "api":
                entry.add(process.pid)
        except psutil.Error:
            continue
    out = {root.pid: (root_role, root)}
    for process in descendants:
        try:
            out[process.pid] = (process_role(process, entry), process)
        except psutil.Error:
            continue
    return out


class ServerCpu:
    """CPU seconds (user + system) of a server's process tree between ``start()`` and ``stop()``, by role.

    ``root_role``: the role of the started process itself (``supervisor`` for ``bentoml serve``,
    ``api`` for a one-process server such as uvicorn). The tree is read again at ``stop()``:
    a process that appears during the interval counts from zero; one that ends during it
    loses what it spent (none ends in a clean round: decode workers are only replaced after
    a decode timeout).
    """

    def __init__(self, root_pid: int, root_role: str = "supervisor") -> None:
        self.root_pid = root_pid
        self.root_role = root_role
        self._start: dict[int, float] = {}

    def _read(self) -> dict[int, tuple[str, float]]:
        out = {}
        for pid, (role, process) in server_processes(self.root_pid, self.root_role).items():
            try:
                times = process.cpu_times()
            except psutil.Error:  # gone: it is left out, not counted as zero
                continue
            out[pid] = (role, times.user + times.system)
        return out

    def start(self) -> None:
        self._start = {pid: cpu for pid, (_, cpu) in self._read().items()}

    def stop(self) -> dict[str, dict]:
        """``{role: {"cpu_s", "processes"}}`` since ``start()``, for every role in ``ROLES`` and any other found."""
        out = {role: {"cpu_s": 0.0, "processes": 0} for role in ROLES}
        for pid, (role, cpu) in self._read().items():
            entry = out.setdefault(role, {"cpu_s": 0.0, "processes": 0})
            entry["cpu_s"] += cpu - self._start.get(pid, 0.0)
            entry["processes"] += 1
        return out


def tree_memory(root_pid: int) -> dict[str, dict[str, float]]:
    """``{"rss_mb": {role: MiB, "total": MiB}, "pss_mb": {...}}`` of the server tree rooted at ``root_pid``."""
    rss: dict[str, float] = {}
    pss: dict[str, float] = {}
    for role, process in server_processes(root_pid).values():
        try:
            info = process.memory_full_info()
        except psutil.Error:
            continue
        rss[role] = rss.get(role, 0.0) + info.rss / MIB
        pss[role] = pss.get(role, 0.0) + getattr(info, "pss", info.rss) / MIB
    for table in (rss, pss):
        table["total"] = sum(table.values())
    return {"rss_mb": {k: round(v, 1) for k, v in rss.items()}, "pss_mb": {k: round(v, 1) for k, v in pss.items()}}
