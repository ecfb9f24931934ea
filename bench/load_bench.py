"""Load benchmark: Rampart against the usual ways of serving the same model, same machine, same run.

``python -m bench.load_bench [--out bench_results] [--quick]`` writes ``load.json``
and ``load.png``. The load comes from this process (aiohttp, ``bench.loadgen``);
each service runs in its own subprocess on 127.0.0.1.

1. **Raw model ceiling**: primary (PyTorch) and fallback (ONNX Runtime) images/s at
   batch sizes 1..64, in this process, no serving: the machine's physical limit.
2. **Closed-loop ramp**, 1, 2, 4 … 256 clients: throughput, P50/P90/P99, error rate.
   The *knee* is the highest throughput whose P99 stays within the SLO (the 1 s
   deadline) with at most 1% of requests refused.
3. **Open-loop overload** (Poisson) at 1×, 2×, 5× and 10× Rampart's knee: goodput
   (answers within their deadline that carry a model's labels), shed rate,
   degraded rate, P99 of accepted requests, late answers.
4. **Closed-loop sweep** of Rampart at 1, 4, 16, 64 and 256 connections, 10 s
   rounds with a 1-connection round after each overload round (64 and 256), so
   that any after-effect shows; latency and late answers measured at the client,
   with the client's own CPU per request (``bench.loadgen.sweep``).
   ``--sweep-only`` runs just this (about 2 minutes plus start-up) and writes
   ``closed_loop.json``; ``--sweep-client httpx`` drives it with httpx instead.
5. **Baselines** with the same model and images: (a) ``naive``, the seed's FastAPI
   service (one asyncio queue, 5 ms window, max batch 8, no admission control);
   (b) ``plain_bentoml``, one batchable BentoML API with default settings; (c) ``triton``,
   NVIDIA Triton through PyTriton with dynamic batching (``bench.baselines.triton_pytriton``),
   an optional *peer*: it runs when ``make bench-peers`` has installed it in ``.venv-peers``
   and is otherwise recorded as ``{"skipped": reason}``. Each gets the ramp and 5× its own
   knee; the ratios Rampart/baseline are reported for knee throughput, goodput at 5× and
   P99 at 5×. ``--peers-only`` runs just the peers and the naive baseline as the same-run
   reference (about 3 minutes) and writes ``peers.json`` with the ratios peer/naive.

6. **Cascade against primary-first** (``cascade_scenario``), on the calibration's
   evaluation set (``bench.cascade_eval.evaluation_set``, each image re-encoded as JPEG
   quality 90 like the other bodies): a second Rampart with ``RAMPART_ROUTING=cascade``
   (default threshold) gets the same ramp as primary-first Rampart on the same bodies.
   Reported per arm: the knee, the *full knee* (the knee rule plus at most 1% degraded
   answers: the highest throughput at full quality), their P99, and the answers'
   routes; and the cascade's top-1 agreement with the primary-only answers on every
   image (both servers asked one image at a time with a 10 s deadline, so nothing is
   degraded). ``--cascade-only`` runs just this scenario and writes ``cascade.json``.

7. **Knee ratios and CPU budget**. Each ramp step also counts *full* answers
   per second (``full_rps``: from the primary, not degraded); Rampart's *primary-path
   knee* (``primary_knee``) is the step with the most of them at P99 ≤ SLO and ≤ 1%
   errors. ``knee_ratios`` divides it by the raw primary ceiling at its best batch size
   and by every baseline's knee that ran. ``cpu_budget`` is one more step at the
   primary-path knee's client count with the server's CPU per request by process
   (measured) and by stage (py-spy samples, when installed): ``bench.cpu_budget``.
   ``--knee-only`` runs just steps 1, 2 (up to 64 clients), the budget and the baselines'
   ramps, about 5 minutes, and writes ``knee.json``.

8. **Near-free-model ceiling** (``bench.ceiling``): a model that costs almost nothing, imported
   through the "your own model" path, served by Rampart with 1 and 2 API workers and by the
   naive baseline; requests/s and CPU µs per request by process role, for a ~500 KB phone
   JPEG and a 260×260 PNG. ``--ceiling-only`` runs just this and writes ``ceiling.json``.

9. **Ablation** (``bench.ablation``, not part of the full run): one open-loop overload at 5x
   capacity, repeated with one overload mechanism added per arm; ``--ablation-only`` runs it
   and writes ``ablation.json`` and ``ablation.png``.

``--quick`` shrinks every step (the test suite uses it to prove the command works).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench.baselines import triton_pytriton
from bench.ceiling import ceiling_scenario, plot_ceiling
from bench.loadgen import closed_loop, load_bodies, oip_request, open_loop, run_sync, summarize, sweep

ROOT = Path(__file__).resolve().parent.parent
SLO_MS = 1000.0
BIN = Path(sys.executable).parent
#: Optional baselines in a venv of their own (``make bench-peers``), each with its module's ``skip_reason``.
PEERS = {"triton": triton_pytriton.skip_reason}


def private_bentoml_home(directory: Path, store: Path | None = None) -> dict[str, str]:
    """Environment giving one ``bentoml serve`` its own BENTOML_HOME that shares the model store.

    BentoML keeps its Prometheus multiprocess files in ``$BENTOML_HOME/prometheus_multiproc_dir``
    and empties it whenever a server starts, so two servers under one home erase each
    other's metrics. ``directory/models`` links to ``store`` (default: the real store), by its absolute
    path; a link left there to another store is replaced.
    """
    real_home = Path(os.environ.get("BENTOML_HOME", Path.home() / "bentoml"))
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    models = directory / "models"
    target = (store or real_home / "models").resolve()  # a relative target would resolve from the link's folder
    if models.is_symlink() and models.resolve() != target:
        models.unlink()
    if not models.is_symlink():
        models.symlink_to(target, target_is_directory=True)
    return {"BENTOML_HOME": str(directory)}


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group started with ``start_new_session``; SIGKILL it after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Service:
    """One service under test, in its own process group; ``url`` is its classify endpoint."""

    COMMANDS = {
        "rampart": lambda port: [str(BIN / "bentoml"), "serve", "service:Rampart", "--host", "127.0.0.1", "--port", str(port)],
        "plain_bentoml": lambda port: [str(BIN / "bentoml"), "serve", "bench.baselines.plain_bentoml:Plain",
                                       "--host", "127.0.0.1", "--port", str(port)],
        "naive": lambda port: [str(BIN / "uvicorn"), "bench.baselines.naive_fastapi:app", "--host", "127.0.0.1",
                               "--port", str(port), "--log-level", "warning"],
        "triton": triton_pytriton.command,
    }

    def __init__(self, name: str, log_dir: Path, env: dict[str, str] | None = None, label: str | None = None) -> None:
        """Start service ``name`` (see ``COMMANDS``) with extra environment ``env``; its log goes to
        ``log_dir/<label>.log`` (``label`` defaults to ``name``; two instances of one service need two)."""
        self.name = name
        self.port = free_port()
        self.url = triton_pytriton.infer_url(self.port) if name == "triton" else f"http://127.0.0.1:{self.port}/classify"
        self.form_field = "image" if name == "plain_bentoml" else None
        self.oip = name == "triton"  # an Open Inference Protocol /infer URL (bench.loadgen.oip_request)
        label = label or name
        self.log = open(log_dir / f"{label}.log", "wb")
        env = env or {}
        home = {} if "BENTOML_HOME" in env else private_bentoml_home(log_dir / f"{label}-home")
        self.process = subprocess.Popen(self.COMMANDS[name](self.port), cwd=ROOT, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, **home, **env})

    def wait_ready(self, bodies: list[bytes], timeout_s: float = 300) -> None:
        """Ready when BentoML's ``/readyz`` says so (runners warmed up), then one real request is answered 200."""
        deadline = time.monotonic() + timeout_s
        base = self.url.rsplit("/", 1)[0]
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}")
            try:
                if self.name in ("rampart", "plain_bentoml") and httpx.get(f"{base}/readyz", timeout=5).status_code != 200:
                    time.sleep(0.25)
                    continue
                if self.oip:
                    body, headers = oip_request(bodies[0])
                    response = httpx.post(self.url, content=body, headers=headers, timeout=30)
                elif self.form_field:
                    response = httpx.post(self.url, files={self.form_field: ("a.jpg", bodies[0], "image/jpeg")}, timeout=30)
                else:
                    response = httpx.post(self.url, content=bodies[0], timeout=30)
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s")

    def stop(self) -> None:
        stop_process_group(self.process)
        self.log.close()


