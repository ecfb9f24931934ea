"""Load generation against a running Rampart (or baseline) server, with aiohttp.

- ``closed_loop(url, bodies, clients, duration_s)``: ``clients`` tasks, each sending
  its next request as soon as the last one is answered (after a 429, once the
  ``Retry-After`` second has passed); measures capacity. ``closed_loop_round``
  does the same and also returns the client's own CPU time; ``client="httpx"``
  drives it with an ``httpx.AsyncClient`` instead of aiohttp, the way many users'
  scripts (and Rampart's SDK) do.
- ``sweep(url, bodies, connections, round_s)``: closed-loop rounds at each
  connection count, with a 1-connection round after each overload round, so that
  any after-effect (hysteresis) of the overload shows.
- ``open_loop(url, bodies, rate, duration_s)``: Poisson arrivals at ``rate`` per
  second, independent of how fast answers come back, the way real overload
  arrives; each arrival is its own task.
- ``burst(url, bodies, count)``: ``count`` requests at the same instant.
- ``summarize(samples, ...)``: throughput, P50/P90/P99, goodput (answers within
  their deadline), shed, degraded and late counts.

``oip=True`` sends each image the Open Inference Protocol way (KServe v2, Triton's HTTP
API) to a model's ``/v2/models/<name>/infer`` URL instead: ``oip_request`` builds the
body, ``oip_answer`` reads the answer into the ``/classify`` shape the samples use.

``python -m bench.loadgen`` runs one of them from the command line (``--help``: every option
and its default) and prints the ``summarize`` of its samples as JSON (docs/clients.md).

``load_bodies()`` gives JPEG bodies of real photos (scikit-image, scikit-learn) in
all three aspect classes (square, landscape, portrait), at most 480 px on the
long side so that client-side CPU stays small next to the server's.

The default client is aiohttp rather than httpx: on the 2-core CI machine an
httpx driver saturated its own core at about 100 requests/s, so it measured
itself. Every round reports the client's CPU time per request
(``client_cpu_ms_per_request``, from ``time.process_time()`` of this process), so
a client that becomes the bottleneck is seen, not mistaken for the server.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import io
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp
import httpx
import numpy as np

from rampart.api.oip import (CLASS_INDICES, DEGRADED_REASON, HEADER_LENGTH, IMAGE, LABELS, MODEL, SCORES,
                             TOP_K_OUTPUTS, serialize_bytes)

__all__ = ["Sample", "Round", "load_bodies", "unique", "oip_request", "oip_answer", "closed_loop", "closed_loop_round",
           "sweep", "open_loop", "burst", "summarize", "as_dicts", "run_sync", "no_gc_pauses", "parser", "main"]


@dataclass(frozen=True)
class Sample:
    """One request: ``sent_s`` (seconds since the run started), ``latency_ms``, HTTP ``status``,
    the answering ``model`` name (None if none), ``degraded_reason``, ``high`` priority, ``deadline_ms``,
    ``server_ms``, the server's own ``timings_ms.total``, ``retry_after_s``, the ``Retry-After``
    header in seconds, and ``inference_ms``, the answering model's compute time (``timings_ms.inference``);
    each None when absent; ``priority``, the class sent (``X-Priority``: high, normal or low)."""

    sent_s: float
    latency_ms: float
    status: int
    model: str | None
    degraded_reason: str | None
    high: bool
    deadline_ms: float
    server_ms: float | None = None
    retry_after_s: float | None = None
    inference_ms: float | None = None
    priority: str = "normal"


@dataclass(frozen=True)
class Round:
    """One closed-loop round: ``connections``, the ``client`` library, its ``samples``, ``duration_s``
    and the client process's CPU seconds spent meanwhile (``client_cpu_s``, ``time.process_time()``)."""

    connections: int
    client: str
    samples: list[Sample]
    duration_s: float
    client_cpu_s: float

    def summary(self, slack_ms: float | None = None) -> dict:
        """``summarize`` of the samples plus ``connections``, ``client``, ``client_cpu_ms_per_request``,
        ``p50_inference_ms`` (the model's compute time in 200 answers) and ``p50_waiting_ms`` (client
        latency less that compute time: the part any after-effect of an overload would add to)."""
        summary = summarize(self.samples, self.duration_s, DEADLINE_SLACK_MS if slack_ms is None else slack_ms)
        ok = [s for s in self.samples if s.status == 200]
        return {"connections": self.connections, "client": self.client, **summary,
                "p50_inference_ms": _percentile([s.inference_ms or 0.0 for s in ok], 50),
                "p50_waiting_ms": _percentile([s.latency_ms - (s.inference_ms or 0.0) for s in ok], 50),
                "client_cpu_ms_per_request": round(self.client_cpu_s * 1000.0 / max(len(self.samples), 1), 3)}


