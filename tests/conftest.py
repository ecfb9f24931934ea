"""Shared fixtures: real photos and real ``bentoml serve`` subprocesses on 127.0.0.1."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from bench.load_bench import free_port, private_bentoml_home, stop_process_group
from bench.loadgen import DEADLINE_SLACK_MS

ROOT = Path(__file__).resolve().parent.parent
BENTOML = str(Path(sys.executable).with_name("bentoml"))
START_TIMEOUT_S = 240

#: ImageNet-1k indices that count as a right answer for each sample photo.
CAT = {281, 282, 283, 284, 285}
COFFEE = {967, 968, 504}
ROCKET = {812, 657, 744}  # space shuttle, missile, projectile
CHINA = {698, 663, 538, 668, 449, 975}  # palace, monastery, dome, mosque, boathouse, lakeside


def photo(name: str) -> np.ndarray:
    """A real sample photo as uint8 H×W×3: skimage's chelsea/coffee/rocket, sklearn's china."""
    if name == "china":
        from sklearn.datasets import load_sample_image

        return load_sample_image("china.jpg")
    from skimage import data

    return getattr(data, name)()


def encode(array_or_image, fmt: str = "JPEG", **save_kwargs) -> bytes:
    """Encode a uint8 array or PIL image to bytes in ``fmt``."""
    image = array_or_image if isinstance(array_or_image, Image.Image) else Image.fromarray(array_or_image)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_kwargs)
    return buffer.getvalue()


SLACK_MS = DEADLINE_SLACK_MS  # the documented slack beyond a deadline (bench/loadgen.py)

PHOTOS = {"chelsea": CAT, "coffee": COFFEE, "rocket": ROCKET, "china": CHINA}


class Server:
    """A ``bentoml serve service:Rampart`` process group on a free 127.0.0.1 port."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [BENTOML, "serve", "service:Rampart", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=ROOT, env={**os.environ, **private_bentoml_home(log_path.parent / "home"), **env},
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"bentoml serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"bentoml serve not ready after {START_TIMEOUT_S}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        stop_process_group(self.process)
        self._log.close()


def launch(tmp_path_factory, env: dict[str, str]) -> Server:
    """A ready ``Server`` with extra environment ``env``; stopped again if it never gets ready."""
    server = Server({k: str(v) for k, v in env.items()}, tmp_path_factory.mktemp("serve") / "serve.log")
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
    servers: list[Server] = []

    def start(**env: str) -> Server:
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
