"""Real ``bentoml serve`` servers on 127.0.0.1 (``bench.harness.Replica``), each stopped when its scope ends."""

from __future__ import annotations

import threading

import httpx
import pytest

from bench.harness import Replica


def launch(tmp_path_factory, env: dict[str, str]) -> Replica:
    """A ready server with extra environment ``env``; stopped again if it never gets ready."""
    server = Replica("serve", tmp_path_factory.mktemp("serve"), {k: str(v) for k, v in env.items()})
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def stop_in_background():
    """``stop(server)`` stops a server in a thread of its own, and the session waits for every stop at its end.

    A stop is ``bentoml serve``'s drain (SIGTERM, the entry service exits, then the runners): 1.3-2.1 s on
    the 2-core host, nearly all of it waiting, which the next module need not wait for (about 25 stops a run).
    """
    stopping: list[threading.Thread] = []

    def stop(server: Replica) -> None:
        thread = threading.Thread(target=server.stop, name=f"stop {server.name}")
        thread.start()
        stopping.append(thread)

    yield stop
    for thread in stopping:
        thread.join()


@pytest.fixture(scope="module")
def start_server(tmp_path_factory, stop_in_background):
    """Start servers with extra environment; each is stopped when the module that started it ends.

    A server takes about 3.5 GB (two models, the API worker, decode workers): kept to the
    end of the session, the suite's dozen servers would not fit in the CI host's 24 GB.
    """
    servers: list[Replica] = []

    def start(**env: str) -> Replica:
        server = launch(tmp_path_factory, env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        stop_in_background(server)


@pytest.fixture(scope="session")
def server(tmp_path_factory, stop_in_background):
    """Rampart with its default settings, shared by every module that needs no other settings."""
    server = launch(tmp_path_factory, {})
    yield server
    stop_in_background(server)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