def load_bodies(max_side: int = 480) -> list[bytes]:
    """Six JPEG bodies: two square, two landscape, two portrait crops of real sample photos."""
    from PIL import Image
    from skimage import data
    from sklearn.datasets import load_sample_image

    chelsea, coffee, rocket, china = data.chelsea(), data.coffee(), data.rocket(), load_sample_image("china.jpg")
    crops = [
        chelsea[:, 75:375],          # 300×300 square
        china[:, 100:527],           # 427×427 square
        coffee,                      # 600×400 landscape
        china,                       # 640×427 landscape
        rocket,                      # 427×640 portrait
        china[:, 200:480],           # 280×427 portrait
    ]
    bodies = []
    for crop in crops:
        image = Image.fromarray(np.ascontiguousarray(crop))
        image.thumbnail((max_side, max_side))
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        bodies.append(buffer.getvalue())
    return bodies


#: Documented slack (docs/overload.md): an answer reaching the client later than
#: its deadline plus this is late. The server stops answer_margin_ms (20 ms) plus its
#: recent event-loop lag early; the rest covers the network, client-side scheduling and
#: the rare 200-250 ms scheduler or garbage-collection stall of a saturated 2-core machine.
DEADLINE_SLACK_MS = 300.0
#: How long a closed-loop client waits after a 429 before its next request (Rampart's minimum Retry-After).
RETRY_AFTER_S = 1.0
#: How long a client waits for any answer before giving up (counted as ``failed``).
CLIENT_TIMEOUT_S = 30.0


def _client(max_connections: int, timeout_s: float = CLIENT_TIMEOUT_S) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=300),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def _open_connections(client: aiohttp.ClientSession, url: str, count: int) -> None:
    """Open ``count`` keep-alive connections (``GET /livez``) before the clock starts, as a
    long-running client would have: connection set-up is not what the run measures."""
    base = url.split("/", 3)
    livez = "/".join(base[:3]) + "/livez"

    async def one() -> None:
        async with client.get(livez) as response:
            await response.read()

    await asyncio.gather(*(one() for _ in range(count)))


def unique(body: bytes) -> bytes:
    """``body`` plus 8 random bytes after the JPEG end marker (decoders ignore them), so
    every request has new content and the answer cache never hides a failure."""
    return body + os.urandom(8)


def oip_request(image: bytes) -> tuple[bytes, dict[str, str]]:
    """An Open Inference Protocol (KServe v2) ``/infer`` body for one encoded image, and its headers.

    The JSON header asks for input ``IMAGE``, BYTES, shape ``[1, 1]``, its data in the
    binary tensor data extension (Triton's framing, ``rampart.api.oip.serialize_bytes``:
    a 4-byte little-endian length, then the image's bytes, unencoded), and for the outputs
    ``LABELS``, ``SCORES`` and ``CLASS_INDICES`` as JSON (the outputs a Triton classifier has too). Headers: ``Inference-Header-Content-Length``
    (the JSON header's length), ``Content-Type: application/octet-stream``, and
    ``Accept-Encoding: identity``, since Triton would gzip its answer for aiohttp's default
    ``gzip, deflate``, work no other service under test does.
    """
    tensor = serialize_bytes([image])
    header = json.dumps({
        "inputs": [{"name": IMAGE, "datatype": "BYTES", "shape": [1, 1],
                    "parameters": {"binary_data_size": len(tensor)}}],
        "outputs": [{"name": name, "parameters": {"binary_data": False}} for name in TOP_K_OUTPUTS],
    }, separators=(",", ":")).encode()
    return header + tensor, {HEADER_LENGTH: str(len(header)), "Content-Type": "application/octet-stream",
                             "Accept-Encoding": "identity"}


