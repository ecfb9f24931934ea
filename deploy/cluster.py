"""Rampart replicas on loopback behind nginx: ``python -m deploy.cluster start|stop``.

``make serve-cluster`` runs ``start``: ``--replicas`` (2) ``bentoml serve service:Rampart``
processes on free 127.0.0.1 ports, each with its own BENTOML_HOME (BentoML empties its
Prometheus directory when a server starts, see ``bench.harness.private_bentoml_home``),
and nginx from ``deploy/nginx/nginx.conf.template`` on ``--port`` (8080), retrying the
next replica on 429, 503, connection errors and connect timeouts. It returns once every
replica is ready; state and logs live in ``--run-dir`` (``.cluster/``), and ``make
stop-cluster`` (``stop``) stops them. ``RAMPART_*`` variables in the environment reach
every replica.

On one machine this only simulates separate hosts: the replicas share its CPU cores,
so CPU-bound capacity does not add up (tests/server/test_cluster.py makes each replica's
capacity latency-bound to see the load balancer's effect). For the same reason the replicas
run with ``RAMPART_CPU_PINNING=off`` unless the environment says otherwise: under ``reserve`` each
would reserve the same cores for its primary, and under ``weight`` each primary would start a thread
per core of the shared machine (``rampart.cores``).

``Nginx`` and ``Cluster`` are also what the tests drive; each replica is a ``bench.harness.Replica``
(the harness holds the one launcher of every server).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.harness import Replica, stop_tree

__all__ = ["Nginx", "Cluster", "nginx_binary", "stop_saved", "main"]

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = Path(__file__).with_name("nginx") / "nginx.conf.template"


def nginx_binary() -> str | None:
    """Path of the nginx executable (Debian puts it in /usr/sbin, often not on a user's PATH), or None."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


class Nginx:
    """nginx (daemonised) on 127.0.0.1:``port`` in front of ``ports``, with config, pid and logs in ``run_dir``."""

    def __init__(self, run_dir: Path, port: int) -> None:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed: `make serve-cluster` installs it (apt-get install nginx-light)")
        self.binary = binary
        self.run_dir = run_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.conf = run_dir / "nginx.conf"
        self.access_log = run_dir / "nginx-access.log"

    def _command(self, *args: str) -> None:
        out = subprocess.run([self.binary, "-p", str(self.run_dir), "-e", str(self.run_dir / "nginx-error.log"),
                              "-c", str(self.conf), *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"nginx {' '.join(args)} failed: {out.stderr}")

    def configure(self, ports: list[int]) -> None:
        """Write the config for upstreams on ``ports`` (tried in turn, each at most once) and test it."""
        for temp in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.run_dir / "tmp" / temp).mkdir(parents=True, exist_ok=True)
        servers = "\n".join(f"        server 127.0.0.1:{port} max_fails=0;" for port in ports)
        text = (TEMPLATE.read_text()
                .replace("{{USER}}", "user root;" if os.geteuid() == 0 else "")  # workers may write run_dir/tmp
                .replace("{{RUN_DIR}}", str(self.run_dir)).replace("{{SERVERS}}", servers)
                .replace("{{TRIES}}", str(len(ports))).replace("{{PORT}}", str(self.port)))
        self.conf.write_text(text)
        self._command("-t", "-q")

    def start(self) -> None:
        self._command()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/livez", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"nginx did not start on {self.url}")

    def reload(self, ports: list[int]) -> None:
        """Point nginx at ``ports`` without dropping a connection (SIGHUP: new workers, old ones finish)."""
        self.configure(ports)
        self._command("-s", "reload")

    def stop(self) -> None:
        if (self.run_dir / "nginx.pid").exists():
            self._command("-s", "quit")


class Cluster:
    """``replicas`` Rampart replicas and nginx on ``port``, all under ``run_dir``; ``url`` is nginx. ``cores``:
    per replica, the CPUs its processes are confined to (replica ``i`` gets ``cores[i % len(cores)]``)."""

    def __init__(self, run_dir: Path, replicas: int = 2, port: int = 8080, env: dict[str, str] | None = None,
                 cores: list[list[int]] | None = None) -> None:
        self.run_dir = run_dir
        self.count = replicas
        self.cores = cores  # per replica, the CPUs it is confined to (``Replica``'s ``cores``); None: all
        self.env = {"RAMPART_CPU_PINNING": os.environ.get("RAMPART_CPU_PINNING", "off"), **(env or {})}
        self.replicas: list[Replica] = []
        self.nginx = Nginx(run_dir, port)
        self.url = self.nginx.url

    def start(self) -> None:
        """Start the replicas (together), then nginx once all are ready; stops everything on failure."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.replicas = [Replica(f"replica{i}", self.run_dir, self.env, cores=self._cores_of(i))
                             for i in range(self.count)]
            self.save()
            for replica in self.replicas:
                replica.wait_ready()
            self.nginx.configure([r.port for r in self.replicas])
            self.nginx.start()
        except BaseException:
            self.stop()
            raise

    def spawn(self, index: int) -> Replica:
        """Start (not wait for) a successor to replica ``index``; ``install`` puts it in rotation."""
        return Replica(f"replica{index}-{time.time_ns()}", self.run_dir, self.env, cores=self._cores_of(index))

    def _cores_of(self, index: int) -> list[int] | None:
        return None if self.cores is None else self.cores[index % len(self.cores)]

    def install(self, index: int, replica: Replica) -> Replica:
        """Wait for ``replica`` to be ready, then put it in place of replica ``index`` (dead or drained)
        and point nginx at the new set without dropping a connection."""
        replica.wait_ready()
        self.replicas[index] = replica
        self.nginx.reload([r.port for r in self.replicas])
        self.save()
        return replica

    def save(self) -> None:
        state = {"url": self.url, "replicas": [{"name": r.name, "pid": r.pid, "url": r.url} for r in self.replicas]}
        (self.run_dir / "state.json").write_text(json.dumps(state, indent=2))

    def stop(self) -> None:
        self.nginx.stop()
        for replica in self.replicas:
            replica.stop()
        (self.run_dir / "state.json").unlink(missing_ok=True)


def stop_saved(run_dir: Path) -> bool:
    """Stop the cluster whose state ``start`` saved in ``run_dir``; False if none was running."""
    state_path = run_dir / "state.json"
    if not state_path.exists():
        return False
    state = json.loads(state_path.read_text())
    if (run_dir / "nginx.conf").exists():
        Nginx(run_dir, 0).stop()
    for replica in state["replicas"]:
        stop_tree(replica["pid"])
    state_path.unlink()
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("start", "stop"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--run-dir", type=Path, default=ROOT / ".cluster")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.resolve()
    if args.command == "stop":
        print("stopped" if stop_saved(run_dir) else f"no cluster running (no {run_dir / 'state.json'})")
        return 0
    if (run_dir / "state.json").exists():
        print(f"a cluster is already running ({run_dir / 'state.json'}); `make stop-cluster` first", file=sys.stderr)
        return 1
    cluster = Cluster(run_dir, args.replicas, args.port)
    cluster.start()
    for replica in cluster.replicas:
        print(f"{replica.name}: {replica.url} (log {replica.log_path})")
    print(f"nginx: {cluster.url}  (POST {cluster.url}/classify; logs in {run_dir}; stop: make stop-cluster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
