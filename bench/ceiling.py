"""The serving ceiling with a near-free model: how many requests per second, and how much CPU per request,
Rampart's serving itself costs when the model costs almost nothing.

A GPU host runs the model thousands of times a second; what bounds it then is the API
layer and decoding. This scenario measures that bound on any host by serving a model
that costs almost nothing: ``near_free_onnx`` (global average pool over the image, then
one linear layer 3 → 1000 ImageNet logits, dynamic batch, height and width like the
fallback's export). It goes in through the "your own model" import
(``python -m models.import_models --shadow-onnx … --shadow-name rampart-near-free
--no-check``: the one import that takes an ONNX file under a name of one's choosing)
into a private model store, and serves as both Rampart's primary and fallback
(``RAMPART_PRIMARY_MODEL``, ``RAMPART_FALLBACK_MODEL``) and as the naive baseline's
model (``bench.baselines.common.load_primary`` reads the same setting).

In each of ``ROUNDS`` rounds (the servers take turns, each started afresh, in reverse order every
other round), for each server (Rampart with ``api_workers`` 1 and 2, the naive FastAPI baseline) and
each body (``phone_jpeg``: a ~500 KB 1600×1200 JPEG; ``png_260``: a 260×260 PNG), one
closed-loop round of aiohttp clients (``bench.loadgen.closed_loop_round``, every body
made unique so the answer cache never answers), with the CPU time of every server
process over the round, read with psutil (``bench.process_cpu``) and grouped (``grouped``):

- ``api``: the entry service's worker processes (for the naive baseline: its one
  uvicorn process, which also decodes and computes);
- ``decode_pool``: processes under an entry worker (the decode workers, their
  forkserver and resource tracker: role ``decode``);
- ``runners``: the model runner processes (roles ``primary``, ``fallback``, ``shadow``);
- ``supervisor``: ``bentoml serve``'s own process.

CPU per request is each role's CPU seconds over the round divided by the requests
answered in it (µs). The report's ``runs`` give, per server and body, the round whose total is the
median of its rounds; ``cpu_vs_naive`` each Rampart server's total over the naive server's in the same
round, and their median: the naive server's own cost moved by a third between runs of one host (its
PNG decode 2.5 and 3.2 ms of CPU a request), so the ratio is taken within a round. *Serving overhead* is everything except decoding and the model:
for Rampart ``api + runners + supervisor − model``, for the naive baseline
``api − its decode − model``, where ``model`` (the engine's CPU per image at batch 1,
calls back to back) is measured in this process on the same bodies (``in_process_costs``),
the naive decode in the naive server's round (``naive_decode_served_us``, below; in this
process when its ``/stats`` does not answer); Rampart's decoding is what ``decode_pool`` measured. Beside it, each
Rampart round reports ``decode_vs_naive`` and ``decode_vs_lean``: its decode pool's CPU per
request over the naive server's whole decode and over the *lean reference* (``lean_decode``:
Pillow's ``draft("RGB", bucket size)``, then one resize to the bucket: what the pixels the
model needs cost at least), all measured in the same run. Those two are measured in this
process, alone on a core; the decode pool is measured while serving, beside the API worker,
the runners and the client (this host's two vCPUs are one core's hyperthreads, and a decode
costs about a fifth more with a busy neighbour). So each Rampart round also reports
``decode_vs_naive_served``: over ``naive_decode_served_us``, the naive server's own decode CPU
per image in its round with the same body (its ``/stats``: the loop thread's CPU time inside
``naive_pixels``), both then measured where they are served. In this process the three
decodes take turns round by round, and ``decode_vs_naive_side_by_side`` is the median of the
rounds' Rampart ÷ naive: the one ratio a host whose speed drifts during the run cannot bend. ONNX
Runtime's threads spin-wait after each call (``model_at_100_per_s`` shows what that
costs when calls are apart); ``model`` leaves that out, so it counts as overhead. The API
process's own part of decoding (format sniffing, header checks, the pipe to the pool)
stays in the overhead: it is not separated without a profiler.

The load generator runs on the same machine and takes CPU from the servers
(``client_cpu_us_per_request`` says how much), so the requests per second are a
ceiling of this host with its client, while the CPU per request is the server's own.
``clean`` says whether every answer of a round was a full 200: no shed, degraded, 5xx or
failed request. Only then are its figures the cost of serving alone, which several API
workers' separate admission gates (docs/overload.md) cannot have shaped.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness import ServerCpu, Service, machine, private_bentoml_home, ratio, run_scenario
from bench.loadgen import closed_loop_round, run_sync

__all__ = ["NEAR_FREE_NAME", "near_free_onnx", "phone_jpeg", "small_png", "start_import", "finish_import", "grouped",
           "in_process_costs", "lean_pixels", "ceiling_scenario", "plot_ceiling", "run", "main"]

ROOT = Path(__file__).resolve().parent.parent
NEAR_FREE_NAME = "rampart-near-free"
#: The near-free model's input resolution: the primary's (EfficientNet-Lite2, 260 px), so the
#: decode pool fits the same bucket sizes as for the real primary.
NEAR_FREE_RESOLUTION = 260
#: "A typical phone JPEG (about 500 KB)": a 4:3 photo at 1600×1200, the quality picked to land nearest.
PHONE_JPEG_SIZE = (1600, 1200)
PHONE_JPEG_TARGET_BYTES = 500_000
SMALL_PNG_SIDE = 260
#: Deadline of every request here: long enough that no answer is shaped by it (the decode queue of a
#: saturated 2-core host holds a closed loop's requests for hundreds of ms, and at the 1 s default some
#: would be answered by the fallback), since this scenario measures cost, not deadlines.
DEADLINE_MS = 10_000.0
#: The target for serving overhead (everything but decoding and the model), µs of CPU per request.
OVERHEAD_TARGET_US = 1000.0
#: Rounds of a full (not ``--quick``) run: every server afresh in each, the order reversed every other round.
ROUNDS = 3
#: This scenario's groups of ``bench.process_cpu`` roles (module doc); a role not named keeps its name.
ROLES = ("api", "decode_pool", "runners", "supervisor")
GROUP_OF_ROLE = {"decode": "decode_pool", "primary": "runners", "fallback": "runners", "shadow": "runners"}


def grouped(roles: dict[str, dict]) -> dict[str, dict]:
    """``bench.process_cpu.ServerCpu.stop``'s ``{role: {"cpu_s", "processes"}}`` summed into ``ROLES``."""
    out = {group: {"cpu_s": 0.0, "processes": 0} for group in ROLES}
    for role, spent in roles.items():
        group = out.setdefault(GROUP_OF_ROLE.get(role, role), {"cpu_s": 0.0, "processes": 0})
        group["cpu_s"] += spent["cpu_s"]
        group["processes"] += spent["processes"]
    return out


