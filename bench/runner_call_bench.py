"""CPU per runner call, in process, through BentoML's real runner app and through Rampart's lean route.

``python -m bench.runner_call_bench [--calls 300] [--rounds 5] [--out bench_results] [--quick]`` imports
the near-free model (``bench.ceiling``: a model that costs almost nothing) into a private store, builds the
primary runner's BentoML app in this process (``ServiceAppFactory``, Rampart's patches applied, its
lifespan run: the model loaded and warmed), and sends it calls of one square-bucket image and of four, as
the entry service sends them (BentoML's pickle wire format), over ASGI (no sockets). Per round and call
size, ``--calls`` calls each way, alternated: ``bentoml``, through the app's whole middleware stack and
endpoint; ``lean``, through ``rampart.compat.bentoml_runner_calls``'s route for the same API. CPU is
``time.process_time()`` (the dispatcher's worker thread and the model included), per call.

Writes ``runner_calls.json`` (every round, the medians, ``lean`` over ``bentoml``) and ``runner_calls.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("bentoml", "lean")
CALL_SIZES = (1, 4)
API = "square"


def pickled_call(input_spec, items: list) -> tuple[bytes, dict[str, str]]:
    """A call of a batchable API with ``items`` as the entry service's client sends it (BentoML's pickle wire
    format: the API's ``input_spec`` built from the items, then pickled): (body, headers)."""
    from rampart.compat.bentoml_private import pickle_serde

    serde = pickle_serde()
    payload = serde.serialize_model(input_spec.from_inputs(items))
    return b"".join(bytes(part) for part in payload.data), {"content-type": serde.media_type, **payload.headers}


def _call_bodies(method, sizes) -> dict[int, tuple[bytes, dict[str, str]]]:
    """A call of ``size`` square-bucket images per size: (body, headers)."""
    import numpy as np

    from runners.common import RunnerItem

    pixels = np.random.default_rng(0).integers(0, 255, (260, 260, 3), dtype=np.uint8)
    return {size: pickled_call(method.input_spec, [RunnerItem(pixels=pixels, deadline_epoch_s=time.time() + 3600,
                                                              request_id=str(i)) for i in range(size)])
            for size in sizes}


async def asgi_call(app, path: str, body: bytes, headers: dict[str, str], method: str = "POST"
                    ) -> tuple[int, list, bytes]:
    """One HTTP request to the ASGI ``app`` in process, its whole body at once: (status, sorted header pairs,
    body)."""
    messages = []
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message: dict) -> None:
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "state": {},
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 3000),
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    await app(scope, receive, send)
    return (messages[0]["status"], sorted(messages[0]["headers"]),
            b"".join(m.get("body", b"") for m in messages[1:]))


async def _send(app, body: bytes, headers: dict[str, str]) -> int:
    """One call to ``/square``; returns its status."""
    return (await asgi_call(app, f"/{API}", body, headers))[0]


async def _measure(calls: int, rounds: int) -> list[dict]:
    from rampart.compat import apply_all
    from rampart.compat.bentoml_private import service_app_factory
    from rampart.compat.bentoml_runner_calls import lean_batch_routes
    from runners.primary import Primary

    apply_all()
    Primary.inject_config()
    app = service_app_factory()(Primary, is_main=False, enable_metrics=True)()
    bodies = _call_bodies(Primary.apis[API], CALL_SIZES)
    runs = []
    async with app.router.lifespan_context(app):
        assert await _send(app, *bodies[1]) == 200  # BentoML builds its middleware stack at its first call
        ways = {"bentoml": app, "lean": lean_batch_routes(app)[f"/{API}"]}
        for call in bodies.values():
            for way in ways.values():  # warm both
                for _ in range(min(calls, 30)):
                    assert await _send(way, *call) == 200
        for index in range(rounds):
            for size, call in bodies.items():
                order = WAYS if index % 2 == 0 else WAYS[::-1]
                for name in order:
                    started = time.process_time()
                    for _ in range(calls):
                        await _send(ways[name], *call)
                    runs.append({"round": index, "images_per_call": size, "way": name,
                                 "cpu_us_per_call": round((time.process_time() - started) * 1e6 / calls, 1)})
    return runs


def summarise(runs: list[dict]) -> dict[str, dict]:
    """Per call size: the median CPU µs per call of each way and ``lean`` over ``bentoml``."""
    out = {}
    for size in sorted({run["images_per_call"] for run in runs}):
        medians = {way: statistics.median(r["cpu_us_per_call"] for r in runs
                                          if r["images_per_call"] == size and r["way"] == way) for way in WAYS}
        out[str(size)] = {**{way: round(us, 1) for way, us in medians.items()},
                          "lean_over_bentoml": round(medians["lean"] / medians["bentoml"], 3)}
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(report["summary"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for offset, way in enumerate(WAYS):
        ax.bar([i + offset * 0.4 for i in range(len(sizes))], [report["summary"][s][way] / 1000 for s in sizes], 0.4,
               label=way)
    ax.set(xticks=[i + 0.2 for i in range(len(sizes))], xticklabels=[f"{s} image(s) a call" for s in sizes],
           ylabel="CPU ms per call", title="runner call, in process, near-free model (medians)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="calls per way, call size and round (default 300)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, ways alternated (default 5)")
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON and PNG")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 20 calls")
    args = parser.parse_args(argv)
    calls, rounds = (20, 2) if args.quick else (args.calls, args.rounds)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from bench.ceiling import NEAR_FREE_NAME, finish_import, near_free_onnx, start_import
    from bench.harness import private_bentoml_home

    directory = out / "near-free"
    onnx_path = near_free_onnx(directory / "near_free.onnx")
    if not (directory / "store" / "models" / NEAR_FREE_NAME).exists():
        finish_import(start_import(onnx_path, directory / "store"))
    os.environ.update(private_bentoml_home(out / "runner-call-home", directory / "store" / "models"))
    os.environ.update({"RAMPART_PRIMARY_MODEL": f"{NEAR_FREE_NAME}:latest",
                       "RAMPART_FALLBACK_MODEL": f"{NEAR_FREE_NAME}:latest", "RAMPART_CPU_PINNING": "off"})
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="rampart-runner-calls-"))
    runs = asyncio.run(_measure(calls, rounds))
    report = {"date": time.strftime("%Y-%m-%d"), "calls": calls, "rounds": rounds, "runs": runs,
              "summary": summarise(runs)}
    (out / "runner_calls.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "runner_calls.png")
    print(json.dumps(report["summary"], indent=2))
    return report


if __name__ == "__main__":
    main()
