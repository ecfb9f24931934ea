"""Decode benchmark: naive full decode vs Rampart's path, per image kind.

``python -m bench.decode_bench [--repeats N] [--out bench_results]`` writes
``decode.json`` and ``decode.png``. For a 7680×4320 JPEG and a 4000×3000 PNG (made
from scikit-image's ``rocket`` photo) it reports, for each path:

- ``median_ms``: median decode-to-tensor time (bytes → uint8 260×346×3 array);
- ``peak_rss_mb``: peak resident memory of a fresh process doing only that.

The naive path is ``Image.open(...).convert("RGB")`` at full size, then the same
resize; Rampart's is the decode worker's ``rampart.inputs.decode_job.prepare`` with the
service's plan (``rampart.pipeline.decode_plan``: the DCT scale or box reduce the bucket
allows, then one resize). Each path runs in its own subprocess so peak RSS is its own.

Under ``"workers"`` it compares the decode pool's two modes (``rampart.inputs.pool``,
one worker per CPU core, the service's own ``rampart.inputs.decode_job.prepare``), per
scenario, as completed uploads per second (``ips``) and wall time (``wall_s``):

- ``photos``: the four sample photos (scikit-image, scikit-learn) as JPEG;
- ``bombs``: every bomb of ``bench/bombs`` (refused from their headers);
- ``photos_behind_slow_bombs``: as many progressive-JPEG bombs as workers, let
  through the scan check (``max_jpeg_scans`` lifted), then the photos, with a
  ``decode_timeout`` of 1 s: ``ips`` counts the photos only. Threads cannot be
  stopped, so the photos wait for the bombs to end; processes are killed at 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import os
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

IMAGES = {"jpeg_7680x4320": ((7680, 4320), "JPEG"), "png_4000x3000": ((4000, 3000), "PNG")}
#: Decode limit per job in the ``photos_behind_slow_bombs`` scenario, seconds.
SLOW_BOMB_TIMEOUT_S = 1.0


def make_image(kind: str, path: Path) -> None:
    from PIL import Image
    from skimage import data

    size, fmt = IMAGES[kind]
    Image.fromarray(data.rocket()).resize(size, Image.Resampling.BICUBIC).save(path, fmt)


def decode_once(path_name: str, data: bytes):
    from PIL import Image

    from rampart.inputs.buckets import buckets_for_resolution, fit_to_bucket
    from rampart.config import Settings
    from rampart.inputs.decode_job import prepare
    from rampart.pipeline import decode_plan

    buckets = buckets_for_resolution(260)
    if path_name == "naive":
        image = Image.open(io.BytesIO(data)).convert("RGB")
        return fit_to_bucket(image, buckets["landscape"], 1.14)
    plan = decode_plan(Settings(), {"primary": buckets, "fallback": buckets_for_resolution(224)})
    return prepare(data, plan).inputs["primary"][1]


def worker(path_name: str, image_path: Path, repeats: int) -> dict:
    data = image_path.read_bytes()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tensor = decode_once(path_name, data)
        times.append((time.perf_counter() - start) * 1000)
    assert tensor.shape == (260, 346, 3)
    return {"median_ms": round(statistics.median(times), 2), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--worker", choices=("naive", "rampart"), help=argparse.SUPPRESS)
    parser.add_argument("--image", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.image, args.repeats)))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for kind in IMAGES:
        image_path = args.out / f"{kind}.{IMAGES[kind][1].lower()}"
        if not image_path.exists():
            make_image(kind, image_path)
        results[kind] = {"bytes": image_path.stat().st_size}
        for path_name in ("naive", "rampart"):
            out = subprocess.run(
                [sys.executable, "-m", "bench.decode_bench", "--worker", path_name, "--image", str(image_path),
                 "--repeats", str(args.repeats)], capture_output=True, text=True, check=True)
            results[kind][path_name] = json.loads(out.stdout)
        naive, ours = results[kind]["naive"], results[kind]["rampart"]
        results[kind]["speedup"] = round(naive["median_ms"] / ours["median_ms"], 2)
        results[kind]["rss_ratio"] = round(naive["peak_rss_mb"] / ours["peak_rss_mb"], 2)
    results["workers"] = {mode: workers_throughput(mode, args.repeats) for mode in ("threads", "processes")}
    (args.out / "decode.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "decode.png")
    print(json.dumps(results, indent=2))
    return 0


def sample_photos() -> list[bytes]:
    """The four sample photos the tests use (scikit-image chelsea, coffee, rocket; scikit-learn china) as JPEG."""
    from PIL import Image
    from skimage import data
    from sklearn.datasets import load_sample_image

    arrays = [data.chelsea(), data.coffee(), data.rocket(), load_sample_image("china.jpg")]
    out = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def workers_throughput(mode: str, repeats: int) -> dict:
    """Uploads per second through a ``mode`` ("threads" or "processes") decode pool, per scenario."""
    from bench.bombs import CHUNK_FORMATS, MULTI_FRAME_FORMATS, many_chunks, many_frames, progressive_jpeg
    from rampart.inputs.buckets import buckets_for_resolution
    from rampart.config import Settings
    from rampart.inputs.decode_job import prepare
    from rampart.pipeline import decode_plan
    from rampart.inputs.pool import BoundedPool, JobTimeout

    settings = Settings()
    buckets = {"primary": buckets_for_resolution(260), "fallback": buckets_for_resolution(224)}
    plan = decode_plan(settings, buckets)
    lifted = dataclasses.replace(plan, limits=dataclasses.replace(plan.limits, max_jpeg_scans=10**9))
    photos = sample_photos() * max(repeats, 2) * 8
    bombs = [progressive_jpeg(7000, 8000), *(many_frames(fmt, 101) for fmt in MULTI_FRAME_FORMATS),
             *(many_chunks(fmt, 200_000) for fmt in CHUNK_FORMATS)] * max(repeats, 1)
    workers = os.cpu_count() or 1
    pool = BoundedPool(workers, 10_000, processes=mode == "processes", preload=("rampart.inputs.decode_job",))

    async def timed(jobs: list[tuple[bytes, object]], counted: int) -> dict:
        async def one(data: bytes, job_plan) -> None:
            try:
                await pool.run(prepare, data, job_plan, run_limit_s=SLOW_BOMB_TIMEOUT_S)
            except (JobTimeout, Exception):
                pass

        start = time.perf_counter()
        await asyncio.gather(*(one(data, job_plan) for data, job_plan in jobs))
        wall_s = time.perf_counter() - start
        return {"ips": round(counted / wall_s, 2), "wall_s": round(wall_s, 3), "uploads": counted}

    async def scenarios() -> dict:
        await timed([(photos[0], plan)] * workers, workers)  # warm-up: imports and first decodes
        slow = [(progressive_jpeg(7000, 1000), lifted)] * workers  # about 4 s each on the 2-core machine
        return {
            "photos": await timed([(data, plan) for data in photos], len(photos)),
            "bombs": await timed([(data, plan) for data in bombs], len(bombs)),
            "photos_behind_slow_bombs": await timed(slow + [(data, plan) for data in photos], len(photos)),
        }

    try:
        return {"workers": workers, **asyncio.run(scenarios()), **({"worker_start_ms": pool.stats()["worker_start_ms"]}
                                                                    if mode == "processes" else {})}
    finally:
        pool.close()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    kinds = [kind for kind in results if kind in IMAGES]
    for ax, metric, title in ((axes[0], "median_ms", "median decode-to-tensor (ms)"), (axes[1], "peak_rss_mb", "peak RSS (MB)")):
        for offset, path_name in ((-0.2, "naive"), (0.2, "rampart")):
            ax.bar([i + offset for i in range(len(kinds))], [results[k][path_name][metric] for k in kinds], 0.4, label=path_name)
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_title(title)
        ax.legend()
    workers = results["workers"]
    scenarios = [key for key in workers["threads"] if isinstance(workers["threads"][key], dict)]
    for offset, mode in ((-0.2, "threads"), (0.2, "processes")):
        axes[2].bar([i + offset for i in range(len(scenarios))], [workers[mode][s]["ips"] for s in scenarios], 0.4,
                    label=mode)
    axes[2].set_xticks(range(len(scenarios)), [s.replace("_", " ") for s in scenarios], fontsize=8)
    axes[2].set_title(f"decode pool, uploads/s ({workers['threads']['workers']} workers)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
