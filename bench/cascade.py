"""Cascade against primary-first: ``python -m bench.cascade [--out bench_results] [--quick]`` writes
``cascade.json`` (also ``python -m bench.load_bench --cascade-only``).

On the calibration's evaluation set (``bench.cascade_eval.evaluation_set``, each image re-encoded
as JPEG quality 90 like the other bodies): a Rampart with ``RAMPART_ROUTING=cascade`` (default
threshold) gets the same ramp (``bench.ramp``) as primary-first Rampart on the same bodies.
Reported per arm: the knee, the *full knee* (the knee rule plus at most 1% degraded answers:
the highest throughput at full quality), their P99, and the answers' routes; and the cascade's
top-1 agreement with the primary-only answers on every image (both servers asked one image
at a time with a 10 s deadline, so nothing is degraded). Also step 6 of ``python -m bench.load_bench``,
which measures the primary-first arm on its own Rampart.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import httpx

from bench.harness import SLO_MS, Service, Sizes, machine, ratio, run_scenario
from bench.ramp import FULL_KNEE_DEGRADED_RATE, knee, ramp

__all__ = ["AGREEMENT_DEADLINE_MS", "scenario_bodies", "answers_one_at_a_time", "cascade_arm", "cascade_scenario",
           "run", "main"]

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
                     arms: dict[str, dict] | None = None, started: dict[str, Service] | None = None) -> dict:
    """Cascade against primary-first Rampart on the bodies ``named`` (``scenario_bodies``; module doc).

    ``arms``: arms already measured (``cascade_arm``), by routing; each missing one gets its
    own Rampart, started and stopped here, one server at a time, unless ``started`` holds one already launched
    with that routing (``Service("rampart", …, env={"RAMPART_ROUTING": routing})``), which is used and stopped. Returns both arms, the
    ratios cascade/primary-first of knee and full-knee throughput, and ``agreement``: the
    share of images whose cascade top-1 equals the primary-only top-1 (over the images the
    primary answered, not degraded, and the cascade answered with labels), with the
    cascade's ``fallback_share`` and route counts on those one-at-a-time answers.
    """
    arms = dict(arms or {})
    for routing in ("primary-first", "cascade"):
        if routing in arms:
            continue
        service = (started or {}).pop(routing, None) or Service("rampart", log_dir, env={"RAMPART_ROUTING": routing},
                                                                label=f"rampart-{routing}")
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
        "knee_ratio": ratio(arms["cascade"]["knee"]["throughput_rps"], arms["primary-first"]["knee"]["throughput_rps"]),
        "full_knee_ratio": ratio(arms["cascade"]["full_knee"]["throughput_rps"],
                                 arms["primary-first"]["full_knee"]["throughput_rps"]),
        "arms": arms,
    }


def run(out: Path, quick: bool, command: str) -> int:
    """Both arms, each on its own Rampart (``bench.harness.Sizes`` ramp); writes ``cascade.json`` with
    ``command`` recorded, and prints everything but the arms."""
    sizes = Sizes.of(quick)
    report = {"machine": machine(), "slo_ms": SLO_MS, "command": command,
              **cascade_scenario(out, scenario_bodies(quick), sizes.clients, sizes.step_s)}
    (out / "cascade.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "arms"}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.cascade [--out DIR] [--quick]``: ``run`` with this command recorded."""
    return run_scenario("python -m bench.cascade", __doc__, run, argv, quick_help="24 images, tiny steps: proves the command")


if __name__ == "__main__":
    sys.exit(main())
