"""The benchmark harness: how every scenario, the planner, the loopback cluster and the server tests start,
wait for and stop a server, and how they read its CPU.

- ``Server``: the one launcher. A command on a free 127.0.0.1 port, in its own session (process
  group), its output appended or written to a log file, with a private BentoML home
  (``private_bentoml_home``) unless the environment names one; stopped by process group
  (``stop_group``, ``kill_group``) or by process tree (``stop_tree``, ``kill_tree``).
- ``Service``: a service under test of the benchmarks (Rampart, the naive and plain BentoML
  baselines, the Triton peer), ready once a real request is answered; ``url`` is its classify endpoint.
- ``Replica``: ``bentoml serve service:Rampart`` ready when ``/readyz`` is 200, stopped by process tree:
  the loopback cluster's replicas (``deploy.cluster``) and the server tests' servers.
- CPU by process role: ``ServerCpu``, ``server_processes`` and ``process_role`` of ``bench.process_cpu``.
- ``machine()`` (the host a report was measured on), ``SLO_MS`` (the benchmarks' deadline) and
  ``Sizes`` (the step sizes of the load benchmark's scenarios, full or ``--quick``).

This module imports no scenario: each scenario (``python -m bench.<name>``, docs/benchmarks.md,
"Harness") imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from bench.baselines import triton_pytriton
from bench.loadgen import oip_request
from bench.process_cpu import ROLES, ServerCpu, process_role, server_processes
from inference.timing_cache import DIRNAME as TIMING_CACHE_DIRNAME, TimingCache

__all__ = ["ROOT", "BIN", "SLO_MS", "START_TIMEOUT_S", "STOP_TIMEOUT_S", "Sizes", "private_bentoml_home", "share_timing_cache", "free_port",
           "stop_process_group", "signal_tree", "exit_on_sigterm", "stop_tree", "Server", "Service", "Replica", "measure_service", "scenario_parser",
           "run_scenario",
           "machine", "ratio",
           "ROLES", "ServerCpu", "process_role", "server_processes"]

ROOT = Path(__file__).resolve().parent.parent
#: The directory of this interpreter's scripts (``bentoml``, ``uvicorn``).
BIN = Path(sys.executable).parent
#: The benchmarks' deadline and P99 target, ms: every request's ``X-Deadline-Ms`` and the knee rule's bound.
SLO_MS = 1000.0
#: How long ``Replica.wait_ready`` waits for ``/readyz`` by default, s.
START_TIMEOUT_S = 300
#: How long ``stop_tree`` waits for a server's tree to go, s: a drain lasts at most the longest deadline
#: (60 s), plus margin.
STOP_TIMEOUT_S = 90


@dataclass(frozen=True)
class Sizes:
    """The load benchmark's step sizes: raw-ceiling ``batch_sizes`` and ``repeats``, ramp ``clients`` and
    ``step_s`` (s per step), overload ``factors`` (× the knee) and ``overload_s`` (s per run), the
    closed-loop sweep's ``sweep_connections`` and ``sweep_s`` (s per round), and ``budget_s`` (s of the
    CPU-budget step)."""

    batch_sizes: list[int]
    repeats: int
    clients: list[int]
    step_s: float
    factors: list[float]
    overload_s: float
    sweep_connections: tuple[int, ...]
    sweep_s: float
    budget_s: float

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        """The full sizes, or with ``quick`` the tiny ones that prove a command and measure little."""
        if quick:
            return cls([1, 4], 1, [1, 8], 1.0, [5.0], 1.0, (1, 4), 1.0, 1.0)
        return cls([1, 2, 4, 8, 16, 32, 64], 3, [1, 2, 4, 8, 16, 32, 64, 128, 256], 4.0, [1.0, 2.0, 5.0, 10.0], 8.0,
                   (1, 4, 16, 64, 256), 10.0, 8.0)


def private_bentoml_home(directory: Path, store: Path | None = None) -> dict[str, str]:
    """Environment giving one ``bentoml serve`` its own BENTOML_HOME that shares the model store.

    BentoML keeps its Prometheus multiprocess files in ``$BENTOML_HOME/prometheus_multiproc_dir``
    and empties it whenever a server starts, so two servers under one home erase each
    other's metrics. ``directory/models`` links to ``store`` (default: the real store), by its absolute
    path; a link left there to another store is replaced. ``directory/rampart-timings`` links to the real
    home's, so every server shares the runners' timing cache (``inference.timing_cache``) as a restarted
    replica on one host would.
    """
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    real_home = Path(os.environ.get("BENTOML_HOME", Path.home() / "bentoml"))
    # A relative target would resolve from the link's folder.
    _link(directory / "models", (store or real_home / "models").resolve())
    share_timing_cache(directory)
    return {"BENTOML_HOME": str(directory)}


def share_timing_cache(home: Path) -> None:
    """Link ``home/rampart-timings`` (a BENTOML_HOME's timing cache, ``inference.timing_cache``) to the
    default cache of this process (``TimingCache.from_setting("")``: under its BENTOML_HOME), so that a
    server under ``home`` reads and adds the timings of every other."""
    timings = TimingCache.from_setting("").directory.resolve()
    timings.mkdir(parents=True, exist_ok=True)
    _link(home.resolve() / TIMING_CACHE_DIRNAME, timings)


def _link(link: Path, target: Path) -> None:
    """Make ``link`` a symbolic link to the folder ``target``, replacing a link to anywhere else."""
    if link.is_symlink() and link.resolve() != target:
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(target, target_is_directory=True)


#: Ports ``free_port`` hands out this process (never the same one twice).
_HANDED_OUT: set[int] = set()


def server_port_range() -> range:
    """The ports ``free_port`` draws from: the 10,000 below Linux's ephemeral range (``ip_local_port_range``,
    32768-60999 by default), or an empty range where that is not known or starts too low.

    ``bind(0)`` hands out a port of the ephemeral range, which every outgoing connection also draws its local
    port from: between the pick and the server's own bind, one of the load generator's hundreds of client
    connections took such a port once (a fresh clone's load benchmark: ``Address already in use``)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(low - 10_000, low) if low > 11_024 else range(0)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the ephemeral range (``server_port_range``) so no outgoing
    connection takes it meanwhile, and not handed out before by this process; the OS's choice (``bind(0)``)
    where that range is unknown. Another server may still take it before it is used."""
    ports = server_port_range()
    for _ in range(200 if ports else 0):
        port = ports[int.from_bytes(os.urandom(2), "little") % len(ports)]
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group started with ``start_new_session``; SIGKILL it after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (BentoML's workers run in process groups of their own)."""
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` and every descendant."""
    for process in _tree(pid):
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def stop_tree(pid: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM ``pid`` alone and wait up to ``timeout_s`` for its whole tree to exit, then SIGKILL what is left.

    ``bentoml serve`` stops its workers itself, in order: the entry service drains first,
    and the runners serve it until it has gone (``rampart.api.lifecycle``). Signalling
    every process at once would start each runner's own wait for the entry service
    instead, and the tree would take up to ``timeout_s`` to go.
    """
    processes = _tree(pid)
    if not processes:
        return
    try:
        processes[0].send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        pass
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def exit_on_sigterm() -> None:
    """Make SIGTERM (a job's timeout, ``kill``) raise ``SystemExit(143)`` in this process's main thread, so that the
    ``finally`` blocks that stop its servers run. A ``Server`` runs in a session of its own, so a command killed by
    SIGTERM's default action left whole servers running (a planner run under ``timeout`` left four). A no-op
    outside the main thread, where Python cannot set a handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class Server:
    """One server process: ``command(port)`` run from the repository root on ``port`` (default: a free one),
    in a session of its own, stdout and stderr to ``log_path`` (appended with ``append``, else truncated).

    The environment is this process's plus ``env``; unless ``env`` names a ``BENTOML_HOME``, the server
    gets a private one in ``home`` (``private_bentoml_home``; required then). Started at once; the
    subclasses say when it is ready. ``process`` is the ``subprocess.Popen``, ``pid`` its pid.
    """

    def __init__(self, name: str, command: Callable[[int], list[str]], log_path: Path,
                 env: dict[str, str] | None = None, home: Path | None = None, port: int | None = None,
                 append: bool = False) -> None:
        self.name = name
        self.port = port or free_port()
        self.log_path = log_path
        env = env or {}
        private = {} if "BENTOML_HOME" in env else private_bentoml_home(home)
        with open(log_path, "ab" if append else "wb") as log:
            self.process = subprocess.Popen(command(self.port), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, env={**os.environ, **private, **env})
        self.pid = self.process.pid

    def log(self) -> str:
        """The last 5000 characters of the server's log."""
        return self.log_path.read_text(errors="replace")[-5000:]

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, interval_s: float, what: str,
                   detail: Callable[[], str] = str) -> None:
        """Call ``ready()`` every ``interval_s`` s until it is true (an ``httpx.HTTPError`` counts as not yet);
        raise ``RuntimeError`` naming ``what`` (with ``detail()`` after it) if the server exits first or
        ``timeout_s`` s pass."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.process.returncode}{detail()}")
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(interval_s)
        raise RuntimeError(f"{what} not ready after {timeout_s} s{detail()}")

    def stop_group(self) -> None:
        """SIGTERM the server's process group; SIGKILL it after 30 s (``stop_process_group``)."""
        stop_process_group(self.process)

    def kill_group(self) -> None:
        """SIGKILL the server's process group at once: what it still holds is abandoned."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop_tree(self) -> None:
        """SIGTERM the server alone and wait for its whole tree (``stop_tree``), then reap it."""
        stop_tree(self.pid)
        self.process.wait(timeout=30)

    def kill_tree(self) -> None:
        """SIGKILL every process of the server's tree at once: a crashed host."""
        signal_tree(self.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self) -> None:
        """SIGTERM the server's first process alone, as Kubernetes signals a container's first process after
        preStop; ``bentoml serve`` stops its workers itself. Returns at once."""
        self.process.send_signal(signal.SIGTERM)


def _bentoml_serve(target: str) -> Callable[[int], list[str]]:
    return lambda port: [str(BIN / "bentoml"), "serve", target, "--host", "127.0.0.1", "--port", str(port)]


class Service(Server):
    """One service under test, in its own process group; ``url`` is its classify endpoint."""

    COMMANDS = {
        "rampart": _bentoml_serve("service:Rampart"),
        "plain_bentoml": _bentoml_serve("bench.baselines.plain_bentoml:Plain"),
        "naive": lambda port: [str(BIN / "uvicorn"), "bench.baselines.naive_fastapi:app", "--host", "127.0.0.1",
                               "--port", str(port), "--log-level", "warning"],
        "triton": triton_pytriton.command,
    }

    def __init__(self, name: str, log_dir: Path, env: dict[str, str] | None = None, label: str | None = None) -> None:
        """Start service ``name`` (see ``COMMANDS``) with extra environment ``env``; its log goes to
        ``log_dir/<label>.log`` (``label`` defaults to ``name``; two instances of one service need two)."""
        label = label or name
        super().__init__(name, self.COMMANDS[name], log_dir / f"{label}.log", env, home=log_dir / f"{label}-home")
        self.url = triton_pytriton.infer_url(self.port) if name == "triton" else f"http://127.0.0.1:{self.port}/classify"
        self.form_field = "image" if name == "plain_bentoml" else None
        self.oip = name == "triton"  # an Open Inference Protocol /infer URL (bench.loadgen.oip_request)

    def wait_ready(self, bodies: list[bytes], timeout_s: float = 300) -> None:
        """Ready when BentoML's ``/readyz`` says so (runners warmed up), then one real request (``bodies[0]``)
        is answered 200; raises ``RuntimeError`` if the service exits first or ``timeout_s`` s pass."""
        base = self.url.rsplit("/", 1)[0]

        def ready() -> bool:
            if self.name in ("rampart", "plain_bentoml") and httpx.get(f"{base}/readyz", timeout=5).status_code != 200:
                return False
            if self.oip:
                body, headers = oip_request(bodies[0])
                response = httpx.post(self.url, content=body, headers=headers, timeout=30)
            elif self.form_field:
                response = httpx.post(self.url, files={self.form_field: ("a.jpg", bodies[0], "image/jpeg")}, timeout=30)
            else:
                response = httpx.post(self.url, content=bodies[0], timeout=30)
            return response.status_code == 200

        self.wait_until(ready, timeout_s, 0.25, self.name)

    def stats(self) -> dict | None:
        """The service's ``GET /stats`` body, or None when it does not answer with JSON."""
        try:
            return httpx.get(self.url.rsplit("/", 1)[0] + "/stats", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None

    def stop(self) -> None:
        """Stop the service by its process group (``Server.stop_group``)."""
        self.stop_group()


def measure_service(name: str, out: Path, bodies: list[bytes], measure: Callable[[Service], dict],
                    env: dict[str, str] | None = None, label: str | None = None) -> dict:
    """Start ``Service(name, out, env, label)``, wait until it answers ``bodies[0]``, return ``measure(service)``;
    the service is stopped whatever happens."""
    service = Service(name, out, env=env, label=label)
    try:
        service.wait_ready(bodies)
        return measure(service)
    finally:
        service.stop()


def scenario_parser(prog: str, description: str, service: bool = False,
                    quick_help: str = "tiny steps: proves the command, measures little") -> argparse.ArgumentParser:
    """The command line every scenario shares: ``--out`` (default ``bench_results``), ``--quick`` and, with
    ``service``, ``--service`` (one of ``Service.COMMANDS``, default ``rampart``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    if service:
        parser.add_argument("--service", choices=tuple(Service.COMMANDS), default="rampart")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser



def run_scenario(prog: str, description: str, run, argv: list[str] | None = None, **parser_options) -> int:
    """A scenario's command: parse ``scenario_parser(prog, description, **parser_options)``, create ``--out`` and
    return ``run(out, quick, command)``, where ``command`` is ``prog`` (with `` --quick`` when given), recorded in
    the scenario's JSON."""
    args = scenario_parser(prog, description, **parser_options).parse_args(argv)
    exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    return run(args.out, args.quick, prog + (" --quick" if args.quick else ""))


def alternated(arms: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, arm)`` for ``rounds`` rounds of every arm, in order A, B, then B, A, ...: drift of a shared host
    falls on every arm alike."""
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            yield r, arm


def plot_arm_bars(rows: list[dict], path: Path, setting: str, series: dict[str, list[float]], ylabel: str) -> None:
    """Grouped bars, one group per row of a same-run A/B (``arm #round``), one bar per entry of ``series`` (its
    values in the rows' order), titled with ``setting`` and its arms; saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['arm']} #{r['round']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(rows))], values, width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(rows))], labels)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{setting}: {' vs '.join(dict.fromkeys(r['arm'] for r in rows))} (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_arms_report(out: Path, name: str, command: str, setting: str, rows: list[dict], medians: dict,
                      plot: Callable[[list[dict], Path, str], None]) -> int:
    """Write a same-run A/B's ``<name>.json`` (command, setting, machine, rows, medians per arm) and ``plot`` it to
    ``<name>.png`` under ``out``; print the medians; 0, the command's exit status."""
    (out / f"{name}.json").write_text(json.dumps({"command": command, "setting": setting, "machine": machine(),
                                                  "rows": rows, "medians": medians}, indent=1))
    plot(rows, out / f"{name}.png", setting)
    print(json.dumps(medians))
    return 0


def run_setting_arms(prog: str, description: str, run, setting: str, arms: tuple[str, ...], rounds: int,
                     argv: list[str] | None = None) -> int:
    """A same-run A/B scenario's command: ``scenario_parser`` plus ``--setting`` (the variable the arms set,
    default ``setting``), ``--arms`` (comma-separated values, default ``arms``) and ``--rounds`` (default
    ``rounds``); creates ``--out`` and returns ``run(out, quick, command, setting, arms, rounds)``, where
    ``command`` is the command line, recorded in the scenario's JSON."""
    parser = scenario_parser(prog, description)
    parser.add_argument("--setting", default=setting, help=f"the variable the arms set (default {setting})")
    parser.add_argument("--arms", default=",".join(arms), help="comma-separated values, one arm each "
                        f"(default {','.join(arms)})")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"rounds of every arm (default {rounds})")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
    return run(args.out, args.quick, command, args.setting, tuple(args.arms.split(",")), args.rounds)


class Replica(Server):
    """One ``bentoml serve service:Rampart`` on 127.0.0.1:``port`` with its own BENTOML_HOME under ``run_dir``
    (its log, ``run_dir/<name>.log``, is appended to): a replica of the loopback cluster (``deploy.cluster``)
    and every real server of the server tests (tests/server/conftest.py).

    ``env`` is added to this process's environment; ``cores`` (CPU numbers), when given, confine the
    replica's whole process tree to them (``taskset``), as if it had a host of that many cores.
    Started at once; ``wait_ready`` blocks.
    """

    def __init__(self, name: str, run_dir: Path, env: dict[str, str] | None = None, port: int | None = None,
                 cores: list[int] | None = None) -> None:
        serve = _bentoml_serve("service:Rampart")
        command = serve if not cores else (lambda p: ["taskset", "-c", ",".join(map(str, cores)), *serve(p)])
        super().__init__(name, command, run_dir / f"{name}.log", env,
                         home=run_dir / f"{name}-home", port=port, append=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until ``/readyz`` is 200 (both runners warm); raise ``RuntimeError`` (with the log's end) if it
        exits or times out."""
        self.wait_until(lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200, timeout_s, 0.1,
                        f"replica {self.name}", lambda: f":\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL every process of the replica at once: a crashed host (``Server.kill_tree``)."""
        self.kill_tree()

    def stop(self) -> None:
        """SIGTERM ``bentoml serve`` alone and wait for its tree to go (``Server.stop_tree``)."""
        self.stop_tree()


def machine() -> dict:
    """The host a report was measured on: platform, Python, CPU count, torch version, GPU name (or None), date."""
    import torch

    return {
        "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded to 2 places; None when either is missing or ``b`` is 0."""
    return round(a / b, 2) if a is not None and b else None
