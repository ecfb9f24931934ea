"""The client's own CPU per call: Rampart's ``AsyncClient`` against plain httpx and aiohttp.

``python -m bench.client_bench [--calls N] [--out bench_results]`` starts a stand-in
server (uvicorn + httptools + uvloop, in its own process, answering ``/classify``
with a canned Rampart answer at once) and measures, in this process, the CPU time
(``time.process_time()``) per call of each client at 1, 64 and 256 concurrent
calls, each call uploading the same 30 kB JPEG-sized body. The server's cost is in
another process, so what is measured is the client alone. Writes ``clients.json``.

A load generator or an SDK that burns milliseconds of CPU per call competes with
the server on a small host and then measures itself (in the closed-loop overload an httpx driver
spent 13 ms per request at 256 connections on the 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 64, 256)
BODY = b"\xff\xd8" + b"\1" * 30_000
ANSWER = json.dumps({
    "request_id": "x", "labels": [{"index": 285, "label": "Egyptian cat", "score": 0.61}] * 5,
    "model": {"name": "rampart-primary", "version": "v"}, "degraded": False, "degraded_reason": None,
    "needs_review": False, "bucket": "square",
    "timings_ms": {"before_handler": 0.1, "decode": 1.0, "queue": 2.0, "inference": 3.0, "total": 6.0},
}).encode()


async def stub_app(scope, receive, send) -> None:
    """The stand-in server: reads the whole body, answers the canned JSON."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]})
    await send({"type": "http.response.body", "body": ANSWER})


def start_stub(port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", "bench.client_bench:stub_app", "--port", str(port),
                                "--log-level", "warning", "--backlog", "2048", "--http", "httptools", "--loop", "uvloop"],
                               cwd=ROOT, start_new_session=True)
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return process
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("stub server did not start")


async def cpu_per_call(call, calls: int, concurrency: int) -> float:
    """CPU ms of this process per ``call()``, ``concurrency`` at a time, ``calls`` in all (after a warm-up)."""
    async def worker(count: int) -> None:
        for _ in range(count):
            await call()

    await asyncio.gather(*(worker(2) for _ in range(concurrency)))  # open the connections, warm up
    start = time.process_time()
    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    return (time.process_time() - start) * 1000.0 / (calls // concurrency * concurrency)


async def measure(url: str, calls: int) -> dict[str, dict[str, float]]:
    import aiohttp

    from rampart_client import AsyncClient

    results: dict[str, dict[str, float]] = {}

    def sdk(transport: str):
        async def run(concurrency: int) -> float:
            async with AsyncClient(url, transport=transport) as client:
                return await cpu_per_call(lambda: client.classify(BODY, deadline_ms=1000), calls, concurrency)
        return run

    async def plain_httpx(concurrency: int) -> float:  # httpx with its default pool, as most scripts use it
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async def call():
                (await client.post("/classify", content=BODY, headers={"X-Deadline-Ms": "1000"})).json()
            return await cpu_per_call(call, calls, concurrency)

    async def plain_aiohttp(concurrency: int) -> float:
        connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=300)
        async with aiohttp.ClientSession(url, connector=connector) as session:
            async def call():
                async with session.post("/classify", data=BODY, headers={"X-Deadline-Ms": "1000"}) as response:
                    await response.json()
            return await cpu_per_call(call, calls, concurrency)

    for name, client in (("AsyncClient (aiohttp)", sdk("aiohttp")), ("AsyncClient (httpx, sized pool)", sdk("httpx")),
                         ("httpx default", plain_httpx), ("aiohttp", plain_aiohttp)):
        results[name] = {str(c): round(await client(c), 3) for c in CONCURRENCY}
        print(f"{name:30s} CPU ms per call {results[name]}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    from bench.harness import free_port, stop_process_group

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    stub = start_stub(port)
    try:
        results = asyncio.run(measure(f"http://127.0.0.1:{port}", args.calls))
    finally:
        stop_process_group(stub)
    (args.out / "clients.json").write_text(json.dumps({"cpu_ms_per_call": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
