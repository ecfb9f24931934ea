"""The raw model ceiling: ``python -m bench.raw_ceiling [--out bench_results] [--quick]`` writes ``raw_ceiling.json``.

Primary (PyTorch) and fallback (ONNX Runtime) images/s at batch sizes 1..64 (``bench.harness.Sizes``),
square bucket, in this process, no serving: the machine's physical limit. Also step 1 of
``python -m bench.load_bench``.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from bench.harness import Sizes, machine, scenario_parser

__all__ = ["raw_ceiling", "main"]


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


def main(argv: list[str] | None = None) -> int:
    """Measure both engines' raw ceiling; writes ``raw_ceiling.json``."""
    args = scenario_parser("python -m bench.raw_ceiling", __doc__,
                           quick_help="two batch sizes, one repeat: proves the command").parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = Sizes.of(args.quick)
    report = {"machine": machine(), "command": "python -m bench.raw_ceiling" + (" --quick" if args.quick else ""),
              "raw_ceiling_ips": raw_ceiling(sizes.batch_sizes, sizes.repeats)}
    (args.out / "raw_ceiling.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["raw_ceiling_ips"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
