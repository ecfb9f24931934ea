"""Where each of Rampart's processes runs on the CPU: its niceness and, under ``reserve``, its cores.

On a CPU-only host the primary model and the rest (API workers, decode workers, the
fallback and shadow models) compete for the same cores. ``RAMPART_CPU_PINNING`` chooses
how (``Settings.cpu_pinning``):

- ``weight`` (the default): nothing is pinned. The primary's engine gets a thread per
  usable core (``rampart.config.default_cpu_threads``), so it uses the whole CPU when
  nothing else needs it, and every process keeps its niceness (API workers and the primary 0,
  the decoders 5, the fallback and the shadow 19), by which the others take their
  share when they need it. Measured on the shared 2-core host against ``reserve``, arms
  alternated, medians of 5 rounds each (docs/benchmarks.md, "CPU placement"): the primary's
  closed-loop capacity 11.1 images/s against 10.4 (16.5-16.6 against 8.3-11.4 in the quieter
  first run); at 5x open-loop overload the primary answered 7.7 images/s in the deadline in
  both, the whole server 34.8 against 33.7.
- ``reserve``: the primary runner is pinned to the first ``primary_threads`` usable cores
  (the shadow runner too: it takes what the primary leaves) and every other process to
  the cores left (``core_plan``). Linux weighs niceness only between tasks on one core's
  run queue, and with one primary thread the scheduler spread the API layer, the decoders
  and the fallback over its core too: unpinned, that thread got 0.72 of a core (11.6
  req/s at 16 clients), pinned 0.96 (18.7).
- ``off``: the OS places everything; the primary's threads leave a core to the rest.

There is no pinning on a GPU host (the primary computes on the GPU and needs no reserved
core), with one core, when the primary's threads would leave no core to the rest, or under
a cgroup CPU quota smaller than the visible cores (a Kubernetes pod without a static CPU
manager policy: its visible cores are shared with other pods, so reserving "core 0" would
pile every pod's primary onto one core).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from rampart.config import Settings, default_cpu_threads

__all__ = ["CorePlan", "available_cores", "core_plan", "cpu_quota_cores", "gpu_device_present", "host_core_plan", "lower_cpu_priority",
           "autogroup", "autogroup_nice", "set_autogroup_nice",
           "pin_this_process", "place_this_process", "usable_cores"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CorePlan:
    """CPU ids reserved for the primary runner (``primary``) and those every other process uses (``others``)."""

    primary: tuple[int, ...]
    others: tuple[int, ...]

    def cores_of(self, role: str) -> tuple[int, ...]:
        """The cores of a process of ``role``: the primary's for "primary" and "shadow" (a candidate
        primary, mirrored only while the models are idle, at niceness 19: it takes what the primary
        leaves, never the API layer's core), the others' for anything else ("api", "fallback")."""
        return self.primary if role in ("primary", "shadow") else self.others


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (``sched_getaffinity``), sorted; all CPUs where that is missing."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_quota_cores(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in cores (quota / period), or None when unlimited or unknown.

    Reads cgroup v2 ``cpu.max`` ("max 100000" or "200000 100000"), else cgroup v1
    ``cpu/cpu.cfs_quota_us`` and ``cpu/cpu.cfs_period_us`` (quota -1: unlimited).
    """
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_cores(root: Path = CGROUP_ROOT) -> int:
    """How many cores this process's engines may keep busy: the usable cores (``usable_cores``), at most the
    cgroup's CPU quota rounded up (``cpu_quota_cores(root)``), at least 1. A pod limited to 4 CPUs on a 64-core
    node sees 64 usable cores; an engine with 64 threads there would spend its quota in a fraction of each period
    and stall for the rest."""
    cores, quota = len(usable_cores()), cpu_quota_cores(root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def gpu_device_present() -> bool:
    """Whether an NVIDIA GPU is visible to this process without importing torch: a ``/dev/nvidia<N>``
    device node exists and ``CUDA_VISIBLE_DEVICES`` does not hide every device ("" or "-1")."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return any(name[len("nvidia"):].isdigit() for name in os.listdir("/dev") if name.startswith("nvidia")) \
        if os.path.isdir("/dev") else False


def core_plan(cores: list[int], primary_threads: int, gpu: bool, quota_cores: float | None) -> CorePlan | None:
    """The primary's reserved cores and everyone else's, or None for no pinning.

    ``cores``: usable CPU ids; ``primary_threads``: the primary's intra-op CPU threads;
    ``gpu``: whether the primary computes on a GPU; ``quota_cores``: the cgroup quota in
    cores (None: unlimited). None when ``gpu``, with fewer than 2 cores, when
    ``primary_threads`` would leave no core to the rest, or when the quota is below the
    number of cores (see the module doc).
    """
    if gpu or len(cores) < 2 or not 1 <= primary_threads < len(cores):
        return None
    if quota_cores is not None and quota_cores < len(cores):
        return None
    ordered = sorted(cores)
    return CorePlan(tuple(ordered[:primary_threads]), tuple(ordered[primary_threads:]))


def host_core_plan(settings: Settings) -> CorePlan | None:
    """``core_plan`` for this host and ``settings`` under ``cpu_pinning`` "reserve"; None under "weight" and "off".

    Every process of a server computes it from the same inputs (the cores the server
    was started with, ``primary_cpu_threads`` or ``default_cpu_threads``), so they agree;
    call it before ``pin_this_process`` narrows this process's cores.
    """
    if settings.cpu_pinning != "reserve":
        return None
    cores, gpu = usable_cores(), gpu_device_present()
    threads = settings.primary.cpu_threads or default_cpu_threads("primary", len(cores), gpu, "reserve")
    return core_plan(cores, threads, gpu, cpu_quota_cores())


def _threads() -> list[int]:
    """Thread ids of this process (Linux ``/proc/self/task``); just this thread (0) elsewhere."""
    return [int(tid) for tid in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]


#: Linux's autogroup switch and this process's autogroup (sched(7), "The autogroup feature").
AUTOGROUP_SWITCH, AUTOGROUP_FILE = Path("/proc/sys/kernel/sched_autogroup_enabled"), Path("/proc/self/autogroup")


def lower_cpu_priority(nice: int) -> None:
    """Raise the niceness of every thread of this process to at least ``nice``, and that of its autogroup when the
    process leads a session of its own (Linux; no-op elsewhere).

    Linux applies niceness per thread, so each task in ``/proc/self/task`` is set. But with
    autogroup on (``/proc/sys/kernel/sched_autogroup_enabled``, the default of most
    distributions' kernels) every session is a scheduling group, and CPU time is shared
    between groups first, by the group's own niceness: a thread's niceness then weighs
    only against threads of its own session. BentoML's process manager starts each worker
    (the API workers, each runner) in a session of its own, so their niceness did nothing
    between them: at 5× open-loop overload on the 2-core host the fallback (niceness 10 then)
    took 0.63-0.72 of a core and the primary (5 then) 0.67-0.83, with ``SCHED_IDLE`` on the
    fallback too (docs/benchmarks.md, "Niceness between BentoML's workers"). So a session
    leader also writes ``nice`` to ``/proc/self/autogroup``; a process in another's session
    (a decode worker in its API worker's) leaves the group alone, or it would lower the
    whole session. Autogroup applies only to tasks in the root CPU cgroup: in a container or
    a Kubernetes pod, thread niceness works as is, and the write changes nothing there.
    """
    if nice <= 0 or not os.path.isdir("/proc/self/task"):
        return
    for tid in _threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass  # the thread ended meanwhile
    if os.getsid(0) == os.getpid():
        set_autogroup_nice(nice)


def autogroup(pid: int | str = "self") -> tuple[str, int] | None:
    """(name, niceness) of process ``pid``'s autogroup (``/proc/<pid>/autogroup``: "/autogroup-<id> nice <n>"),
    or None where autogroup is off or absent (not Linux, or a kernel without ``CONFIG_SCHED_AUTOGROUP``) or the
    process is gone. Processes of one session share the name."""
    try:
        if AUTOGROUP_SWITCH.read_text().strip() != "1":
            return None
        name, _, nice = Path(f"/proc/{pid}/autogroup").read_text().split()
        return name, int(nice)
    except (OSError, ValueError):
        return None


def autogroup_nice() -> int | None:
    """This process's autogroup niceness (``autogroup``), or None where autogroup is off or absent."""
    group = autogroup()
    return None if group is None else group[1]


def set_autogroup_nice(nice: int) -> None:
    """Raise this process's autogroup niceness to at least ``nice`` (0..19); nothing where autogroup is off, absent
    or not writable (a read-only /proc). Lowering it would need CAP_SYS_NICE, so it is never lowered."""
    current = autogroup_nice()
    if current is None or current >= nice:
        return
    try:
        AUTOGROUP_FILE.write_text(str(min(nice, 19)))
    except OSError:
        pass


def pin_this_process(cores: tuple[int, ...]) -> None:
    """Restrict every thread of this process to ``cores`` (threads and processes started later inherit it)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass  # the thread ended meanwhile


def place_this_process(role: str, settings: Settings, nice: int = 0) -> tuple[int, ...] | None:
    """Set this process's niceness (``nice``) and, under ``host_core_plan``, pin it to ``role``'s cores.

    Call before the process starts its worker threads or child processes, so they inherit
    both. Returns the cores it was pinned to, or None when it was not pinned.
    """
    plan = host_core_plan(settings)
    cores = plan.cores_of(role) if plan else None
    if cores:
        pin_this_process(cores)
    lower_cpu_priority(nice)
    return cores
