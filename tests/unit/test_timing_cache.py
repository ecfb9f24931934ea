"""The runners' batch-size timing cache (``inference.timing_cache``): read back under the same key only."""

from __future__ import annotations

import dataclasses
import json

from inference.timing_cache import OFF, TimingCache, TimingKey


def key(**changes) -> TimingKey:
    base = TimingKey("rampart-primary:v1", ("torch", "onnx"), 1, (260, 260, 3), (1, 2, 4), 3, 2, None)
    return dataclasses.replace(base, **changes)


def test_a_timing_is_measured_once_then_read_back_with_int_sizes(tmp_path):
    cache, calls = TimingCache(tmp_path), []

    def measure():
        calls.append(1)
        return {"torch": {1: 30.0, 2: 25.5}, "onnx": {1: 20.0, 2: 18.0}}

    assert cache.timings(key(), measure) == {"torch": {1: 30.0, 2: 25.5}, "onnx": {1: 20.0, 2: 18.0}}
    assert cache.source == "measured" and calls == [1]
    calls.clear()
    again = TimingCache(tmp_path)
    assert again.timings(key(), measure) == {"torch": {1: 30.0, 2: 25.5}, "onnx": {1: 20.0, 2: 18.0}}
    assert again.source == "cache" and calls == []
    assert again.files == [again.path(key())] == cache.files


def test_any_change_of_what_the_timing_depends_on_measures_again(tmp_path):
    cache = TimingCache(tmp_path)
    cache.timings(key(), lambda: {"torch": {1: 1.0}})
    for change in ({"model": "rampart-primary:v2"}, {"engines": ("onnx",)}, {"threads": 2}, {"shape": (224, 224, 3)},
                   {"sizes": (1, 2)}, {"runs": 2}, {"cores": 4}, {"cpu_quota": 1.5}, {"cpu": "another CPU"},
                   {"gpus": ("NVIDIA H200",)}, {"libraries": (("torch", "9.9"),)}, {"python": "3.99.0"}):
        assert cache.timings(key(**change), lambda: {"torch": {1: 2.0}}) == {"torch": {1: 2.0}}, change
        assert cache.source == "measured", change
    assert len(list(tmp_path.glob("*.json"))) == 13


def test_an_unreadable_or_foreign_file_is_measured_again_and_rewritten(tmp_path):
    cache = TimingCache(tmp_path)
    path = cache.path(key())
    path.write_text("{not json")
    assert cache.timings(key(), lambda: {"onnx": {1: 3.0}}) == {"onnx": {1: 3.0}} and cache.source == "measured"
    assert json.loads(path.read_text())["timings"] == {"onnx": {"1": 3.0}}
    stored = json.loads(path.read_text())
    stored["key"]["threads"] = 99  # a file under this name holding another key
    path.write_text(json.dumps(stored))
    assert cache.timings(key(), lambda: {"onnx": {1: 4.0}}) == {"onnx": {1: 4.0}} and cache.source == "measured"
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_setting_names_the_directory_or_turns_the_cache_off(tmp_path):
    assert TimingCache.from_setting(OFF).path(key()) is None
    assert TimingCache.from_setting("OFF").directory is None
    assert TimingCache.from_setting(str(tmp_path / "t")).directory == tmp_path / "t"
    assert TimingCache.from_setting("", bentoml_home=str(tmp_path)).directory == tmp_path / "rampart-timings"
    calls = []
    off = TimingCache(None)
    for _ in range(2):
        off.timings(key(), lambda: calls.append(1) or {"torch": {1: 1.0}})
    assert calls == [1, 1] and off.source == "measured" and off.files == []


def test_an_unwritable_directory_still_answers_the_measurement(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = TimingCache(blocker / "below")  # a directory under a file cannot be made
    assert cache.timings(key(), lambda: {"torch": {1: 1.0}}) == {"torch": {1: 1.0}}