def raw_ceiling(batch_sizes: list[int], repeats: int) -> dict:
    """Images/s of both engines per batch size, square bucket, in this process."""
    import bentoml

    from bench.baselines.common import load_primary
    from inference.engines import OnnxClassifier

    primary, _, primary_res = load_primary()
    stored = bentoml.models.get("rampart-fallback:latest")
    meta = stored.info.metadata
    fallback = OnnxClassifier(stored.path_of("model.onnx"), meta["mean"], meta["std"])
    out = {}
    for name, engine, res in (("primary", primary, primary_res), ("fallback", fallback, int(meta["resolution"]))):
        out[name] = {}
        for size in batch_sizes:
            batch = np.zeros((size, res, res, 3), dtype=np.uint8)
            engine.predict(batch)  # warm-up for this shape
            start = time.perf_counter()
            for _ in range(repeats):
                engine.predict(batch)
            out[name][size] = round(size * repeats / (time.perf_counter() - start), 1)
    return out


def ramp(service: Service, bodies: list[bytes], clients: list[int], step_s: float) -> dict:
    """Closed-loop steps; the knee is the highest throughput with P99 ≤ SLO and ≤ 1% errors (or 429s)."""
    steps = []
    for n in clients:
        samples = run_sync(closed_loop(service.url, bodies, n, step_s, deadline_ms=SLO_MS,
                                          form_field=service.form_field, oip=service.oip))
        summary = summarize(samples, step_s)
        steps.append({"clients": n, **{k: summary[k] for k in ("throughput_rps", "p50_ms", "p90_ms", "p99_ms",
                                                                "degraded_rate")},
                      "full_rps": round(summary["full"] / step_s, 2),
                      "error_rate": round(1 - summary["ok"] / max(summary["requests"], 1), 4)})
    return {"steps": steps, "knee": knee(steps), "primary_knee": primary_knee(steps)}


