"""Request-bound cases the in-process and server tests share: the liveness budget and bomb ratio of the
request bounds' contract, multipart bodies and part bombs, the check of a JSON error answer, and the peak
memory of a server tree under a burst."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import psutil


#: /livez must answer within this while part bombs are parsed (the request bounds' contract).
LIVEZ_BUDGET_MS = 100


#: A part bomb is refused in at most this multiple of the time a plain upload of the same size takes.
BOMB_TO_UPLOAD_RATIO = 3.0


def form(parts: list[tuple[str, str | None, bytes]], boundary: bytes = b"B") -> bytes:
    """A multipart/form-data body of ``(name, filename or None, data)`` parts."""
    out = []
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out.append(b"--" + boundary + b"\r\nContent-Disposition: " + disposition.encode() + b"\r\n\r\n" + data + b"\r\n")
    return b"".join(out) + b"--" + boundary + b"--\r\n"


#: 2 million empty parts, 18 MB: under the /classify byte cap.
EMPTY_PARTS_BOMB = b"--B\r\n\r\n\r\n" * 2_000_000 + b"--B--\r\n"


#: 100,000 tiny image parts, 7.5 MB.
TINY_IMAGES_BOMB = form([("images", str(i), b"x") for i in range(100_000)])


MULTIPART = {"Content-Type": "multipart/form-data; boundary=B"}


def json_error(response: httpx.Response, status: int, code: str) -> dict:
    """Assert ``response`` is a JSON error ``status``/``code`` with a message and request id; return its ``error`` body."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()["error"]
    assert body["code"] == code and body["message"] and body["request_id"], body
    return body


def process_tree(pid: int) -> set[int]:
    """The pids of process ``pid`` and all its descendants."""
    root = psutil.Process(pid)
    return {root.pid, *(child.pid for child in root.children(recursive=True))}


def concurrent_posts_with_peak_rss_growth(server, bodies: list[bytes], path: str = "/classify",
                                          headers: dict[str, str] | None = None) -> tuple[list[httpx.Response], float]:
    """POST ``bodies`` (with ``headers``) to ``path`` all at once; (the responses, the peak growth of the server
    tree's RSS in MB over the requests, sampled every 10 ms)."""
    processes = [psutil.Process(pid) for pid in process_tree(server.process.pid)]

    def tree_rss() -> int:
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.Error:
                pass
        return total

    baseline = tree_rss()
    peak, sampling = [baseline], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], tree_rss())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post(path, content=body, headers=headers) for body in bodies))

    try:
        responses = asyncio.run(burst())
    finally:
        sampling.set()
        sampler.join()
    return responses, (peak[0] - baseline) / 1e6