def oip_answer(payload: dict) -> dict:
    """The ``/classify`` shape (``labels``, ``model``, ``degraded_reason``) of an OIP ``/infer`` answer
    for one image with JSON outputs ``LABELS``, ``SCORES`` and ``CLASS_INDICES`` (shape ``[1, k]``).

    ``labels``: ``[{"index": int, "label": str, "score": float}, ...]`` in the answer's order,
    without padding entries (index -1); ``model``: ``{"name": ...}`` from the output
    ``MODEL`` (Rampart's ``/v2``, when asked for) or else ``model_name`` (Triton), None when
    that is empty or no label came back; ``degraded_reason``: the output ``DEGRADED_REASON``,
    None when absent or empty. Raises ``KeyError`` or ``ValueError`` for an
    answer without those outputs.
    """
    data = {output["name"]: output["data"] for output in payload["outputs"]}
    labels = [{"index": int(index), "label": label, "score": float(score)}
              for index, label, score in zip(data[CLASS_INDICES], data[LABELS], data[SCORES], strict=True)
              if index >= 0]
    model = data[MODEL][0] if MODEL in data else payload.get("model_name")
    reason = data[DEGRADED_REASON][0] if DEGRADED_REASON in data else None
    return {"labels": labels, "model": {"name": model} if model and labels else None,
            "degraded_reason": reason or None}


async def _send(client: aiohttp.ClientSession, url: str, body: bytes, deadline_ms: float, high: bool,
                origin: float, form_field: str | None = None, oip: bool = False, priority: str | None = None) -> Sample:
    priority = priority or ("high" if high else "normal")
    headers = {"X-Deadline-Ms": str(int(deadline_ms))}
    if priority != "normal":
        headers["X-Priority"] = priority
    if oip:  # an Open Inference Protocol model's /infer URL (Triton)
        data, oip_headers = oip_request(body)
        headers.update(oip_headers)
    elif form_field:  # multipart file field, for services that take uploads that way
        data = aiohttp.FormData()
        data.add_field(form_field, body, filename="image.jpg", content_type="image/jpeg")
    else:
        data, headers["Content-Type"] = body, "image/jpeg"
    sent = time.perf_counter()
    try:
        async with client.post(url, data=data, headers=headers) as response:
            status = response.status
            retry_after = _seconds(response.headers.get("Retry-After"))
            payload = await response.json() if response.content_type == "application/json" else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        status, payload, retry_after = 0, {}, None  # connection refused or reset, or the client gave up: failed
    if oip and status == 200:
        try:
            payload = oip_answer(payload)
        except (KeyError, TypeError, ValueError):
            payload = {}  # a 200 without the outputs: answered, but by no model
    if isinstance(payload, list):  # a batchable BentoML API answers a one-item list
        payload = payload[0] if payload else {}
    latency_ms = (time.perf_counter() - sent) * 1000.0
    model = (payload.get("model") or {}).get("name") if isinstance(payload, dict) else None
    reason = payload.get("degraded_reason") if isinstance(payload, dict) else None
    timings = (payload.get("timings_ms") or {}) if isinstance(payload, dict) else {}
    return Sample(sent - origin, latency_ms, status, model, reason, priority == "high", deadline_ms, timings.get("total"),
                  retry_after, timings.get("inference"), priority)


def _seconds(raw: str | None) -> float | None:
    """A ``Retry-After`` value in seconds (delta-seconds form), or None."""
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


def _without_gc_pauses(driver):
    async def wrapped(*args, **kwargs):
        with no_gc_pauses():
            return await driver(*args, **kwargs)

    wrapped.__name__, wrapped.__doc__ = driver.__name__, driver.__doc__
    return wrapped


