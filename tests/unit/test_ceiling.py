"""``bench.ceiling`` (and ``bench.process_cpu``), the near-free-model ceiling's parts, in process: its model, its
bodies, and how server processes are told apart and their CPU counted. The scenario itself runs in
tests/server/test_bench.py (``load_bench --quick``)."""

from __future__ import annotations

import io
import subprocess
import time

import numpy as np
import psutil
from PIL import Image

from bench.ceiling import PHONE_JPEG_TARGET_BYTES, grouped, near_free_onnx, phone_jpeg, small_png
from bench.process_cpu import ServerCpu, process_role
from inference.engines import OnnxClassifier


def test_near_free_model_takes_any_batch_and_shape_and_gives_1000_probabilities(tmp_path):
    engine = OnnxClassifier(str(near_free_onnx(tmp_path / "m.onnx")), 127.0, 128.0)
    rng = np.random.default_rng(0)
    for shape in ((1, 260, 260, 3), (4, 260, 346, 3), (2, 346, 260, 3)):
        probs = engine.predict(rng.integers(0, 256, shape, dtype=np.uint8))
        assert probs.shape == (shape[0], 1000) and np.allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    # Not a constant: the answer follows the image's mean colour.
    dark, bright = engine.predict(np.stack([np.zeros((260, 260, 3), np.uint8), np.full((260, 260, 3), 255, np.uint8)]))
    assert not np.allclose(dark, bright)


def test_phone_jpeg_lands_near_500_kb_and_the_png_is_260_square():
    body, info = phone_jpeg()
    assert abs(len(body) - PHONE_JPEG_TARGET_BYTES) < 0.1 * PHONE_JPEG_TARGET_BYTES, info
    assert Image.open(io.BytesIO(body)).size == (1600, 1200) and body == phone_jpeg()[0]  # deterministic
    png, _ = small_png()
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.size == (260, 260)


def test_roles_of_a_server_tree_and_the_cpu_they_spend():
    """A stand-in tree shaped like ``bentoml serve``'s, under a root of its own (not this test's process,
    whose other children would count): an entry worker with a child (its decode pool) and a runner;
    the entry worker burns CPU, and only its role is charged for it."""
    # The flag comes in as "$1", so the root's own command line names no service.
    root = subprocess.Popen(["bash", "-c", "bash -c 'sleep 30 & while :; do :; done' \"$1\" rampart &"
                             " bash -c 'sleep 30; :' \"$1\" rampart_primary & wait", "root", "--service-name"])
    try:
        time.sleep(0.3)
        root_process = psutil.Process(root.pid)
        workers = {process_role(child, set()): child for child in root_process.children()}
        entry_process, runner_process = workers["api"], workers["primary"]
        (pool_child,) = entry_process.children()
        assert process_role(pool_child, {entry_process.pid}) == "decode"
        assert process_role(root_process, set()) == "supervisor"

        meter = ServerCpu(root.pid, "supervisor")
        meter.start()
        time.sleep(0.6)
        by_role = meter.stop()
        assert by_role["api"]["cpu_s"] > 0.1 and by_role["primary"]["processes"] == 1, by_role
        roles = grouped(by_role)  # the ceiling scenario's groups
        assert roles["api"]["processes"] == 1 and roles["runners"]["processes"] == 1, roles
        assert roles["decode_pool"]["processes"] == 1, roles
        assert roles["api"]["cpu_s"] > 0.1 and roles["runners"]["cpu_s"] < 0.05, roles
        assert runner_process.is_running()
    finally:
        for child in psutil.Process(root.pid).children(recursive=True):
            child.kill()
        root.kill()
        root.wait()


def test_the_naive_servers_served_decode_is_the_cpu_per_image_between_two_of_its_stats():
    from bench.ceiling import served_decode_us

    before, after = {"decode_cpu_s": 1.0, "decodes": 100}, {"decode_cpu_s": 1.5, "decodes": 300}
    assert served_decode_us(before, after) == 2500.0
    assert served_decode_us(before, before) is None and served_decode_us(None, after) is None


def test_decodes_are_measured_in_alternating_rounds_whose_ratio_holds():
    from bench.ceiling import _alternated_cpu_us

    order = []

    def spin(name, count):
        def run():
            order.append(name)
            total = 0
            for i in range(count):
                total += i
        return run

    rounds = _alternated_cpu_us({"one": spin("one", 20_000), "two": spin("two", 40_000)}, repeats=20)
    assert len(rounds["one"]) == len(rounds["two"]) == 4
    assert order[:12] == ["one"] * 6 + ["two"] * 6  # a warm-up and 5 calls each, then the other's turn
    ratios = sorted(two / one for one, two in zip(rounds["one"], rounds["two"]))
    assert 1.4 < ratios[len(ratios) // 2] < 2.8, ratios


def test_ab_pairs_each_arm_with_the_first_in_the_same_round():
    """A host that slows down from round to round: each arm's medians drift with it, its paired ratios do not."""
    from bench.ab import paired_ratios
    from bench.ceiling import ROLES

    def run(arm: str, index: int, api: float) -> dict:
        cpu = {role: 100.0 * (1 + index) for role in ROLES}
        cpu.update(api=api, supervisor=0.0)
        return {"arm": arm, "round": index, "cpu_us_per_request": {**cpu, "total": sum(cpu.values())}}

    drift = [1.0, 1.3, 1.6]
    runs = [run(arm, i, 2000.0 * d * (0.9 if arm == "b" else 1.0)) for i, d in enumerate(drift) for arm in "ab"]
    runs.append(run("a", 3, 5000.0))  # a round the other arm never ran: skipped
    paired = paired_ratios(runs, ["a", "b"])
    assert set(paired) == {"b"}
    assert paired["b"]["api"] == {"ratios": [0.9, 0.9, 0.9], "median": 0.9, "min": 0.9, "max": 0.9}
    assert paired["b"]["decode_pool"]["median"] == 1.0
    assert "supervisor" not in paired["b"]  # nothing spent by the first arm: no ratio