def primary_knee(steps: list[dict]) -> dict:
    """The ramp step with the most *full* answers per second (``full_rps``: answers from the primary model,
    not degraded; every answer of a baseline) among those with P99 ≤ SLO and ≤ 1% errors (or 429s): the
    primary-path knee, where degraded answers do not count. When none qualifies, the step with
    the lowest P99."""
    within = [s for s in steps if s["p99_ms"] is not None and s["p99_ms"] <= SLO_MS and s["error_rate"] <= 0.01]
    return max(within, key=lambda s: s["full_rps"]) if within else min(steps, key=lambda s: s["p99_ms"] or 1e9)


def knee_ratios(results: dict) -> dict:
    """Rampart's primary-path knee (``primary_knee`` ``full_rps``, req/s) against the raw primary model ceiling at
    its best batch size (images/s, ``raw_ceiling_ips``) and against every baseline in ``results`` (its knee
    throughput, req/s; each baseline answers from the same model only): ``{"raw_ceiling": …, "<baseline>": …}``,
    each also with the two figures it divides. Baselines are the services ``Service.COMMANDS`` names, other than
    Rampart, that ran."""
    ours = results["rampart"]["ramp"]["primary_knee"]["full_rps"]
    out = {}
    ceiling = results.get("raw_ceiling_ips", {}).get("primary")
    if ceiling:
        best_batch = max(ceiling, key=lambda size: ceiling[size])
        out["raw_ceiling"] = {"ratio": _ratio(ours, ceiling[best_batch]), "rampart_primary_knee_rps": ours,
                              "ceiling_ips": ceiling[best_batch], "best_batch": int(best_batch)}
    for name in Service.COMMANDS:
        if name != "rampart" and name in results and "ramp" in results[name]:
            theirs = results[name]["ramp"]["knee"]["throughput_rps"]
            out[name] = {"ratio": _ratio(ours, theirs), "rampart_primary_knee_rps": ours, "knee_rps": theirs}
    return out