async def _send_httpx(client: httpx.AsyncClient, url: str, body: bytes, deadline_ms: float, origin: float) -> Sample:
    """``_send`` through an ``httpx.AsyncClient`` (raw body)."""
    headers = {"X-Deadline-Ms": str(int(deadline_ms)), "Content-Type": "image/jpeg"}
    sent = time.perf_counter()
    try:
        response = await client.post(url, content=body, headers=headers)
        status, retry_after = response.status_code, _seconds(response.headers.get("retry-after"))
        payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    except (httpx.HTTPError, ValueError):
        status, payload, retry_after = 0, {}, None
    latency_ms = (time.perf_counter() - sent) * 1000.0
    payload = payload if isinstance(payload, dict) else {}
    timings = payload.get("timings_ms") or {}
    return Sample(sent - origin, latency_ms, status, (payload.get("model") or {}).get("name"),
                  payload.get("degraded_reason"), False, deadline_ms, timings.get("total"), retry_after,
                  timings.get("inference"))


@_without_gc_pauses
async def closed_loop(url: str, bodies: list[bytes], clients: int, duration_s: float,
                      deadline_ms: float = 10_000, form_field: str | None = None, oip: bool = False,
                      priority: str = "normal") -> list[Sample]:
    """``clients`` concurrent senders (aiohttp) for ``duration_s`` seconds, each request with ``X-Priority:
    priority``; returns every sample."""
    return (await _closed_loop(url, bodies, clients, duration_s, deadline_ms, form_field, "aiohttp", oip,
                               priority)).samples


@_without_gc_pauses
async def closed_loop_round(url: str, bodies: list[bytes], connections: int, duration_s: float,
                            deadline_ms: float = 1000, client: str = "aiohttp") -> Round:
    """``connections`` concurrent closed-loop senders for ``duration_s`` s with ``client`` ``aiohttp`` or ``httpx``.

    Each sender uses its own keep-alive connection, opened before the clock starts,
    and waits ``RETRY_AFTER_S`` after a 429. Returns the samples and the CPU time
    this process spent during the round.
    """
    return await _closed_loop(url, bodies, connections, duration_s, deadline_ms, None, client)


async def _closed_loop(url: str, bodies: list[bytes], clients: int, duration_s: float, deadline_ms: float,
                       form_field: str | None, client_kind: str, oip: bool = False, priority: str = "normal") -> Round:
    samples: list[Sample] = []
    origin = stop = 0.0  # set once the connections are open

    async def sender(send, index: int) -> None:
        i = index
        while time.perf_counter() < stop:
            sample = await send(unique(bodies[i % len(bodies)]))
            samples.append(sample)
            if sample.status == 429:  # a well-behaved client backs off (Retry-After is at least 1 s)
                await asyncio.sleep(RETRY_AFTER_S)
            i += clients

    if client_kind == "httpx":
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        session = httpx.AsyncClient(limits=limits, timeout=CLIENT_TIMEOUT_S)
        livez = "/".join(url.split("/", 3)[:3]) + "/livez"
        await asyncio.gather(*(session.get(livez) for _ in range(clients)))

        def send(body):
            return _send_httpx(session, url, body, deadline_ms, origin)

        close = session.aclose
    else:
        session = _client(clients)
        await _open_connections(session, url, clients)

        def send(body):
            return _send(session, url, body, deadline_ms, False, origin, form_field, oip, priority)

        close = session.close
    try:
        cpu = time.process_time()
        origin = time.perf_counter()
        stop = origin + duration_s
        await asyncio.gather(*(sender(send, i) for i in range(clients)))
        elapsed, cpu = time.perf_counter() - origin, time.process_time() - cpu
    finally:
        await close()
    return Round(clients, client_kind, samples, max(elapsed, duration_s), cpu)


def sweep(url: str, bodies: list[bytes], connections: tuple[int, ...] = (1, 4, 16, 64, 256), round_s: float = 10.0,
          deadline_ms: float = 1000, client: str = "aiohttp", overload_from: int = 64) -> list[Round]:
    """Closed-loop rounds at each of ``connections``, each round at ``overload_from`` or more
    connections followed by a 1-connection round (the after-effect check). Synchronous."""
    rounds = []
    for count in connections:
        rounds.append(run_sync(closed_loop_round(url, bodies, count, round_s, deadline_ms, client)))
        if count >= overload_from:
            rounds.append(run_sync(closed_loop_round(url, bodies, 1, round_s, deadline_ms, client)))
    return rounds


