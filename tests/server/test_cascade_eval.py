"""``python -m bench.cascade_eval``: the cascade's threshold calibration, run for real.

The command's ``main`` runs in this process (its models are loaded once, from the
BentoML store, and shared by the runs) over real photos (``--quick``: 24 images)
and a labelled folder. The tests check each report against its definition,
recomputed from the per-image records it contains.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.cascade_eval import folder_set, main
from tests.support import encode, photo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cascade(records: list[dict], kind: str, threshold: float) -> np.ndarray:
    """Each image's cascade answer at ``threshold``, from the report's records."""
    return np.array([r["fallback_top1"] if r[kind] >= threshold else r["primary_top1"] for r in records])


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("cascade_eval") / "eval.json"
    returned = main(["--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    return report, out.with_suffix(".png")


def test_quick_report_has_every_field_and_a_png(quick):
    report, png = quick
    for field in ("measures", "models", "images", "refused", "target_agreement", "thresholds",
                  "fallback_alone_agreement", "kinds", "recommendation", "records"):
        assert field in report, field
    assert "not imagenet accuracy" in report["measures"].lower()
    assert report["images"] == 24 and report["refused"] == [] and len(report["records"]) == 24
    assert set(report["kinds"]) == {"msp", "margin"}
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("kind", ["msp", "margin"])
def test_agreement_curve_follows_its_definition(quick, kind):
    report, _ = quick
    records, thresholds, data = report["records"], report["thresholds"], report["kinds"][kind]
    primary = np.array([r["primary_top1"] for r in records])
    confidence = np.array([r[kind] for r in records])
    # Threshold 0: the small model answers everything, so agreement is the fallback's alone.
    assert thresholds[0] == 0.0 and data["small_share"][0] == 1.0
    assert data["agreement"][0] == pytest.approx(report["fallback_alone_agreement"])
    assert report["fallback_alone_agreement"] == pytest.approx(
        np.mean([r["fallback_top1"] == r["primary_top1"] for r in records]))
    # Above every confidence, the primary answers everything.
    assert cascade(records, kind, confidence.max() + 1e-6).tolist() == primary.tolist()
    for t, agreement, share in zip(thresholds, data["agreement"], data["small_share"]):
        assert agreement == pytest.approx(np.mean(cascade(records, kind, t) == primary), abs=1e-6)
        assert share == pytest.approx(np.mean(confidence >= t), abs=1e-6)
        if t > confidence.max():
            assert (agreement, share) == (1.0, 0.0)
    # Raising the threshold only hands images from the small model to the primary.
    assert all(b >= a for a, b in zip(data["agreement"], data["agreement"][1:]))
    assert all(b <= a for a, b in zip(data["small_share"], data["small_share"][1:]))


def test_chosen_threshold_is_the_lowest_that_meets_the_target(quick):
    report, _ = quick
    target = report["target_agreement"]
    for kind, data in report["kinds"].items():
        chosen = data["chosen_threshold"]
        assert chosen is not None, kind
        index = report["thresholds"].index(chosen)
        assert data["agreement"][index] >= target and data["agreement_at_chosen"] >= target
        assert all(a < target for a in data["agreement"][:index])
        assert data["small_share_at_chosen"] == data["small_share"][index]
    best = report["recommendation"]["kind"]
    assert report["kinds"][best]["small_share_at_chosen"] == max(d["small_share_at_chosen"] for d in report["kinds"].values())
    assert best in report["recommendation"]["reason"]


def test_labelled_folder_reports_accuracy(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for name in ("chelsea", "coffee", "china"):
        (images / f"{name}.jpg").write_bytes(encode(photo(name)))
    (images / "notes.txt").write_bytes(b"not an image")  # refused as the service would refuse it (4xx)
    # Labels by class name (any case) or by index: tabby is 281, espresso 967 in ImageNet-1k.
    labels = tmp_path / "labels.csv"
    labels.write_text("filename,label\nchelsea.jpg,Tabby\ncoffee.jpg,967\nchina.jpg,palace\nnotes.txt,0\n")
    out = tmp_path / "labelled.json"
    main(["--images", str(images), "--labels", str(labels), "--out", str(out)])
    report = json.loads(out.read_text())
    assert "accuracy against the given labels" in report["measures"] and out.with_suffix(".png").is_file()
    assert [r["name"] for r in report["refused"]] == ["notes.txt"]
    records = report["records"]
    assert [r["label"] for r in records][:2] == [281, 967]
    truth = np.array([r["label"] for r in records])
    primary = np.array([r["primary_top1"] for r in records])
    fallback = np.array([r["fallback_top1"] for r in records])
    assert report["accuracy"]["primary_only"] == pytest.approx(np.mean(primary == truth))
    assert report["accuracy"]["fallback_only"] == pytest.approx(np.mean(fallback == truth))
    for kind, data in report["kinds"].items():
        assert data["accuracy"][0] == pytest.approx(report["accuracy"]["fallback_only"])
        for t, accuracy in zip(report["thresholds"], data["accuracy"]):
            assert accuracy == pytest.approx(np.mean(cascade(records, kind, t) == truth), abs=1e-6)


def test_an_unknown_label_is_named_in_the_error(tmp_path):
    (tmp_path / "chelsea.jpg").write_bytes(encode(photo("chelsea")))
    labels = tmp_path / "labels.csv"
    labels.write_text("chelsea.jpg,no such class\n")
    with pytest.raises(ValueError, match=r"labels.csv:1: label 'no such class' is neither"):
        folder_set(tmp_path, labels, ["tench", "goldfish"])
    labels.write_text("chelsea.jpg,2\n")
    with pytest.raises(ValueError, match=r"out of range 0\.\.1"):
        folder_set(tmp_path, labels, ["tench", "goldfish"])
