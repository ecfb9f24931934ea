"""Per-request CPU budget of a running Rampart, by process and by stage.

``measure(root_pid, run, rate_hz)`` runs ``run()`` (a closed-loop step that returns its
samples) while it

- reads the CPU time (user + system, ``psutil``) of every process of the server
  (the process tree under ``root_pid``), grouped by role (``bench.process_cpu``;
  ``BUDGET_ROLES``), before and after: µs of CPU per request of each role, exact;
- samples the Python stacks of the API worker, the primary runner and every decode
  process (``SAMPLED_ROLES``; the decode pool's idle forkserver gives only waits) with py-spy (``py-spy record --nonblocking``, ``rate_hz`` per second; the
  processes are never paused), when the ``py-spy`` executable is there; each stack is
  put into one stage (``stage_of``) and each role's CPU is split between its stages in
  proportion to their samples.

Waiting is not CPU: samples whose innermost frame is a known wait (``IDLE_LEAVES``:
the event loop's poll, a condition wait, a blocking pipe read or write between the
API and its decode workers) are dropped before the split. For the primary the model's
own share is what is left of the process's CPU after its other stages, because
PyTorch's OpenMP threads carry no Python frames (py-spy sees only the thread that
called the model). The stage figures are estimates from samples (about ``rate_hz`` ×
the step's seconds per process); the per-role totals are measured.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from bench.process_cpu import ServerCpu, server_processes

__all__ = ["STAGES", "BUDGET_ROLES", "stage_of", "measure", "py_spy"]

#: Roles (``bench.process_cpu``) whose CPU the budget reports, and those py-spy samples.
BUDGET_ROLES = ("api", "decode", "primary", "fallback")
SAMPLED_ROLES = ("api", "decode", "primary")
#: Stages of one request, in the order they happen, with the role (process) they run in.
STAGES: dict[str, str] = {
    "body read": "api",
    "admission": "api",
    "decode hand-off (API side)": "api",
    "decode": "decode",
    "resize": "decode",
    "decode transfer (worker side)": "decode",
    "runner call (API side, serialisation)": "api",
    "runner transfer (runner side, serialisation)": "primary",
    "batching": "primary",
    "model": "primary",
    "JSON answer": "api",
    "logging and metrics": "api",
    "HTTP server and middlewares": "api",
    "runner HTTP server and metrics": "primary",
    "other (api)": "api",
    "other (decode)": "decode",
}

#: Innermost frames that are a wait, not work (see the module doc).
IDLE_LEAVES = ("Runner.run (asyncio/runners.py", "Condition.wait (threading.py", "Queue.get (queue.py",
               "Connection._recv (multiprocessing/connection.py", "Connection._send (multiprocessing/connection.py",
               "select (selectors.py", "Event.wait (threading.py", "_recv_bytes (multiprocessing",
               "wait (threading.py", "epoll", "poll (")

#: (stage, substrings of a frame) by role, tried from the innermost frame outwards; the first frame that matches
#: any rule decides. Frames are py-spy's ``function (file:line)``.
RULES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "api": [
        ("logging and metrics", ("rampart/telemetry/", "prometheus_client/", "opentelemetry/",
                                 "_observe (rampart/pipeline.py", "logging/")),
        ("JSON answer", ("json/", "JSONResponse", "render (starlette/responses.py", "Pipeline._body",
                         "Pipeline._model_answer", "rampart/results.py", "server_timing")),
        ("body read", ("read_body (rampart/api/http.py", "read_multipart (rampart/api/http.py",
                       "Request.stream (starlette")),
        ("admission", ("rampart/overload/", "Pipeline.admit", "Pipeline.check_capacity", "Pipeline.release",
                       "ModelLane.reserve", "ModelLane.has_room", "ModelLane.release",
                       "parse_deadline")),
        ("decode hand-off (API side)", ("rampart/inputs/pool.py",)),
        ("runner call (API side, serialisation)", ("_bentoml_impl/client/", "httpx/", "httpcore/", "_bentoml_impl/serde",
                                                   "model_endpoint.<locals>.call", "ModelLane.attempt")),
    ],
    "decode": [
        ("resize", ("fit_to_bucket", "working_copy", "rampart/inputs/buckets.py")),
        ("decode", ("rampart/inputs/decoding.py", "rampart/inputs/decode_cost.py", "rampart/inputs/recovery.py")),
        ("decode transfer (worker side)", ("multiprocessing/", "rampart/inputs/pool.py")),
    ],
    "primary": [
        ("model", ("inference/engines.py", "torch/", "timm/")),
        ("batching", ("marshal/dispatcher", "run_bucket (runners/common.py")),
        ("runner transfer (runner side, serialisation)", ("_bentoml_sdk/io_models", "_bentoml_impl/serde", "pydantic",
                                                          "Request.body (starlette", "numpy/")),
    ],
}
#: Frames of middlewares that wrap every request: they decide a stack's stage only as its innermost frame.
WRAPPERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "api": ("logging and metrics", ("instruments.py", "asgi/__init__.py")),
    "primary": ("runner HTTP server and metrics", ("instruments.py", "asgi/__init__.py")),
}
#: Stage of a stack no rule matched, by role.
REST = {"api": "HTTP server and middlewares", "decode": "other (decode)", "primary": "runner HTTP server and metrics"}


def stage_of(role: str, frames: list[str]) -> str | None:
    """The stage of one stack (``frames`` outermost first) sampled in a ``role`` process; None for a wait."""
    if not frames or any(frames[-1].startswith(leaf) or leaf in frames[-1] for leaf in IDLE_LEAVES):
        return None
    wrapper = WRAPPERS.get(role)
    if wrapper and any(needle in frames[-1] for needle in wrapper[1]):
        return wrapper[0]
    for frame in reversed(frames):
        for stage, needles in RULES.get(role, ()):
            if any(needle in frame for needle in needles):
                return stage
    return REST.get(role)


def py_spy() -> str | None:
    """The ``py-spy`` executable next to this Python, else on ``PATH``, else None."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _samples(path: Path, role: str) -> Counter:
    """Stage → samples in one py-spy raw file (lines ``thread;frame;frame... count``)."""
    counts: Counter = Counter()
    if not path.exists():
        return counts
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stage = stage_of(role, stack.split(";")[1:])
        if stage is not None:
            counts[stage] += int(count)
    return counts