@_without_gc_pauses
async def open_loop(url: str, bodies: list[bytes], rate: float, duration_s: float, deadline_ms: float = 1000,
                    high_fraction: float = 0.0, seed: int = 0, form_field: str | None = None,
                    oip: bool = False, client_timeout_s: float = CLIENT_TIMEOUT_S,
                    connections: int | None = None) -> list[Sample]:
    """Poisson arrivals at ``rate`` requests/s for ``duration_s`` s; ``high_fraction`` sent with ``X-Priority: high``.

    The client waits ``client_timeout_s`` for each answer (then the sample has status 0) over at
    most ``connections`` connections (default: twice the arrivals of one deadline, at least 64);
    an arrival finding them all busy waits in the client for one, and that wait counts.
    """
    rng = random.Random(seed)
    tasks = []
    connections = connections or max(64, int(rate * deadline_ms / 1000 * 2))
    async with _client(connections, client_timeout_s) as client:
        await _open_connections(client, url, min(connections, 512))
        origin = time.perf_counter()
        next_at, i = 0.0, 0
        while next_at < duration_s:
            delay = origin + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            high = rng.random() < high_fraction
            body = unique(bodies[i % len(bodies)])
            tasks.append(asyncio.create_task(_send(client, url, body, deadline_ms, high, origin, form_field, oip)))
            i += 1
            next_at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


@_without_gc_pauses
async def burst(url: str, bodies: list[bytes], count: int, deadline_ms: float = 1000,
                high_every: int = 0) -> list[Sample]:
    """``count`` requests sent at once; every ``high_every``-th (if > 0) with ``X-Priority: high``."""
    async with _client(count) as client:
        await _open_connections(client, url, count)
        origin = time.perf_counter()
        return list(await asyncio.gather(*(
            _send(client, url, unique(bodies[i % len(bodies)]), deadline_ms, high_every > 0 and i % high_every == 0, origin)
            for i in range(count)
        )))


def run_sync(coroutine):
    """Run ``coroutine`` to completion from synchronous code, also inside a running event
    loop (a Jupyter kernel), where it gets a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(asyncio.run, coroutine).result()


@contextlib.contextmanager
def no_gc_pauses():
    """Freeze the heap and pause the garbage collector while load runs: a collection in the
    driving process would stall it for hundreds of ms and be measured as server latency."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def summarize(samples: list[Sample], duration_s: float, slack_ms: float = DEADLINE_SLACK_MS) -> dict:
    """Counts and latency percentiles of ``samples`` from a run of ``duration_s`` seconds.

    ``goodput_rps``: 200 answers (full or degraded) within their deadline, per
    second. ``late``: any answer later than its deadline + ``slack_ms``.
    ``p99_accepted_ms``: P99 latency of 200 answers; ``late_200``: 200 answers
    later than deadline + ``slack_ms``; ``failed``: no HTTP answer at all
    (connection refused or reset, or the client's own timeout).
    """
    ok = [s for s in samples if s.status == 200]
    good = [s for s in ok if s.latency_ms <= s.deadline_ms]
    latencies = [s.latency_ms for s in samples]
    accepted = [s.latency_ms for s in ok]
    n = max(len(samples), 1)
    return {
        "requests": len(samples),
        "throughput_rps": round(len(ok) / duration_s, 2),
        "goodput_rps": round(len(good) / duration_s, 2),
        "ok": len(ok),
        "full": sum(1 for s in ok if s.degraded_reason is None),
        "degraded": sum(1 for s in ok if s.degraded_reason is not None),
        "shed_429": sum(1 for s in samples if s.status == 429),
        "errors_5xx": sum(1 for s in samples if s.status >= 500),
        "failed": sum(1 for s in samples if s.status == 0),
        "late": sum(1 for s in samples if s.latency_ms > s.deadline_ms + slack_ms),
        "late_200": sum(1 for s in ok if s.latency_ms > s.deadline_ms + slack_ms),
        "shed_rate": round(sum(1 for s in samples if s.status == 429) / n, 4),
        "degraded_rate": round(sum(1 for s in ok if s.degraded_reason is not None) / n, 4),
        "p50_ms": _percentile(latencies, 50),
        "p90_ms": _percentile(latencies, 90),
        "p99_ms": _percentile(latencies, 99),
        "p99_accepted_ms": _percentile(accepted, 99),
    }