def budget_step(service: Service, bodies: list[bytes], clients: int, step_s: float) -> dict:
    """One more closed-loop step of ``clients`` (normally the primary-path knee's) with the server's per-request
    CPU budget measured during it (``bench.cpu_budget.measure``: by process exactly, by stage from py-spy samples
    when py-spy is installed); also the step's throughput, full answers per second and P99."""
    from bench.cpu_budget import measure

    def step() -> list:
        return run_sync(closed_loop(service.url, bodies, clients, step_s, deadline_ms=SLO_MS))

    captured: list = []
    report = measure(service.process.pid, lambda: captured.extend(step()) or captured, step_s)
    summary = summarize(captured, step_s)
    return {"clients": clients, "step_s": step_s, "throughput_rps": summary["throughput_rps"],
            "full_rps": round(summary["full"] / step_s, 2), "p99_ms": summary["p99_ms"], **report}


def knee(steps: list[dict], max_degraded_rate: float = 1.0) -> dict:
    """The ramp step with the highest throughput whose P99 ≤ SLO, ≤ 1% errors (or 429s) and at most
    ``max_degraded_rate`` degraded answers; when none qualifies, the step with the lowest P99."""
    within = [s for s in steps if s["p99_ms"] is not None and s["p99_ms"] <= SLO_MS and s["error_rate"] <= 0.01
              and s["degraded_rate"] <= max_degraded_rate]
    return max(within, key=lambda s: s["throughput_rps"]) if within else min(steps, key=lambda s: s["p99_ms"] or 1e9)


#: Most degraded answers a ramp step may have to count for the *full knee* of the cascade scenario.
FULL_KNEE_DEGRADED_RATE = 0.01
#: Deadline of the one-at-a-time answers the cascade scenario compares: long enough that nothing degrades.
AGREEMENT_DEADLINE_MS = 10_000


def scenario_bodies(quick: bool) -> list[tuple[str, bytes]]:
    """The calibration's evaluation set (``bench.cascade_eval.evaluation_set``: 322 images, 24 with ``quick``)
    as ``(name, JPEG quality 90 bytes)``, the format of the other benchmark bodies."""
    from PIL import Image

    from bench.cascade_eval import evaluation_set

    out = []
    for image in evaluation_set(quick=quick):
        buffer = io.BytesIO()
        Image.open(io.BytesIO(image.data)).convert("RGB").save(buffer, "JPEG", quality=90)
        out.append((image.name, buffer.getvalue()))
    return out


def answers_one_at_a_time(service: Service, named: list[tuple[str, bytes]]) -> dict[str, dict]:
    """``{name: {"top1", "model", "route", "degraded_reason"}}`` for every body, asked one at a time
    with an ``AGREEMENT_DEADLINE_MS`` deadline (``top1`` None when the answer had no labels or was not 200)."""
    out = {}
    with httpx.Client(timeout=AGREEMENT_DEADLINE_MS / 1000 + 5) as client:
        for name, body in named:
            response = client.post(service.url, content=body, headers={"X-Deadline-Ms": str(AGREEMENT_DEADLINE_MS)})
            answer = response.json() if response.status_code == 200 else {}
            labels = answer.get("labels") or []
            out[name] = {"top1": labels[0]["index"] if labels else None,
                         "model": (answer.get("model") or {}).get("name"), "route": answer.get("route"), "degraded_reason": answer.get("degraded_reason")}
    return out


