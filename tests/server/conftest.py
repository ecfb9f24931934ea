"""Real ``bentoml serve`` servers on 127.0.0.1 (``bench.harness.Replica``), each stopped when its scope ends."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
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
        server.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """Rampart with its default settings, shared by every module that needs no other settings."""
    server = launch(tmp_path_factory, {})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
