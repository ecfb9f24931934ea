"""The decode hand-off's own CPU: what a job costs the API worker and the decode worker beyond its work.

``python -m bench.handoff_bench [--trees A,B] [--rounds 4] [--jobs 3000] [--callers 16] [--out bench_results]``
runs, for each source tree in ``--trees`` (checkouts of this repository; default: this one), a fresh
Python process that imports ``rampart`` from that tree, starts a ``rampart.inputs.pool.BoundedPool`` of 2
worker processes as the service does (``processes=True``), and sends it ``--jobs`` jobs from ``--callers``
concurrent asyncio callers, each with a budget and a run limit as the pipeline gives them. The job stands
in for a decode of the ceiling benchmark's 260×260 PNG: 124,646 bytes in (an upload, sent as a raw frame),
a 260×260×3 uint8 array out (202,800 bytes), through ``numpy.resize``, which costs the worker a few µs.

Reported per tree and round, in µs of CPU per job: ``caller_us`` (the calling process: its event loop and
the pool's threads, ``RUSAGE_SELF``) and ``workers_us`` (the two worker processes, psutil), and jobs per
second. Trees take turns within each round, and the first tree of a round alternates (A, B, then B, A),
so a drifting host falls on both; ``paired`` gives each tree's per-job CPU over the first tree's in the
same round (median, least, greatest). Writes ``handoff.json`` and ``handoff.png``.

The API worker's share of a request's CPU in the served benchmark (``bench.ceiling``) includes this
``caller_us``; the decode pool's includes ``workers_us`` beside the decode itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

__all__ = ["CHILD", "measure_tree", "main"]

UPLOAD_BYTES = 124_646
PIXELS_SHAPE = (260, 260, 3)

#: What each measuring process runs (``sys.argv``: tree, jobs, callers); prints one JSON line.
CHILD = r"""
import asyncio, functools, json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, psutil
from rampart.inputs.pool import BoundedPool

JOBS, CALLERS = int(sys.argv[2]), int(sys.argv[3])
UPLOAD = np.frombuffer(os.urandom(%(upload)d), np.uint8)
JOB = functools.partial(np.resize, new_shape=%(shape)r)

def cpu_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

async def main():
    pool = BoundedPool(2, 10_000, processes=True)
    workers = [psutil.Process(slot.process.process.pid) for slot in pool._slots]
    gate = asyncio.Semaphore(CALLERS)

    async def one():
        async with gate:
            pixels = await pool.run(JOB, UPLOAD, budget_s=10.0, run_limit_s=10.0)
            assert pixels.shape == %(shape)r

    await asyncio.gather(*(one() for _ in range(300)))  # warm: both workers started and used
    workers_before = sum(sum(w.cpu_times()[:2]) for w in workers)
    caller_before, started = cpu_s(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(JOBS)))
    caller_after, ended = cpu_s(), time.perf_counter()
    workers_after = sum(sum(w.cpu_times()[:2]) for w in workers)
    pool.close()
    print(json.dumps({"caller_us": round((caller_after - caller_before) * 1e6 / JOBS, 1),
                      "workers_us": round((workers_after - workers_before) * 1e6 / JOBS, 1),
                      "jobs_per_s": round(JOBS / (ended - started), 1)}))

asyncio.run(main())
""" % {"upload": UPLOAD_BYTES, "shape": PIXELS_SHAPE}


def measure_tree(tree: Path, jobs: int, callers: int) -> dict:
    """One measuring process for ``tree``: ``{"caller_us", "workers_us", "jobs_per_s"}`` (module doc)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(jobs), str(callers)], capture_output=True,
                         text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def paired(runs: list[dict], trees: list[str], key: str) -> dict[str, dict[str, float]]:
    """Per later tree: its ``key`` over the first tree's in the same round (median, least, greatest)."""
    out = {}
    for tree in trees[1:]:
        ratios = []
        for index in {run["round"] for run in runs}:
            mine = [run[key] for run in runs if run["round"] == index and run["tree"] == tree]
            first = [run[key] for run in runs if run["round"] == index and run["tree"] == trees[0]]
            if mine and first and first[0] > 0:
                ratios.append(mine[0] / first[0])
        if ratios:
            out[tree] = {"median": round(statistics.median(ratios), 3), "least": round(min(ratios), 3),
                         "greatest": round(max(ratios), 3)}
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = report["trees"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, key in ((-0.2, "caller_us"), (0.2, "workers_us")):
        ax.bar([i + offset for i in range(len(trees))], [report["summary"][t][key] for t in trees], 0.4, label=key)
    ax.set_xticks(range(len(trees)), [Path(t).name or t for t in trees])
    ax.set_ylabel("µs of CPU per job (median of rounds)")
    ax.set_title("decode hand-off: CPU per job beyond the work")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default=str(Path(__file__).resolve().parents[1]),
                        help="comma-separated checkouts of this repository (default: this one)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args(argv)
    trees = [str(Path(tree).resolve()) for tree in args.trees.split(",")]
    runs = []
    for index in range(args.rounds):
        for tree in (trees if index % 2 == 0 else trees[::-1]):
            run = {"tree": tree, "round": index, **measure_tree(Path(tree), args.jobs, args.callers)}
            runs.append(run)
            print(json.dumps(run), flush=True)
    summary = {tree: {key: round(statistics.median(run[key] for run in runs if run["tree"] == tree), 1)
                      for key in ("caller_us", "workers_us", "jobs_per_s")} for tree in trees}
    report = {"trees": trees, "rounds": args.rounds, "jobs": args.jobs, "callers": args.callers,
              "upload_bytes": UPLOAD_BYTES, "pixels_shape": PIXELS_SHAPE, "runs": runs, "summary": summary,
              "paired": {key: paired(runs, trees, key) for key in ("caller_us", "workers_us")}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "handoff.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "handoff.png")
    print(json.dumps({"summary": summary, "paired": report["paired"]}, indent=2))
    return report


if __name__ == "__main__":
    main()
