"""``inference.engine_choice`` (with ``inference.engines`` and ``runners.common``): the primary's engine choice, the
warm-up sizes and ONNX Runtime's session settings. Stand-in engines of known speed; real ONNX Runtime sessions on a
tiny model."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from inference.engine_choice import (available_engines, best_size, candidate_sizes, choose_engine, time_engines,
                                     warm_up_sizes)
from inference.engines import OnnxClassifier, session_options
from tests.support import ROOT

SHAPE = (8, 8, 3)


class KnownSpeed:
    """A stand-in engine whose batch of n images takes ``fixed_ms + n × per_image_ms`` (slept), with a
    slowdown past ``knee`` images (a CPU's caches overflowing). ``sizes`` records every batch size run."""

    def __init__(self, fixed_ms: float, per_image_ms: float, knee: int = 1 << 30, past_knee_ms: float = 0.0) -> None:
        self.fixed_ms, self.per_image_ms, self.knee, self.past_knee_ms = fixed_ms, per_image_ms, knee, past_knee_ms
        self.sizes: list[int] = []

    def predict(self, batch: np.ndarray) -> np.ndarray:
        n = len(batch)
        self.sizes.append(n)
        time.sleep((self.fixed_ms + n * self.per_image_ms + max(0, n - self.knee) * self.past_knee_ms) / 1000)
        return np.full((n, 4), 0.25, dtype=np.float32)


def measured(engines: dict[str, KnownSpeed]):
    """A ``measure`` for ``choose_engine`` that really times the stand-ins (and records what it was asked)."""
    asked = []

    def measure(names):
        asked.append(tuple(names))
        # Best of two timed rounds: one sleep overshooting by a few ms under a loaded unit suite failed a
        # verdict once with a single round.
        return time_engines({name: engines[name].predict for name in names}, SHAPE, candidate_sizes(8), runs=2)

    return measure, asked


@pytest.mark.parametrize("faster", ["torch", "onnx"])
def test_auto_on_a_cpu_host_runs_the_engine_faster_per_image(faster):
    slower = "onnx" if faster == "torch" else "torch"
    engines = {faster: KnownSpeed(fixed_ms=16, per_image_ms=2), slower: KnownSpeed(fixed_ms=16, per_image_ms=8)}
    measure, asked = measured(engines)
    choice = choose_engine("auto", ("torch", "onnx"), gpu=False, measure=measure)
    assert asked == [("torch", "onnx")]
    assert choice.engine == faster
    ms = choice.ms_per_image()
    assert ms[faster] < ms[slower]
    # at its compute batch size: the fixed cost is shared, so the largest batch is fastest per image
    assert choice.compute_batch_size() == {"torch": 8, "onnx": 8}
    assert 4 <= ms[faster] < 6 and ms[slower] >= 10  # 16/8 + 2 and 16/8 + 8
    stats = choice.as_stats()
    assert stats["engine"] == faster and stats["mode"] == "auto" and set(stats["ms_per_image"]) == {"torch", "onnx"}
    assert "faster per image" in stats["reason"] and f"{faster} {ms[faster]:.1f} ms/image" in stats["reason"]


def test_each_engine_is_judged_at_its_own_compute_batch_size():
    # torch is best at batch 1 (it slows past one image); onnx at batch 8. Per image at batch 8 torch would
    # lose (47 ms), at batch 1 it wins (12 against 23 ms): the choice compares each at its own fastest size.
    # The times are long enough that a timer's overshoot (3.6 ms measured on a 3 ms sleep in a full suite)
    # cannot flip the verdict.
    engines = {"torch": KnownSpeed(fixed_ms=0, per_image_ms=12, knee=1, past_knee_ms=40),
               "onnx": KnownSpeed(fixed_ms=120, per_image_ms=8)}
    measure, _ = measured(engines)
    choice = choose_engine("auto", ("torch", "onnx"), gpu=False, measure=measure)
    assert choice.compute_batch_size() == {"torch": 1, "onnx": 8}
    assert choice.engine == "torch", choice.as_stats()


@pytest.mark.parametrize("mode", ["torch", "onnx"])
def test_a_forced_engine_is_not_measured(mode):
    measure, asked = measured({"torch": KnownSpeed(0, 1), "onnx": KnownSpeed(0, 1)})
    choice = choose_engine(mode, ("torch", "onnx"), gpu=False, measure=measure)
    assert (choice.engine, asked, choice.timings) == (mode, [], {})
    assert choice.reason == f"RAMPART_PRIMARY_ENGINE={mode}"


def test_auto_on_a_gpu_host_keeps_torch_without_measuring():
    measure, asked = measured({"torch": KnownSpeed(0, 9), "onnx": KnownSpeed(0, 1)})
    choice = choose_engine("auto", ("torch", "onnx"), gpu=True, measure=measure)
    assert (choice.engine, asked) == ("torch", [])
    assert "GPU" in choice.reason
    assert choose_engine("onnx", ("torch", "onnx"), gpu=True, measure=measure).engine == "onnx"  # the CUDA provider


@pytest.mark.parametrize("mode", ["auto", "onnx"])
def test_a_stored_primary_without_an_export_runs_on_torch(mode):
    meta = {"framework": "pytorch", "family": "timm", "arch": "x"}  # what the import wrote before the export
    assert available_engines(meta) == ("torch",)
    measure, asked = measured({"torch": KnownSpeed(0, 9), "onnx": KnownSpeed(0, 1)})
    choice = choose_engine(mode, available_engines(meta), gpu=False, measure=measure)
    assert (choice.engine, asked) == ("torch", [])
    if mode == "onnx":
        assert "no ONNX export" in choice.reason


def test_available_engines_follow_the_metadata():
    assert available_engines({"framework": "onnx"}) == ("onnx",)
    assert available_engines({"framework": "pytorch", "onnx_file": "model.onnx"}) == ("torch", "onnx")
    assert available_engines({"framework": "pytorch", "onnx_file": ""}) == ("torch",)  # the export failed


def test_a_failed_measurement_leaves_the_models_own_engine():
    def broken(names):
        raise RuntimeError("child exited with 1")

    choice = choose_engine("auto", ("torch", "onnx"), gpu=False, measure=broken)
    assert choice.engine == "torch" and "could not be timed" in choice.reason and "child exited" in choice.reason
    with pytest.raises(ValueError, match="engine mode"):
        choose_engine("tensorrt", ("torch",), gpu=False, measure=broken)


def test_timing_is_bounded_and_takes_turns():
    a, b = KnownSpeed(0, 0.1), KnownSpeed(0, 0.1)
    time_engines({"a": a.predict, "b": b.predict}, SHAPE, [1, 2, 4], runs=2)
    assert a.sizes == b.sizes == [1, 2, 4, 1, 2, 4, 1, 2, 4]  # one untimed run, then two timed rounds over the sizes


def test_candidate_and_warm_up_sizes():
    assert candidate_sizes(16) == [1, 2, 4, 8, 16]
    assert candidate_sizes(12) == [1, 2, 4, 8, 12]
    assert warm_up_sizes(1) == [1]
    assert warm_up_sizes(2) == [1, 2]
    assert warm_up_sizes(4) == [1, 2, 4]
    assert warm_up_sizes(6) == [1, 2, 4, 6]
    assert best_size({1: 9.0, 2: 5.0, 4: 6.0}) == 2
    assert best_size({1: 9.0, 2: 5.4, 4: 5.0}) == 2  # within 10% per image: the smaller size
    assert best_size({1: 9.0, 2: 5.6, 4: 5.0}) == 4


def test_warm_up_runs_no_batch_larger_than_the_compute_size():
    """A runner computes in chunks of its fastest size, so after timing the candidates (square bucket only)
    it warms every bucket at the sizes up to that one, and never a larger one."""
    from rampart.inputs.buckets import buckets_for_resolution
    from runners.common import BucketedRunner

    runner = BucketedRunner()
    runner.buckets = buckets_for_resolution(16)
    runner.max_batch_size = 16
    runner.engine = KnownSpeed(fixed_ms=4, per_image_ms=1, knee=4, past_knee_ms=5)  # fastest at 4: 2 ms/image
    runner.engine.shapes = []
    predict = runner.engine.predict
    runner.engine.predict = lambda batch: (runner.engine.shapes.append(batch.shape), predict(batch))[1]
    runner.warm_up()
    assert runner.compute_batch_size == 4 and runner.warmed_sizes == [1, 2, 4]
    timing, warming = runner.engine.shapes[:15], runner.engine.shapes[15:]  # 5 sizes x 3 runs on the square bucket
    assert {s[1:3] for s in timing} == {(16, 16)} and sorted({s[0] for s in timing}) == [1, 2, 4, 8, 16]
    assert sorted(warming) == sorted((n, *b.shape) for b in runner.buckets.values() for n in (1, 2, 4))
    assert runner.warmup_ms_per_image == pytest.approx(2.0, abs=1.0)


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory) -> str:
    import torch

    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                 torch.nn.Linear(8, 5)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, torch.zeros(1, 3, 16, 16), str(path), opset_version=17, dynamo=False,
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch", 2: "h", 3: "w"}})
    return str(path)