def cascade_arm(service: Service, named: list[tuple[str, bytes]], clients: list[int], step_s: float) -> dict:
    """One arm of the cascade scenario on a ready Rampart: answers one at a time, the ramp on the same bodies,
    its knee and full knee, and the server's ``/stats`` ``cascade`` section after it all."""
    answers = answers_one_at_a_time(service, named)
    result = ramp(service, [body for _, body in named], clients, step_s)
    result["full_knee"] = knee(result["steps"], FULL_KNEE_DEGRADED_RATE)
    result["answers"] = answers
    result["stats_cascade"] = httpx.get(service.url.rsplit("/", 1)[0] + "/stats", timeout=10).json()["cascade"]
    return result


def cascade_scenario(log_dir: Path, named: list[tuple[str, bytes]], clients: list[int], step_s: float,
                     arms: dict[str, dict] | None = None) -> dict:
    """Cascade against primary-first Rampart on the bodies ``named`` (``scenario_bodies``; module doc, step 6).

    ``arms``: arms already measured (``cascade_arm``), by routing; each missing one gets its
    own Rampart, started and stopped here, one server at a time. Returns both arms, the
    ratios cascade/primary-first of knee and full-knee throughput, and ``agreement``: the
    share of images whose cascade top-1 equals the primary-only top-1 (over the images the
    primary answered, not degraded, and the cascade answered with labels), with the
    cascade's ``fallback_share`` and route counts on those one-at-a-time answers.
    """
    arms = dict(arms or {})
    for routing in ("primary-first", "cascade"):
        if routing in arms:
            continue
        service = Service("rampart", log_dir, env={"RAMPART_ROUTING": routing}, label=f"rampart-{routing}")
        try:
            service.wait_ready([body for _, body in named])
            arms[routing] = cascade_arm(service, named, clients, step_s)
        finally:
            service.stop()
    reference, cascade = arms["primary-first"]["answers"], arms["cascade"]["answers"]
    compared = [name for name, _ in named if reference[name]["model"] == "rampart-primary"
                and reference[name]["degraded_reason"] is None and cascade[name]["top1"] is not None]
    agreed = sum(reference[name]["top1"] == cascade[name]["top1"] for name in compared)
    routes: dict[str, int] = {}
    for name in compared:
        routes[cascade[name]["route"]] = routes.get(cascade[name]["route"], 0) + 1
    return {
        "images": len(named), "compared": len(compared),
        "agreement": round(agreed / len(compared), 4) if compared else None,
        "fallback_share": round(routes.get("cascade_confident", 0) / len(compared), 4) if compared else None,
        "routes_one_at_a_time": routes,
        "knee_ratio": _ratio(arms["cascade"]["knee"]["throughput_rps"], arms["primary-first"]["knee"]["throughput_rps"]),
        "full_knee_ratio": _ratio(arms["cascade"]["full_knee"]["throughput_rps"],
                                  arms["primary-first"]["full_knee"]["throughput_rps"]),
        "arms": arms,
    }


def overload(service: Service, bodies: list[bytes], capacity: float, factors: list[float], duration_s: float) -> dict:
    """Open-loop runs at ``factor`` × ``capacity``; goodput counts answers with a model's labels."""
    runs = {}
    for factor in factors:
        samples = run_sync(open_loop(service.url, bodies, factor * capacity, duration_s, deadline_ms=SLO_MS,
                                        seed=int(factor * 10), form_field=service.form_field, oip=service.oip))
        summary = summarize(samples, duration_s)
        served = [s for s in samples if s.status == 200 and s.model is not None and s.latency_ms <= s.deadline_ms]
        runs[str(factor)] = {"offered_rps": round(factor * capacity, 1), **summary,
                             "goodput_rps": round(len(served) / duration_s, 2)}
        drain(service, bodies)
    return runs


