"""Decode benchmark: naive full decode vs Rampart's path, per image kind.

``python -m bench.decode_bench [--repeats N] [--out bench_results]`` writes
``decode.json`` and ``decode.png``. For a 7680×4320 JPEG and a 4000×3000 PNG (made
from scikit-image's ``rocket`` photo) it reports, for each path:

- ``median_ms``: median decode-to-tensor time (bytes → uint8 260×346×3 array);
- ``peak_rss_mb``: peak resident memory of a fresh process doing only that.

The naive path is ``Image.open(...).convert("RGB")`` at full size, then the same
resize; Rampart's is ``rampart.decoding.decode_image`` (draft for JPEG) then
``fit_to_bucket``. Each path runs in its own subprocess so peak RSS is its own.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

IMAGES = {"jpeg_7680x4320": ((7680, 4320), "JPEG"), "png_4000x3000": ((4000, 3000), "PNG")}


def make_image(kind: str, path: Path) -> None:
    from PIL import Image
    from skimage import data

    size, fmt = IMAGES[kind]
    Image.fromarray(data.rocket()).resize(size, Image.Resampling.BICUBIC).save(path, fmt)


def decode_once(path_name: str, data: bytes):
    from PIL import Image

    from rampart.buckets import buckets_for_resolution, fit_to_bucket
    from rampart.config import Settings
    from rampart.pipeline import decode_limits

    buckets = buckets_for_resolution(260)
    bucket = buckets["landscape"]
    if path_name == "naive":
        image = Image.open(io.BytesIO(data)).convert("RGB")
        return fit_to_bucket(image, bucket, 1.14)
    from rampart.decoding import decode_image

    limits = decode_limits(Settings(), [*buckets.values(), *buckets_for_resolution(224).values()])
    return fit_to_bucket(decode_image(data, limits).image, bucket, 1.14)


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
    (args.out / "decode.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "decode.png")
    print(json.dumps(results, indent=2))
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    kinds = list(results)
    for ax, metric, title in ((axes[0], "median_ms", "median decode-to-tensor (ms)"), (axes[1], "peak_rss_mb", "peak RSS (MB)")):
        for offset, path_name in ((-0.2, "naive"), (0.2, "rampart")):
            ax.bar([i + offset for i in range(len(kinds))], [results[k][path_name][metric] for k in kinds], 0.4, label=path_name)
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
