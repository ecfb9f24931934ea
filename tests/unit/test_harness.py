"""``bench.harness``: the one launcher of the benchmarks, the cluster and the server tests, on small real
subprocesses (no BentoML server): log, private BentoML home, readiness, stop by process group or tree."""

from __future__ import annotations

import socket
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.harness import Server, Sizes, private_bentoml_home

#: A process that prints its BentoML home and its port argument, then waits to be stopped.
SLEEPER = ("import os, sys, time; print(os.environ['BENTOML_HOME'], sys.argv[1], flush=True); "
           "time.sleep(60)")


def sleeper(port: int) -> list[str]:
    return [sys.executable, "-c", SLEEPER, str(port)]


def logged(server: Server, timeout_s: float = 10) -> str:
    """The server's log once it has a line."""
    deadline = time.monotonic() + timeout_s
    while not server.log().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.log()


def test_a_server_gets_a_private_home_sharing_the_store_its_port_and_a_log(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    server = Server("sleeper", sleeper, tmp_path / "sleeper.log", home=tmp_path / "home",
                    env={"RAMPART_UNUSED": "1"})
    try:
        home, port = logged(server).split()
        assert Path(home) == (tmp_path / "home").resolve() and int(port) == server.port > 0
        assert (tmp_path / "home" / "models").is_symlink()
    finally:
        server.stop_group()
    assert server.process.returncode == -signal.SIGTERM
    # A home given in the environment wins: no private one is made.
    given = Server("given", sleeper, tmp_path / "given.log", env={"BENTOML_HOME": str(tmp_path / "mine")})
    try:
        assert logged(given).split()[0] == str(tmp_path / "mine")
    finally:
        given.kill_group()
    assert given.process.returncode == -signal.SIGKILL and not (tmp_path / "mine").exists()
    # The link follows the store asked for, replacing one to another store.
    assert private_bentoml_home(tmp_path / "home", store) == {"BENTOML_HOME": str((tmp_path / "home").resolve())}
    assert (tmp_path / "home" / "models").resolve() == store.resolve()


def test_the_log_is_truncated_or_appended_to(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("before\n")
    for append in (True, False):
        server = Server("echo", lambda port: [sys.executable, "-c", "print('run')"], log, home=tmp_path / "home",
                        append=append)
        server.process.wait(timeout=30)
        assert log.read_text() == ("before\nrun\n" if append else "run\n")


def test_wait_until_returns_when_ready_and_names_an_exit_or_a_timeout(tmp_path):
    server = Server("sleeper", sleeper, tmp_path / "sleeper.log", home=tmp_path / "home")
    try:
        calls = []
        server.wait_until(lambda: calls.append(1) or len(calls) == 3, 5, 0.01, "sleeper")
        assert len(calls) == 3
        with pytest.raises(RuntimeError, match=r"^sleeper not ready after 0.05 s!$"):
            server.wait_until(lambda: False, 0.05, 0.01, "sleeper", lambda: "!")
    finally:
        server.stop_tree()
    assert server.process.poll() is not None  # reaped by stop_tree's wait (its code is psutil's to read)
    gone = Server("gone", lambda port: [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "gone.log",
                  home=tmp_path / "home")
    with pytest.raises(RuntimeError, match=r"^replica gone exited with 3: see the log$"):
        gone.wait_until(lambda: False, 30, 0.01, "replica gone", lambda: ": see the log")


def test_kill_tree_ends_the_server_and_its_children(tmp_path):
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            "print('started', flush=True); time.sleep(60)"
    server = Server("parent", lambda port: [sys.executable, "-c", child], tmp_path / "parent.log",
                    home=tmp_path / "home")
    assert logged(server).strip() == "started"
    children = psutil.Process(server.pid).children(recursive=True)
    assert len(children) == 1
    server.kill_tree()
    assert server.process.returncode == -signal.SIGKILL
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []


def test_the_step_sizes_are_the_load_benchmark_s():
    full, quick = Sizes.of(False), Sizes.of(True)
    assert full.clients == [1, 2, 4, 8, 16, 32, 64, 128, 256] and full.step_s == 4.0 and full.budget_s == 8.0
    assert full.factors == [1.0, 2.0, 5.0, 10.0] and full.overload_s == 8.0 and full.sweep_s == 10.0
    assert full.batch_sizes == [1, 2, 4, 8, 16, 32, 64] and full.repeats == 3
    assert full.sweep_connections == (1, 4, 16, 64, 256)
    assert quick == Sizes([1, 4], 1, [1, 8], 1.0, [5.0], 1.0, (1, 4), 1.0, 1.0)


def test_sigterm_to_a_command_that_started_a_server_stops_the_server(tmp_path):
    """A server runs in a session of its own: a command killed by SIGTERM's default action (a job's timeout) left
    it running. With ``exit_on_sigterm`` the command's ``finally`` stops it."""
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
              "from pathlib import Path\nfrom bench.harness import Server, exit_on_sigterm\n"
              f"from tests.unit.test_harness import sleeper\nexit_on_sigterm()\n"
              f"server = Server('s', sleeper, Path({str(tmp_path)!r}) / 's.log', home=Path({str(tmp_path)!r}) / 'h')\n"
              "try:\n    print(server.pid, flush=True)\n    import time; time.sleep(60)\n"
              "finally:\n    server.stop_group()\n")
    command = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(command.stdout.readline())
    assert psutil.pid_exists(server_pid)
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=20) == 128 + signal.SIGTERM
    psutil.wait_procs([psutil.Process(server_pid)] if psutil.pid_exists(server_pid) else [], timeout=10)
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    """Outgoing connections draw their local ports from the ephemeral range; a server port picked there was
    taken by the load generator's own connections once before the server bound it."""
    from bench.harness import free_port, server_port_range

    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert server_port_range() and all(port < ephemeral_low and port in server_port_range() for port in ports)
    for port in ports[:3]:  # and each is free to bind
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