def drain(service: Service, bodies: list[bytes], timeout_s: float = 120) -> None:
    """Wait until the service answers a request within the SLO again (a baseline may still be queueing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = run_sync(closed_loop(service.url, bodies, 1, 0.5, form_field=service.form_field, oip=service.oip))
        if samples and all(s.status == 200 and s.latency_ms <= SLO_MS for s in samples):
            return
        time.sleep(1)


def machine() -> dict:
    import torch

    return {
        "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--quick", action="store_true", help="tiny steps: proves the command, measures little")
    parser.add_argument("--sweep-only", action="store_true", help="only Rampart's closed-loop sweep (closed_loop.json)")
    parser.add_argument("--sweep-client", choices=("aiohttp", "httpx"), default="aiohttp")
    parser.add_argument("--cascade-only", action="store_true",
                        help="only the cascade against primary-first scenario (cascade.json)")
    parser.add_argument("--peers-only", action="store_true",
                        help="only the peer baselines and the naive one as reference (peers.json)")
    parser.add_argument("--ablation-only", action="store_true",
                        help="only the ablation of bench.ablation (ablation.json), all five arms")
    parser.add_argument("--ceiling-only", action="store_true", help="only the near-free-model ceiling (ceiling.json)")
    parser.add_argument("--knee-only", action="store_true",
                        help="only the raw ceiling, the ramps of Rampart (with its CPU budget) and of the baselines, "
                             "and the knee ratios (knee.json; about 5 minutes)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ablation_only:
        from bench import ablation

        return ablation.main(["--out", str(args.out), *(["--quick"] if args.quick else [])])
    sweep_connections, sweep_s = ((1, 4), 2.0) if args.quick else ((1, 4, 16, 64, 256), 10.0)
    if args.sweep_only:
        return closed_loop_sweep(args.out, sweep_connections, sweep_s, args.sweep_client)
    if args.ceiling_only:
        report = {"machine": machine(), "command": "python -m bench.load_bench --ceiling-only"
                  + (" --quick" if args.quick else ""), **ceiling_scenario(args.out, args.quick)}
        (args.out / "ceiling.json").write_text(json.dumps(report, indent=2))
        plot_ceiling(report, args.out / "ceiling.png")
        print(json.dumps(report["runs"], indent=2))
        return 0
    if args.quick:
        batch_sizes, repeats, clients, step_s, factors, overload_s = [1, 4], 1, [1, 8], 2.0, [5.0], 3.0
    else:
        batch_sizes, repeats = [1, 2, 4, 8, 16, 32, 64], 3
        clients, step_s, factors, overload_s = [1, 2, 4, 8, 16, 32, 64, 128, 256], 4.0, [1.0, 2.0, 5.0, 10.0], 8.0
    if args.cascade_only:
        report = {"machine": machine(), "slo_ms": SLO_MS, "command": "python -m bench.load_bench --cascade-only"
                  + (" --quick" if args.quick else ""),
                  **cascade_scenario(args.out, scenario_bodies(args.quick), clients, step_s)}
        (args.out / "cascade.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({k: v for k, v in report.items() if k != "arms"}, indent=2))
        return 0

    if args.knee_only:
        return knee_comparison(args.out, batch_sizes, repeats, [n for n in clients if n <= 64], step_s, args.quick)

    bodies, named = load_bodies(), [] if args.peers_only else scenario_bodies(args.quick)
    primary_first_arm = None
    results: dict = {"machine": machine(), "slo_ms": SLO_MS, "command": "python -m bench.load_bench"
                     + (" --quick" if args.quick else "") + (" --peers-only" if args.peers_only else "")}
    if not args.peers_only:
        results["raw_ceiling_ips"] = raw_ceiling(batch_sizes, repeats)
    for name in ("naive", *PEERS) if args.peers_only else ("rampart", "naive", "plain_bentoml", *PEERS):
        if skipped_peer(name, results):
            continue
        service = Service(name, args.out)
        try:
            service.wait_ready(bodies)
            results[name] = {"ramp": ramp(service, bodies, clients, step_s)}
            if name == "rampart":
                results[name]["cpu_budget"] = budget_step(service, bodies, results[name]["ramp"]["primary_knee"]["clients"],
                                                          max(step_s, 8.0) if not args.quick else step_s)
            capacity = max(results[name]["ramp"]["knee"]["throughput_rps"], 1.0)
            results[name]["overload"] = overload(service, bodies, capacity, factors if name == "rampart" else [5.0],
                                                 overload_s)
            if name == "rampart":
                results[name]["closed_loop_sweep"] = [r.summary() for r in sweep(
                    service.url, bodies, sweep_connections, sweep_s, SLO_MS, args.sweep_client)]
                drain(service, bodies)
                primary_first_arm = cascade_arm(service, named, clients, step_s)  # this Rampart is primary-first
        finally:
            service.stop()
        print(name, json.dumps(results[name]["ramp"]["knee"]), flush=True)
    if args.peers_only:
        return peers_report(results, args.out)

    results["cascade"] = cascade_scenario(args.out, named, clients, step_s, {"primary-first": primary_first_arm})
    print("cascade", json.dumps({k: v for k, v in results["cascade"].items() if k != "arms"}), flush=True)
    results["near_free_ceiling"] = ceiling_scenario(args.out, args.quick)
    plot_ceiling({**results["near_free_ceiling"], "machine": results.get("machine", {})}, args.out / "ceiling.png")
    results["ratios"] = {}
    ours = results["rampart"]
    for name in ("naive", "plain_bentoml", *PEERS):
        theirs = results[name]
        if "skipped" in theirs:
            continue
        results["ratios"][name] = service_ratios(ours, theirs)
    results["knee_ratios"] = knee_ratios(results)
    (args.out / "load.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "load.png")
    print(json.dumps(results["ratios"], indent=2))
    return 0


def skipped_peer(name: str, results: dict) -> bool:
    """True (and ``results[name]`` says why, printed too) when ``name`` is an optional peer baseline
    (``PEERS``) that is not installed; False for every other service."""
    if name in PEERS and (reason := PEERS[name]()):
        results[name] = {"skipped": reason}
        print(name, "skipped:", reason, flush=True)
        return True
    return False


def knee_comparison(out: Path, batch_sizes: list[int], repeats: int, clients: list[int], step_s: float,
                    quick: bool) -> int:
    """``--knee-only``: the raw ceiling, then Rampart's ramp and CPU budget at its primary-path knee, then each
    baseline's ramp, one server at a time; writes ``knee.json`` with ``knee_ratios`` and prints the ratios."""
    bodies = load_bodies()
    results: dict = {"machine": machine(), "slo_ms": SLO_MS,
                     "command": "python -m bench.load_bench --knee-only" + (" --quick" if quick else ""),
                     "raw_ceiling_ips": raw_ceiling(batch_sizes, repeats)}
    for name in Service.COMMANDS:
        if skipped_peer(name, results):
            continue
        service = Service(name, out)
        try:
            service.wait_ready(bodies)
            results[name] = {"ramp": ramp(service, bodies, clients, step_s)}
            if name == "rampart":
                results[name]["cpu_budget"] = budget_step(service, bodies, results[name]["ramp"]["primary_knee"]["clients"],
                                                          step_s if quick else max(step_s, 8.0))
        finally:
            service.stop()
        print(name, json.dumps(results[name]["ramp"]["primary_knee"]), flush=True)
    results["knee_ratios"] = knee_ratios(results)
    (out / "knee.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({"knee_ratios": results["knee_ratios"], "cpu_budget": results["rampart"]["cpu_budget"]}, indent=2))
    return 0


def closed_loop_sweep(out: Path, connections: tuple[int, ...], round_s: float, client: str) -> int:
    """Start Rampart, run ``bench.loadgen.sweep`` against it, write ``closed_loop.json`` and print a table."""
    bodies = load_bodies()
    service = Service("rampart", out)
    try:
        service.wait_ready(bodies)
        rounds = [r.summary() for r in sweep(service.url, bodies, connections, round_s, SLO_MS, client)]
        stats = httpx.get(service.url.rsplit("/", 1)[0] + "/stats", timeout=10).json()
    finally:
        service.stop()
    (out / "closed_loop.json").write_text(json.dumps({"machine": machine(), "client": client, "round_s": round_s,
                                                      "deadline_ms": SLO_MS, "rounds": rounds, "stats_after": stats},
                                                     indent=2))
    print("connections  req/s  goodput/s  p50_ms  p99_ms  p50_waiting_ms  shed  degraded  late_200  5xx  failed"
          "  client_cpu_ms/req")
    for r in rounds:
        print(f"{r['connections']:>11}  {r['throughput_rps']:>5}  {r['goodput_rps']:>9}  {r['p50_ms']:>6}  {r['p99_ms']:>6}"
              f"  {r['p50_waiting_ms']:>14}  {r['shed_rate']:>4}  {r['degraded_rate']:>8}  {r['late_200']:>8}"
              f"  {r['errors_5xx']:>3}  {r['failed']:>6}  {r['client_cpu_ms_per_request']:>17}")
    print("breaker:", stats["primary"]["breaker"], "opened", stats["primary"].get("breaker_opened"))
    return 0


def peers_report(results: dict, out: Path) -> int:
    """``--peers-only``: write ``peers.json`` (``results`` plus, per peer that ran, its ratios to the
    naive baseline of the same run: knee throughput, goodput at 5×, P99 at 5×) and print the ratios."""
    results["ratios_to_naive"] = {name: service_ratios(results[name], results["naive"])
                                  for name in PEERS if "skipped" not in results[name]}
    (out / "peers.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["ratios_to_naive"], indent=2))
    return 0


def service_ratios(ours: dict, theirs: dict) -> dict:
    """Ratios ``ours``/``theirs`` of two services' results (``ramp`` and ``overload`` with a 5× run):
    ``knee_throughput``, ``goodput_at_5x``, ``p99_at_5x`` (P99 of accepted requests); None where undefined."""
    return {
        "knee_throughput": _ratio(ours["ramp"]["knee"]["throughput_rps"], theirs["ramp"]["knee"]["throughput_rps"]),
        "goodput_at_5x": _ratio(ours["overload"]["5.0"]["goodput_rps"], theirs["overload"]["5.0"]["goodput_rps"]),
        "p99_at_5x": _ratio(ours["overload"]["5.0"]["p99_accepted_ms"], theirs["overload"]["5.0"]["p99_accepted_ms"]),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    services = ("rampart", "naive", "plain_bentoml", *(name for name in PEERS if "skipped" not in results[name]))
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ax = axes[0][0]
    for name, curve in results["raw_ceiling_ips"].items():
        sizes = sorted(curve, key=int)
        ax.plot([int(s) for s in sizes], [curve[s] for s in sizes], marker="o", label=name)
    ax.set(xscale="log", xlabel="batch size", ylabel="images/s", title="Raw model ceiling (no serving)")
    ax.legend()
    ax = axes[0][1]
    for name in services:
        steps = results[name]["ramp"]["steps"]
        ax.plot([s["throughput_rps"] for s in steps], [s["p99_ms"] for s in steps], marker="o", label=name)
    ax.axhline(results["slo_ms"], color="grey", linestyle="--", label="SLO")
    ax.set(xlabel="throughput (requests/s)", ylabel="P99 (ms)", yscale="log", title="Closed-loop ramp: P99 vs throughput")
    ax.legend()
    ax = axes[1][0]
    runs = results["rampart"]["overload"]
    factors = sorted(runs, key=float)
    for key, label in (("goodput_rps", "goodput"), ("throughput_rps", "200 answers"),):
        ax.plot([float(f) for f in factors], [runs[f][key] for f in factors], marker="o", label=f"Rampart {label}")
    for name in services[1:]:
        ax.scatter([5.0], [results[name]["overload"]["5.0"]["goodput_rps"]], label=f"{name} goodput", zorder=3)
    ax.set(xlabel="offered load (× knee)", ylabel="requests/s", title="Open-loop overload")
    ax.legend()
    ax = axes[1][1]
    p99 = [results[name]["overload"]["5.0"]["p99_accepted_ms"] or 0 for name in services]
    ax.bar(services, p99)
    ax.axhline(results["slo_ms"], color="grey", linestyle="--")
    ax.set(ylabel="P99 of accepted requests (ms)", title="At 5× each service's knee", yscale="log")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