def near_free_onnx(path: Path) -> Path:
    """Write the near-free classifier to ``path`` and return it.

    Input ``input`` float32 N×3×H×W (N, H, W dynamic), output ``logits`` float32 N×1000:
    ``GlobalAveragePool`` → ``Flatten`` → ``Gemm`` with fixed weights (normal, σ 0.01,
    seed 0; zero bias). Opset 17, IR version 10 (what ``models.import_models`` writes).
    Its cost is one pass over the pixels and 3000 multiply-adds.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from models.import_models import MAX_ONNX_IR_VERSION, ONNX_OPSET

    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array((rng.standard_normal((3, 1000)) * 0.01).astype(np.float32), "weights")
    bias = numpy_helper.from_array(np.zeros(1000, np.float32), "bias")
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
         helper.make_node("Gemm", ["flat", "weights", "bias"], ["logits"])],
        "near_free",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1000])],
        [weights, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = MAX_ONNX_IR_VERSION
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def phone_jpeg() -> tuple[bytes, dict]:
    """scikit-learn's ``china.jpg`` resized (Lanczos) to 1600×1200 and saved as baseline JPEG at the
    quality (50..98) whose size is nearest 500 KB (binary search: the size grows with the quality);
    returns (bytes, ``{"size", "quality", "bytes"}``). Deterministic for one Pillow version (pinned)."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    image = Image.fromarray(load_sample_image("china.jpg")).resize(PHONE_JPEG_SIZE, Image.Resampling.LANCZOS)
    encodings: dict[int, bytes] = {}

    def encode(quality: int) -> bytes:
        if quality not in encodings:
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=quality)
            encodings[quality] = buffer.getvalue()
        return encodings[quality]

    low, high = 50, 98  # the smallest quality whose size reaches the target lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        if len(encode(middle)) < PHONE_JPEG_TARGET_BYTES:
            low = middle + 1
        else:
            high = middle
    quality = min({low, max(low - 1, 50)}, key=lambda q: abs(len(encode(q)) - PHONE_JPEG_TARGET_BYTES))
    body = encodings[quality]
    return body, {"size": list(PHONE_JPEG_SIZE), "quality": quality, "bytes": len(body)}