def as_dicts(samples: list[Sample]) -> list[dict]:
    """Samples as plain dicts, for JSON."""
    return [asdict(s) for s in samples]


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.loadgen``: every option with its help and default."""
    cli = argparse.ArgumentParser(
        prog="python -m bench.loadgen", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Load a running Rampart (or any /classify-compatible server) with real photos and print "
                    "a JSON summary: throughput, goodput, P50/P90/P99, full, degraded, shed and late counts.",
        epilog="closed: --connections senders, each sending its next request when the last is answered "
               f"(after a 429 it waits {RETRY_AFTER_S:g} s); open: Poisson arrivals at --rate per second; "
               "burst: --count requests at once.")
    cli.add_argument("--url", default="http://127.0.0.1:3000", help="the server's base URL")
    cli.add_argument("--mode", choices=("closed", "open", "burst"), default="closed", help="how load arrives")
    cli.add_argument("--connections", type=int, default=8, help="closed: concurrent senders")
    cli.add_argument("--rate", type=float, default=20.0, help="open: mean arrivals per second")
    cli.add_argument("--count", type=int, default=32, help="burst: requests sent at once")
    cli.add_argument("--duration-s", type=float, default=10.0, help="closed and open: seconds of load")
    cli.add_argument("--deadline-ms", type=float, default=1000.0, help="X-Deadline-Ms of every request")
    cli.add_argument("--high-fraction", type=float, default=0.0,
                     help="open: share sent with X-Priority: high, 0..1 (burst: every 1/F-th; closed: none)")
    cli.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp", help="closed: the HTTP client library")
    cli.add_argument("--form-field", default=None,
                     help="send each image as this multipart field instead of a raw body (closed and open)")
    cli.add_argument("--oip", action="store_true",
                     help="send the Open Inference Protocol way to /v2/models/rampart/infer (closed and open)")
    cli.add_argument("--seed", type=int, default=0, help="open: the arrivals' random seed")
    cli.add_argument("--slack-ms", type=float, default=DEADLINE_SLACK_MS,
                     help="an answer later than its deadline plus this counts as late")
    cli.add_argument("--samples", default=None, help="also write every sample as JSON to this file")
    return cli


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m bench.loadgen`` with ``argv`` (default ``sys.argv[1:]``); prints the JSON summary, returns 0."""
    args = parser().parse_args(argv)
    from rampart.api.oip import MODEL_NAME

    base = args.url.rstrip("/")
    url = f"{base}/v2/models/{MODEL_NAME}/infer" if args.oip else f"{base}/classify"
    bodies = load_bodies()
    started = time.perf_counter()
    if args.mode == "closed" and args.client == "httpx":
        samples = run_sync(closed_loop_round(url, bodies, args.connections, args.duration_s, args.deadline_ms,
                                             "httpx")).samples
    elif args.mode == "closed":
        samples = run_sync(closed_loop(url, bodies, args.connections, args.duration_s, args.deadline_ms,
                                       args.form_field, args.oip))
    elif args.mode == "open":
        samples = run_sync(open_loop(url, bodies, args.rate, args.duration_s, args.deadline_ms, args.high_fraction,
                                     args.seed, args.form_field, args.oip))
    else:
        high_every = round(1 / args.high_fraction) if args.high_fraction > 0 else 0
        samples = run_sync(burst(url, bodies, args.count, args.deadline_ms, high_every))
    duration_s = args.duration_s if args.mode != "burst" else time.perf_counter() - started
    summary = {"mode": args.mode, "url": url, **summarize(samples, duration_s, args.slack_ms)}
    if args.samples:
        with open(args.samples, "w") as out:
            json.dump(as_dicts(samples), out)
    json.dump(summary, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
