"""``rampart.cores``, CPU placement: which cores the primary reserves, when it reserves none, and the pinning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rampart.config import Settings
from rampart.cores import (CorePlan, autogroup_nice, available_cores, core_plan, cpu_quota_cores, host_core_plan,
                           usable_cores)


def test_cpu_host_reserves_the_primarys_threads_cores_and_gives_the_rest_to_everyone_else():
    assert core_plan([0, 1], 1, gpu=False, quota_cores=None) == CorePlan((0,), (1,))
    plan = core_plan(list(range(16)), 11, gpu=False, quota_cores=16.0)
    assert plan.cores_of("primary") == tuple(range(11))
    assert plan.cores_of("fallback") == plan.cores_of("api") == tuple(range(11, 16))
    assert plan.cores_of("shadow") == plan.cores_of("primary")  # a candidate primary takes what the primary leaves
    assert core_plan([5, 3, 9], 1, gpu=False, quota_cores=None) == CorePlan((3,), (5, 9))  # the ids it may use


@pytest.mark.parametrize("cores, threads, gpu, quota", [
    ([0, 1], 1, True, None),  # the primary computes on the GPU
    ([0], 1, False, None),  # one core: nothing to divide
    ([0, 1], 2, False, None),  # the primary's threads would leave the rest no core
    ([0, 1, 2, 3], 0, False, None),
    (list(range(16)), 11, False, 4.0),  # a quota below the visible cores: they are shared with others
])
def test_no_pinning_where_a_reservation_would_hurt(cores, threads, gpu, quota):
    assert core_plan(cores, threads, gpu, quota) is None


def test_only_the_reserve_placement_pins():
    """``weight`` (the default) and ``off`` pin nothing; ``reserve`` pins on a CPU host of 2 cores or more."""
    assert Settings().cpu_pinning == "weight"
    assert host_core_plan(Settings(cpu_pinning="off")) is None
    assert host_core_plan(Settings(cpu_pinning="weight")) is None
    assert host_core_plan(Settings()) is None


def test_cgroup_quota_in_cores_from_v2_and_v1_files(tmp_path):
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota_cores(tmp_path) == 2.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota_cores(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota_cores(tmp_path) == 1.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota_cores(tmp_path) is None


def test_available_cores_are_the_usable_ones_within_the_cgroup_quota(tmp_path):
    """A pod limited to fewer CPUs than it sees: the engines' threads follow the limit (rounded up), never more
    than the usable cores, at least 1."""
    usable = len(usable_cores())
    assert available_cores(tmp_path) == usable  # no quota file: unlimited
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert available_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert available_cores(tmp_path) == min(usable, 2)
    (tmp_path / "cpu.max").write_text(f"{(usable + 8) * 100000} 100000\n")
    assert available_cores(tmp_path) == usable


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or (cpu_quota_cores() or 99) < len(os.sched_getaffinity(0)), reason="needs 2 cores, no CPU quota")
def test_a_process_placed_as_primary_or_api_runs_on_its_cores_only_with_every_thread():
    """In a child process (pinning is for good): each thread, and a thread started later, has the role's cores."""
    code = """
import os, threading, sys
from rampart.config import Settings
from rampart.cores import host_core_plan, place_this_process
settings = Settings(cpu_pinning="reserve", primary_cpu_threads=1)
plan = host_core_plan(settings)
inherited = os.getpriority(os.PRIO_PROCESS, 0)  # placement only ever raises the niceness (a test run under nice)
early = threading.Thread(target=threading.Event().wait, daemon=True); early.start()
cores = place_this_process(sys.argv[1], settings, nice=3)
later = []
t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0))); t.start(); t.join()
tasks = {tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir("/proc/self/task")}
print(plan.cores_of(sys.argv[1]) == cores, tasks == {cores}, tuple(sorted(later[0])) == cores,
      os.getpriority(os.PRIO_PROCESS, 0) == max(inherited, 3))
"""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a CPU host's plan even where a GPU is present
    for role in ("primary", "api"):
        done = subprocess.run([sys.executable, "-c", code, role], capture_output=True, text=True, timeout=60, env=env)
        assert done.stdout.split() == ["True", "True", "True", "True"], (role, done.stdout, done.stderr[-2000:])


@pytest.mark.skipif(autogroup_nice() is None, reason="the kernel's autogroup is off or absent")
def test_a_session_leader_lowers_its_autogroup_and_a_process_in_anothers_session_does_not():
    """Linux weighs CPU between autogroups (sessions) first, so a BentoML worker, which leads a session of its own,
    must lower its group for its niceness to count against the other workers; a decode worker, in its API
    worker's session, must not lower that whole session."""
    code = """
import os, sys
from rampart.cores import autogroup_nice, lower_cpu_priority
before = autogroup_nice()
lower_cpu_priority(7)
print(os.getsid(0) == os.getpid(), before, autogroup_nice(), os.getpriority(os.PRIO_PROCESS, 0))
"""
    leader = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            start_new_session=True)
    member = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert leader.stdout.split()[0] == "True" and int(leader.stdout.split()[2]) >= 7, leader.stdout + leader.stderr
    assert int(leader.stdout.split()[3]) >= 7, leader.stdout
    # not a session leader: its (this test's) session keeps its group niceness
    assert member.stdout.split()[0] == "False" and member.stdout.split()[1] == member.stdout.split()[2], \
        member.stdout + member.stderr
