"""The benchmark commands run end to end and write their JSON and PNG (small settings)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_decode_bench_writes_json_and_plot_and_draft_beats_naive(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.decode_bench", "--repeats", "2", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    results = json.loads((tmp_path / "decode.json").read_text())
    assert (tmp_path / "decode.png").stat().st_size > 0
    assert set(results) == {"jpeg_7680x4320", "png_4000x3000"}
    jpeg = results["jpeg_7680x4320"]
    assert jpeg["speedup"] > 1.0 and jpeg["rss_ratio"] > 1.2, jpeg  # same-run ratios: draft decoding pays