def test_onnx_session_settings():
    options = session_options(ort)
    assert not options.enable_cpu_mem_arena and options.enable_mem_pattern
    assert options.log_severity_level == 3
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.get_session_config_entry("session.inter_op.allow_spinning") == "0"


def test_onnx_engine_runs_with_the_settings(tiny_onnx):
    engine = OnnxClassifier(tiny_onnx, 127.0, 128.0, threads=1)
    applied = engine.session.get_session_options()
    assert not applied.enable_cpu_mem_arena and applied.enable_mem_pattern and applied.intra_op_num_threads == 1
    assert applied.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    batch = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    first = engine.predict(batch)
    engine.predict(batch[:1])  # another shape between: the memory pattern plans per shape
    np.testing.assert_allclose(engine.predict(batch), first, rtol=1e-6)
    assert first.shape == (3, 5) and np.allclose(first.sum(axis=1), 1.0, atol=1e-5)


def test_an_onnx_only_process_never_imports_torch(tiny_onnx):
    """The fallback runner's engine path (load, GPU check, thread rule, timing) without torch in the process."""
    code = f"""
import sys
from types import SimpleNamespace
import runners.common as common
from inference.engine_choice import time_batch_sizes
from inference.engines import cuda_present
from inference.stored import load_engine
model = SimpleNamespace(info=SimpleNamespace(metadata={{"framework": "onnx", "mean": 127.0, "std": 128.0}}),
                        path_of=lambda name: {tiny_onnx!r}, tag="tiny")
engine = load_engine(model, 0.9, 1)
time_batch_sizes(engine.predict, (16, 16, 3), [1, 2])
cuda_present()
common.engine_cpu_threads(common.runner_spec(common.get_settings(), "fallback"))
print(sorted(name for name in sys.modules if name == "torch" or name.startswith(("torch.", "timm", "torchvision"))))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_primary_stored_without_an_export_runs_on_torch_and_says_so(caplog):
    """What the runner does with a store made by the import before the ONNX export existed."""
    from types import SimpleNamespace

    from rampart.config import Settings
    from runners.common import pick_engine, runner_spec

    settings = Settings(primary_engine="auto")
    model = SimpleNamespace(tag="rampart-primary:old", path="/nowhere",
                            info=SimpleNamespace(metadata={"framework": "pytorch", "family": "timm", "arch": "x"}))
    with caplog.at_level(logging.INFO, logger="rampart.engines"):
        choice = pick_engine(runner_spec(settings, "primary"), model, settings, 1, SHAPE)
    assert choice.engine == "torch" and choice.timings == {}
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_) == 1 and "rampart-primary:old has no ONNX export" in warnings_[0]
    assert "models.import_models" in warnings_[0]
    assert any("primary runner: engine torch" in r.getMessage() for r in caplog.records)


def test_the_export_check_fails_on_a_gap_or_another_top1():
    """``check_export`` on the real sample photos with stand-in engines: within 1e-4 and the same top-1 passes."""
    from models.import_models import EXPORT_MAX_ABS_DIFF, check_export

    def reference(batch):
        probs = np.full((len(batch), 10), 0.05, dtype=np.float32)
        probs[:, 3] = 0.55
        return probs

    def shifted(gap, to=3):
        def predict(batch):
            probs = reference(batch)
            probs[:, 4] += gap
            probs[:, to] += 0.0 if to == 3 else 0.6
            return probs
        return predict

    assert check_export("m", reference, shifted(0.5 * EXPORT_MAX_ABS_DIFF), 32) <= EXPORT_MAX_ABS_DIFF
    with pytest.raises(SystemExit, match=r"disagrees with PyTorch on chelsea \(square\).*2\.00e-04"):
        check_export("m", reference, shifted(2 * EXPORT_MAX_ABS_DIFF), 32)
    with pytest.raises(SystemExit, match="top-1 7 against 3"):
        check_export("m", reference, shifted(0.0, to=7), 32, max_abs_diff=1.0)


def test_the_timing_child_measures_a_stored_onnx_model(tiny_onnx, tmp_path):
    """``measure_in_child`` end to end, on the tiny model laid out as a store entry (``model.onnx``)."""
    import shutil

    from inference.engine_choice import measure_in_child

    shutil.copyfile(tiny_onnx, tmp_path / "model.onnx")
    timings = measure_in_child(str(tmp_path), {"framework": "onnx", "mean": 127.0, "std": 128.0}, ("onnx",), 1,
                               (16, 16, 3), [1, 2, 4], runs=2)
    assert set(timings) == {"onnx"} and set(timings["onnx"]) == {1, 2, 4}
    assert all(ms > 0 for ms in timings["onnx"].values())
    with pytest.raises(RuntimeError):
        measure_in_child(str(tmp_path / "missing"), {"framework": "onnx", "mean": 127.0, "std": 128.0}, ("onnx",), 1,
                         (16, 16, 3), [1], runs=1)


def test_engine_bench_reads_a_process_tree_and_plots(tmp_path):
    import json
    import os

    from bench.engine_bench import plot
    from bench.process_cpu import tree_memory

    memory = tree_memory(os.getpid())  # this test process: the root of its own tree
    assert memory["rss_mb"]["supervisor"] > 0 and memory["rss_mb"]["total"] >= memory["rss_mb"]["supervisor"]
    results = json.loads((ROOT / "docs" / "bench" / "engines.json").read_text())
    plot(results, tmp_path / "engines.png")
    assert (tmp_path / "engines.png").stat().st_size > 10_000
