"""What BentoML's per-request middlewares cost Rampart's entry service, in CPU per request.

``python -m bench.middleware_bench [--requests N] [--out bench_results]`` builds the
entry service's real middleware stack (``_bentoml_impl.server.app.ServiceAppFactory``
for ``service:Rampart``, with Rampart's service configuration) around a stand-in
``/classify`` that returns a canned answer, then drives it in-process through ASGI
calls (no sockets, no models), ``N`` requests at concurrency 1 and 64. It reports
CPU microseconds per request (``time.process_time()``) for the whole stack, for no
middleware at all, and for the stack without each middleware in turn: the
difference is what that middleware costs. Writes ``middlewares.json``.

Every microsecond here is spent on the event loop before Rampart's admission sees
the request or after the answer is ready, so on a saturated CPU host it is time the
deadline pays for and that shedding cannot save.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANSWER = {"request_id": "x", "labels": [{"index": 285, "label": "Egyptian cat", "score": 0.61}] * 5,
          "model": {"name": "rampart-primary", "version": "v"}, "degraded": False, "degraded_reason": None,
          "needs_review": False, "bucket": "square",
          "timings_ms": {"before_handler": 0.1, "decode": 1.0, "queue": 2.0, "inference": 3.0, "total": 6.0}}
BODY = b"\xff\xd8" + b"\0" * 30_000  # a 30 kB upload, read in full by the stand-in


def stacks() -> dict[str, list]:
    """Middleware lists by name: ``all`` (as ``bentoml serve`` builds them), ``none``, and ``without <Name>`` each."""
    sys.path.insert(0, str(ROOT))
    import service

    service.Rampart.inject_config()
    from rampart.compat.bentoml_private import service_app_factory

    factory = service_app_factory()(service.Rampart, is_main=True, enable_metrics=True)
    middlewares = factory.middlewares
    out = {"all": middlewares, "none": []}
    for middleware in middlewares:
        out[f"without {middleware.cls.__name__}"] = [m for m in middlewares if m is not middleware]
    return out


def app_with(middlewares: list):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def classify(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse(ANSWER, headers={"Server-Timing": "total;dur=6.0"})

    return Starlette(routes=[Route("/classify", classify, methods=["POST"])], middleware=middlewares)


async def drive(app, requests: int, concurrency: int) -> float:
    """CPU microseconds per request for ``requests`` ASGI calls, ``concurrency`` at a time."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/classify", "raw_path": b"/classify", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 3000),
             "headers": [(b"content-type", b"image/jpeg"), (b"content-length", str(len(BODY)).encode()),
                         (b"x-deadline-ms", b"1000")]}

    async def one() -> None:
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await asyncio.sleep(3600)

        async def send(message):
            pass

        await app(dict(scope, state={}), receive, send)

    for _ in range(50):  # warm-up
        await one()
    start = time.process_time()
    for _ in range(requests // concurrency):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    return (time.process_time() - start) * 1e6 / (requests // concurrency * concurrency)


def measure(variant: str, requests: int) -> dict[str, float]:
    """CPU µs per request of one stack (see ``stacks``) at concurrency 1 and 64."""
    app = app_with(stacks()[variant])
    return {str(c): round(asyncio.run(drive(app, requests, c)), 1) for c in (1, 64)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: measure one stack, print JSON
    args = parser.parse_args(argv)
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="rampart-mw-"))
    if args.variant:
        print(json.dumps(measure(args.variant, args.requests)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    # One process per stack: BentoML's metrics middleware registers its series once per process.
    for name in stacks():
        done = subprocess.run([sys.executable, "-m", "bench.middleware_bench", "--variant", name,
                               "--requests", str(args.requests)], cwd=ROOT, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name:45s} {results[name]}", flush=True)
    costs = {name.removeprefix("without "): {c: round(results["all"][c] - us, 1) for c, us in results[name].items()}
             for name in results if name.startswith("without ")}
    report = {"cpu_us_per_request": results, "cost_us_per_request": costs}
    (args.out / "middlewares.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(costs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