def measure(root_pid: int, run: Callable[[], list], duration_s: float, rate_hz: int = 50) -> dict:
    """Run ``run()`` (samples of a step lasting about ``duration_s``) and return the CPU budget of the server
    under ``root_pid`` during it (module doc): ``requests``, ``cpu_us_per_request`` by role,
    ``cpu_cores`` by role (CPU seconds per second), ``stages_us_per_request`` (stage → µs, None without
    py-spy), ``samples`` by role, and ``profiler``."""
    processes = server_processes(root_pid)
    meter = ServerCpu(root_pid)
    spy = py_spy()
    records, workdir = [], Path(tempfile.mkdtemp(prefix="rampart-cpu-"))
    if spy:
        for pid, (role, _) in processes.items():
            if role not in SAMPLED_ROLES:
                continue
            out = workdir / f"{role}-{pid}.txt"
            records.append((role, out, subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))), "--rate", str(rate_hz),
                 "--nonblocking", "--format", "raw", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    meter.start()
    started = time.monotonic()
    samples = run()
    spent, elapsed = meter.stop(), time.monotonic() - started
    requests = max(len(samples), 1)
    cpu_s = {role: spent[role]["cpu_s"] for role in BUDGET_ROLES}
    report = {
        "requests": len(samples),
        "cpu_us_per_request": {role: round(seconds * 1e6 / requests) for role, seconds in cpu_s.items()},
        "cpu_cores": {role: round(seconds / elapsed, 3) for role, seconds in cpu_s.items()},
        "stages_us_per_request": None,
        "samples": None,
        "profiler": None,
    }
    if not records:
        return report
    counts: dict[str, Counter] = {}
    for role, out, process in records:
        try:
            process.wait(timeout=duration_s + 30)
        except subprocess.TimeoutExpired:
            process.kill()
        counts.setdefault(role, Counter()).update(_samples(out, role))
    shutil.rmtree(workdir, ignore_errors=True)
    stages: dict[str, float] = {}
    for role, counter in counts.items():
        role_us = cpu_s.get(role, 0.0) * 1e6 / requests
        total = sum(counter.values())
        if not total:
            continue
        if role == "primary":  # the model's OpenMP threads are invisible to py-spy: the model gets the rest
            other = {stage: n * 1e6 / rate_hz / requests for stage, n in counter.items() if stage != "model"}
            scale = min(1.0, role_us / max(sum(other.values()), 1e-9))
            stages.update({stage: us * scale for stage, us in other.items()})
            stages["model"] = max(role_us - sum(other.values()) * scale, 0.0)
        else:
            stages.update({stage: role_us * n / total for stage, n in counter.items()})
    report["stages_us_per_request"] = {stage: round(stages.get(stage, 0.0)) for stage in STAGES}
    report["samples"] = {role: sum(counter.values()) for role, counter in counts.items()}
    version = subprocess.run([spy, "--version"], capture_output=True, text=True).stdout.strip()
    report["profiler"] = f"{version} record --nonblocking --rate {rate_hz}"
    return report


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m bench.cpu_budget RAW_FILE ROLE
    for stage, n in _samples(Path(sys.argv[1]), sys.argv[2]).most_common():
        print(f"{n:6d} {stage}")
    os._exit(0)