def small_png() -> tuple[bytes, dict]:
    """scikit-image's ``chelsea``, its centre square resized (Lanczos) to 260×260, as PNG;
    returns (bytes, ``{"size", "bytes"}``)."""
    from PIL import Image
    from skimage import data

    cat = data.chelsea()  # 300×451
    side = min(cat.shape[:2])
    left = (cat.shape[1] - side) // 2
    image = Image.fromarray(np.ascontiguousarray(cat[:side, left:left + side]))
    image = image.resize((SMALL_PNG_SIDE, SMALL_PNG_SIDE), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue(), {"size": [SMALL_PNG_SIDE, SMALL_PNG_SIDE], "bytes": len(buffer.getvalue())}


def start_import(onnx_path: Path, home: Path) -> subprocess.Popen:
    """Start importing ``onnx_path`` into a private model store at ``home`` (its own ``models``
    folder, so the real store is never written); ``finish_import`` waits for it.

    Runs ``python -m models.import_models --shadow-onnx … --shadow-name rampart-near-free
    --shadow-resolution 260 --no-check`` with ``BENTOML_HOME=home``, in the background: most
    of its 4 s is importing torch, which the scenario overlaps with its in-process measurements.
    """
    (home / "models").mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "models.import_models", "--shadow-onnx", str(onnx_path),
                             "--shadow-name", NEAR_FREE_NAME, "--shadow-resolution", str(NEAR_FREE_RESOLUTION),
                             "--no-check"], cwd=ROOT, env={**os.environ, "BENTOML_HOME": str(home)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish_import(process: subprocess.Popen, timeout_s: float = 300) -> None:
    """Wait for ``start_import``'s process; raises ``subprocess.CalledProcessError`` (with its output) if it failed."""
    output, _ = process.communicate(timeout=timeout_s)
    if process.returncode != 0:
        raise subprocess.CalledProcessError(process.returncode, process.args, output)


def _cpu_us(function, repeats: int) -> float:
    """Mean CPU time of ``function()`` in this process (all threads), µs, after one warm-up call."""
    function()
    start = time.process_time()
    for _ in range(repeats):
        function()
    return (time.process_time() - start) / repeats * 1e6


def _alternated_cpu_us(functions: dict, repeats: int) -> dict[str, list[float]]:
    """Per name, the mean CPU µs of its function in each of up to 10 rounds (``repeats`` calls in all, split
    into rounds, after one warm-up call each); the functions take turns round by round, so a host whose
    speed drifts during the measurement slows them alike and their per-round ratios stay true."""
    rounds = max(1, min(10, repeats // 5))
    per_round = max(1, repeats // rounds)
    out: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            out[name].append(_cpu_us(function, per_round))
    return out


def _paced_cpu_us(function, rate: float, calls: int) -> float:
    """Mean CPU time of ``function()`` in this process (all threads), µs, when called ``rate`` times a second."""
    function()
    start = time.process_time()
    next_at = time.perf_counter()
    for _ in range(calls):
        function()
        next_at += 1.0 / rate
        time.sleep(max(0.0, next_at - time.perf_counter()))
    return (time.process_time() - start) / calls * 1e6


def lean_pixels(data: bytes, bucket) -> np.ndarray:
    """The lean reference decode: ``draft("RGB", (bucket.width, bucket.height))``, then one bicubic resize to
    the bucket (Pillow, no crop, no checks); uint8 bucket.height×bucket.width×3."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.draft("RGB", (bucket.width, bucket.height))
    return np.asarray(image.convert("RGB").resize((bucket.width, bucket.height), Image.Resampling.BICUBIC))


def in_process_costs(onnx_path: Path, bodies: dict[str, bytes], repeats: int) -> dict[str, dict]:
    """Per body, the CPU µs in this process of (the three decodes alternated round by round, ``_alternated_cpu_us``,
    each the median of its rounds, and ``decode_vs_naive_side_by_side`` the median of the rounds'
    ``rampart_decode`` ÷ ``naive_decode``): ``rampart_decode`` (``rampart.inputs.decode_job.prepare``
    with the service's default ``DecodePlan`` for two 260 px models, as the decode pool runs it),
    ``naive_decode`` (``bench.baselines.common.naive_pixels``: full decode, RGB, squash to 260×260),
    ``lean_decode`` (``lean_pixels`` for the body's bucket),
    ``model`` (the near-free engine, ``inference.engines.OnnxClassifier``, on the primary's
    prepared 1×H×W×3 batch, calls back to back; normalisation included) and
    ``model_at_100_per_s`` (the same call paced at 100 calls/s: ONNX Runtime's intra-op threads
    spin-wait for work after each call, and that CPU is charged per call when calls are apart)."""
    from bench.baselines.common import naive_pixels
    from inference.engines import OnnxClassifier
    from models.import_models import LITE_MEAN, LITE_STD
    from rampart.config import Settings
    from rampart.inputs.buckets import buckets_for_resolution
    from rampart.inputs.decode_job import prepare
    from rampart.pipeline import decode_plan

    settings = Settings()
    buckets = buckets_for_resolution(NEAR_FREE_RESOLUTION)
    plan = decode_plan(settings, {"primary": buckets, "fallback": buckets})
    engine = OnnxClassifier(str(onnx_path), LITE_MEAN, LITE_STD)
    out = {}
    for name, body in bodies.items():
        bucket, pixels = prepare(body, plan).inputs["primary"]
        decodes = _alternated_cpu_us({"rampart_decode": lambda: prepare(body, plan),
                                      "naive_decode": lambda: naive_pixels(body, NEAR_FREE_RESOLUTION),
                                      "lean_decode": lambda: lean_pixels(body, bucket)}, repeats)
        out[name] = {
            **{key: round(statistics.median(rounds), 1) for key, rounds in decodes.items()},
            "decode_vs_naive_side_by_side": round(statistics.median(
                mine / naive for mine, naive in zip(decodes["rampart_decode"], decodes["naive_decode"])), 3),
            "model": round(_cpu_us(lambda: engine.predict(pixels[None]), repeats), 1),
            "model_at_100_per_s": round(_paced_cpu_us(lambda: engine.predict(pixels[None]), 100.0, 2 * repeats), 1),
            "bucket": bucket.name,
        }
    return out


def measure_round(service, body: bytes, connections: int, duration_s: float, deadline_ms: float,
                  root_role: str) -> dict:
    """One closed-loop round of ``connections`` clients posting ``body`` to a ready ``service``
    (``bench.harness.Service``), with its processes' CPU by role.

    Returns ``bench.loadgen.summarize``'s counts and latencies, ``clean`` (every answer a
    full 200), ``client_cpu_us_per_request`` and ``cpu_us_per_request`` per role and in
    total, and ``processes`` per role (how many were found: the API worker count shows here).
    """
    meter = ServerCpu(service.process.pid, root_role)
    meter.start()
    round_ = run_sync(closed_loop_round(service.url, [body], connections, duration_s, deadline_ms))
    roles = grouped(meter.stop())
    summary = round_.summary()
    answered = max(summary["ok"], 1)
    per_request = {role: round(roles[role]["cpu_s"] * 1e6 / answered, 1) for role in ROLES}
    per_request["total"] = round(sum(per_request.values()), 1)
    keep = ("requests", "throughput_rps", "ok", "full", "degraded", "shed_429", "errors_5xx", "failed", "p50_ms", "p99_ms")
    return {**{key: summary[key] for key in keep},
            "clean": summary["requests"] > 0 and summary["full"] == summary["requests"],
            "cpu_us_per_request": per_request,
            "client_cpu_us_per_request": round(round_.client_cpu_s * 1e6 / max(summary["requests"], 1), 1),
            "processes": {role: roles[role]["processes"] for role in ROLES}}


def served_decode_us(before: dict | None, after: dict | None) -> float | None:
    """The naive server's decode CPU per image (µs) between two of its ``/stats`` bodies
    (``bench.baselines.naive_fastapi``); None when either is missing or no image was decoded."""
    if not before or not after or after["decodes"] <= before["decodes"]:
        return None
    spent = (after["decode_cpu_s"] - before["decode_cpu_s"]) / (after["decodes"] - before["decodes"])
    return round(spent * 1e6, 1)


def with_breakdown(run: dict, costs: dict, naive: bool) -> dict:
    """``run`` (``measure_round``) plus ``decode_us``, ``model_us`` and ``serving_overhead_us`` (module doc),
    and whether the overhead is within the 1 ms target (``OVERHEAD_TARGET_US``)."""
    cpu = run["cpu_us_per_request"]
    model = costs["model"]
    if naive:  # its decode as measured where it is served, when its /stats said so
        decode = run.get("naive_decode_served_us") or costs["naive_decode"]
        overhead = cpu["api"] - decode - model
    else:
        decode = cpu["decode_pool"]
        overhead = cpu["api"] + cpu["runners"] + cpu["supervisor"] - model
    decode_ratios = {} if naive else {"decode_vs_naive": _share(decode, costs["naive_decode"]),
                                      "decode_vs_lean": _share(decode, costs["lean_decode"])}
    return {**run, "decode_us": round(decode, 1), **decode_ratios, "model_us": model,
            "serving_overhead_us": round(overhead, 1), "overhead_within_1ms": overhead < OVERHEAD_TARGET_US}


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 3) if whole > 0 else None


def ceiling_scenario(out: Path, quick: bool, deadline_ms: float = DEADLINE_MS, rounds: int | None = None) -> dict:
    """The near-free-model scenario (module doc): import, then ``rounds`` rounds in which Rampart with 1 and 2
    API workers and the naive baseline each start afresh, one server at a time, and each body gets one
    measured round after a warm-up round. The servers take turns in each round, in reverse order every
    other round (A, B, C, then C, B, A), so a host whose speed drifts during the run weighs on all of them.

    ``quick``: only Rampart with 2 API workers and the naive baseline, one round of 1 s with 8 connections
    and no warm-up (proves the scenario and the worker count, measures little; about 20 s); else all
    three servers, ``rounds`` (default ``ROUNDS``) of 10 s with 16 connections after 3 s. Logs and the
    private store go under ``out``. Returns ``{"model", "bodies", "settings", "in_process_us", "runs":
    {server: {body: round}}, "rounds": {server: {body: [round, ...]}}, "cpu_vs_naive": {server: {body:
    {"rounds": [...], "median": m}}}, "ratios": {server: {body: req/s ÷ naive's}}, "wall_s": {server:
    {"ready", "total"}}, "overhead_target_us"}``. ``runs`` holds, per server and body, the round whose
    total CPU per request is the median of its rounds; ``cpu_vs_naive`` divides a Rampart server's total
    CPU per request by the naive server's in the same round, the one figure drift between rounds does
    not bend.
    """
    connections, round_s, warm_s, repeats = (8, 1.0, 0.0, 5) if quick else (16, 10.0, 3.0, 50)
    rounds = 1 if quick else (rounds or ROUNDS)
    directory = out / "near-free"
    onnx_path = near_free_onnx(directory / "near_free.onnx")
    importing = start_import(onnx_path, directory / "store")
    try:
        jpeg, jpeg_info = phone_jpeg()
        png, png_info = small_png()
        bodies = {"phone_jpeg": jpeg, "png_260": png}
        costs = in_process_costs(onnx_path, bodies, repeats)
    finally:
        finish_import(importing)
    store, tag = directory / "store" / "models", f"{NEAR_FREE_NAME}:latest"
    # No reserved core for a model that costs nothing (rampart.cores): the API workers get every core.
    servers = {"rampart_1_worker": ("rampart", {"RAMPART_API_WORKERS": "1", "RAMPART_CPU_PINNING": "off"}),
               "rampart_2_workers": ("rampart", {"RAMPART_API_WORKERS": "2", "RAMPART_CPU_PINNING": "off"}),
               "naive": ("naive", {})}
    if quick:
        del servers["rampart_1_worker"]
    every: dict[str, dict[str, list[dict]]] = {label: {body: [] for body in bodies} for label in servers}
    wall: dict[str, dict] = {label: {"ready": [], "total": 0.0} for label in servers}
    for index in range(rounds):
        for label in (list(servers) if index % 2 == 0 else list(servers)[::-1]):
            name, extra = servers[label]
            started = time.monotonic()
            home = private_bentoml_home(out / f"near-free-{label}-home", store)
            env = {**home, "RAMPART_PRIMARY_MODEL": tag, "RAMPART_FALLBACK_MODEL": tag, **extra}
            service = Service(name, out, env=env, label=f"near-free-{label}")
            root_role = "api" if name == "naive" else "supervisor"
            try:
                service.wait_ready([jpeg])
                wall[label]["ready"].append(round(time.monotonic() - started, 1))
                for body_name, body in bodies.items():
                    if warm_s:
                        run_sync(closed_loop_round(service.url, [body], connections, warm_s, deadline_ms))
                    before = service.stats() if name == "naive" else None
                    run = measure_round(service, body, connections, round_s, deadline_ms, root_role)
                    if before is not None:
                        run["naive_decode_served_us"] = served_decode_us(before, service.stats())
                    every[label][body_name].append({"round": index,
                                                    **with_breakdown(run, costs[body_name], naive=name == "naive")})
            finally:
                service.stop()
            wall[label]["total"] = round(wall[label]["total"] + time.monotonic() - started, 1)
    for label in servers.keys() - {"naive"}:
        for body in bodies:
            for mine, naive in zip(every[label][body], every["naive"][body]):
                mine["decode_vs_naive_served"] = _share(mine["decode_us"], naive.get("naive_decode_served_us") or 0)
    runs = {label: {body: _median_round(every[label][body]) for body in bodies} for label in servers}
    cpu_vs_naive = {label: {body: _paired_cpu(every[label][body], every["naive"][body]) for body in bodies}
                    for label in servers if label != "naive"}
    ratios = {label: {body: ratio(runs[label][body]["throughput_rps"], runs["naive"][body]["throughput_rps"])
                      for body in bodies} for label in runs if label != "naive"}
    return {
        "model": {"name": NEAR_FREE_NAME, "resolution": NEAR_FREE_RESOLUTION,
                  "graph": "GlobalAveragePool -> Flatten -> Gemm(3 -> 1000), ONNX opset 17",
                  "import": "python -m models.import_models --shadow-onnx near_free.onnx --shadow-name "
                            f"{NEAR_FREE_NAME} --shadow-resolution {NEAR_FREE_RESOLUTION} --no-check"},
        "bodies": {"phone_jpeg": jpeg_info, "png_260": png_info},
        "settings": {"connections": connections, "round_s": round_s, "warm_up_s": warm_s, "deadline_ms": deadline_ms,
                     "rounds": rounds},
        "in_process_us": costs,
        "runs": runs,
        "rounds": every,
        "cpu_vs_naive": cpu_vs_naive,
        "ratios": ratios,
        "wall_s": wall,
        "overhead_target_us": OVERHEAD_TARGET_US,
    }


def _median_round(rounds: list[dict]) -> dict:
    """The round whose total CPU per request is the median of ``rounds`` (the lower middle one for an even count)."""
    ordered = sorted(rounds, key=lambda run: run["cpu_us_per_request"]["total"])
    return ordered[(len(ordered) - 1) // 2]


def _paired_cpu(mine: list[dict], naive: list[dict]) -> dict:
    """Per round, a Rampart server's total CPU per request over the naive server's in the same round, and their
    median (``{"rounds": [...], "median": m}``; None where the naive round answered nothing)."""
    paired = [_share(a["cpu_us_per_request"]["total"], b["cpu_us_per_request"]["total"]) for a, b in zip(mine, naive)]
    known = [value for value in paired if value is not None]
    return {"rounds": paired, "median": round(statistics.median(known), 3) if known else None}


def plot_ceiling(report: dict, path: Path) -> None:
    """Bars per body: decode CPU per request of each Rampart server's decode pool, the naive server's whole
    decode and the lean reference (all from ``report``, one ``ceiling_scenario`` run), and serving overhead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bodies = list(report["bodies"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series = {f"{label} decode pool": [report["runs"][label][body]["decode_us"] for body in bodies]
              for label in report["runs"] if label != "naive"}
    series["naive decode"] = [report["in_process_us"][body]["naive_decode"] for body in bodies]
    if "naive" in report["runs"]:
        series["naive decode, served"] = [report["runs"]["naive"][body].get("naive_decode_served_us") or 0
                                          for body in bodies]
    series["lean reference"] = [report["in_process_us"][body]["lean_decode"] for body in bodies]
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series.items()):
        axes[0].bar([b + index * width for b in range(len(bodies))], [v / 1000 for v in values], width, label=name)
    axes[0].set(xticks=[b + 0.4 - width / 2 for b in range(len(bodies))], xticklabels=bodies,
                ylabel="CPU ms per request", title="Decode")
    axes[0].legend(fontsize=8)
    labels = list(report["runs"])
    for index, body in enumerate(bodies):
        axes[1].bar([x + index * 0.4 for x in range(len(labels))],
                    [report["runs"][label][body]["serving_overhead_us"] / 1000 for label in labels], 0.4, label=body)
    axes[1].axhline(report["overhead_target_us"] / 1000, color="grey", linestyle="--", label="1 ms target")
    axes[1].set(xticks=[x + 0.2 for x in range(len(labels))], xticklabels=labels, ylabel="CPU ms per request",
                title="Serving overhead (all but decode and model)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Near-free-model ceiling, {report.get('machine', {}).get('cpus', '?')} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(out: Path, quick: bool, command: str) -> int:
    """``ceiling_scenario``; writes ``ceiling.json`` (with ``machine()`` and ``command``) and ``ceiling.png``,
    and prints the runs."""
    report = {"machine": machine(), "command": command, **ceiling_scenario(out, quick)}
    (out / "ceiling.json").write_text(json.dumps(report, indent=2))
    plot_ceiling(report, out / "ceiling.png")
    print(json.dumps(report["runs"], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.ceiling [--out bench_results] [--quick]`` (also ``python -m bench.load_bench --ceiling-only``)."""
    return run_scenario("python -m bench.ceiling", __doc__, run, argv, quick_help="Rampart with 2 API workers and the naive "
                        "baseline only, 1 s rounds: proves the command")


if __name__ == "__main__":
    sys.exit(main())
