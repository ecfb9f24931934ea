"""Calibrating the cascade's confidence threshold: how often may the small model answer alone?

``python -m bench.cascade_eval [--quick] [--out docs/bench/cascade_eval.json]`` runs
both default models in this process (no servers) over an evaluation set and writes
a JSON report and a PNG plot (``--plot``, default: the JSON's path with ``.png``).

**What it measures: top-1 agreement with the primary model, not ImageNet
accuracy.** The bundled photos carry no labels; the question answered is "how
often would the cascade give the same top-1 class as the primary alone?". For
accuracy, pass a labelled folder: ``--images DIR --labels CSV`` (CSV columns
``filename,label``; ``label`` is an ImageNet class name as in the models'
``labels``, e.g. ``tabby``, case-insensitive, or a class index 0-999). The report
then also has top-1 accuracy of primary-only, fallback-only and the cascade at
each threshold.

The evaluation set (without ``--images``): the colour photos of real scenes that
ship with scikit-image (``astronaut``, ``coffee``, ``chelsea``, ``rocket``, the left
view of ``stereo_motorcycle``) and scikit-learn (``china``, ``flower``), each in 46
deterministic variants (see ``variants``): 322 images. ``--quick``: 4 photos × 6
variants = 24 images, for ``make test``.

Every image goes through the service's own preprocessing, so the models see the
pixels production sees: encoded bytes → ``rampart.inputs.decode_job.prepare`` with a
``DecodePlan`` built as ``rampart.pipeline.Pipeline`` builds it (``rampart.pipeline.decode_plan``: decode limits
from ``decode_limits``, each model's buckets from its resolution,
``crop_margin`` from the settings) → per-bucket uint8 N×H×W×3 batches stacked as
``runners.common.BucketedRunner.run_bucket`` stacks them → the runners' engines
(``TorchClassifier`` for the primary, ``OnnxClassifier`` on the stored ``.onnx`` for
the fallback), loaded from the BentoML model store as the runners load them.
On CPU both run in float32; on a GPU the primary runs under fp16 autocast as in
production, which may flip a near-tie.

Confidence of the fallback (small) model, from its probability row ``p`` (C,):

- ``msp``: the maximum softmax probability, ``max p``: the exit rule of
  "Wisdom of Committees: An Overlooked Approach to Faster and More Accurate
  Models" (Wang, Kondratyuk et al., ICLR 2022); also the baseline confidence of
  Hendrycks & Gimpel, "A Baseline for Detecting Misclassified and
  Out-of-Distribution Examples in Neural Networks" (ICLR 2017).
- ``margin``: top-1 minus top-2 probability, the best-versus-second-best margin
  of margin-based uncertainty sampling (Scheffer, Decomain & Wrobel, "Active
  Hidden Markov Models for Information Extraction", IDA 2001). Other
  cascades, IDK cascades (Wang et al., 2017) and Tabi (EuroSys 2023), gate on a
  model's confidence too; Tabi calibrates it first, which this command does not.

For a threshold ``t`` the cascade answers with the fallback's top-1 where its
confidence ≥ ``t`` and with the primary's otherwise. ``agreement(t)`` is the share
of images whose cascade answer equals the primary's; ``small_share(t)`` the share
the fallback answered. Raising ``t`` only moves images from the fallback to the
primary, so agreement is non-decreasing in ``t`` and equals the fallback-alone
agreement at ``t = 0``. For each kind the chosen threshold is the lowest grid
value with ``agreement ≥ --target-agreement`` (default 0.99); the recommended kind
is the one whose chosen threshold lets the fallback answer the larger share
(ties: ``msp``).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import platform
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

# The models' code, imported in one place (another branch may move these modules).
from inference.architectures import create_architecture
from inference.engines import OnnxClassifier, TorchClassifier
from rampart.results import CONFIDENCE_KINDS, confidences

from rampart.inputs.buckets import Bucket, buckets_for_resolution
from rampart.config import Settings, get_settings
from rampart.inputs.decode_job import model_input, prepare
from rampart.errors import ImageError
from rampart.pipeline import decode_plan

__all__ = ["EvalImage", "LoadedModel", "CONFIDENCE_KINDS", "base_photos", "variants", "evaluation_set",
           "variant_names", "folder_set", "load_models", "predict", "threshold_curve", "choose_threshold",
           "evaluate", "plot", "main"]

#: Photos in ``--quick`` mode and the variants each gets there (names from ``variants``).
QUICK_PHOTOS: tuple[str, ...] = ("chelsea", "coffee", "astronaut", "china")
QUICK_VARIANTS: tuple[str, ...] = ("full", "full_flip", "crop60_centre", "full_jpeg20", "full_rot+10", "full_scale0.5")
#: Encoding of every variant not named ``*_jpegQ``: lossless, so the variant's pixels arrive unchanged.
LOSSLESS_FORMAT = "PNG"
#: The variants' parameters (see ``variants``).
CROP_PERCENTS: tuple[int, ...] = (80, 60)
CROP_POSITIONS: tuple[str, ...] = ("centre", "tl", "tr", "bl", "br")
SCALES: tuple[float, ...] = (0.5, 0.75, 1.5)
JPEG_QUALITIES: tuple[int, ...] = (20, 40, 60, 80, 95)
ROTATIONS_DEG: tuple[int, ...] = (-10, -5, 5, 10)


@dataclass(frozen=True)
class EvalImage:
    """One evaluation image: a ``name``, its encoded ``data`` (as a client would upload it) and,
    from ``--labels``, its ImageNet class ``label`` (index 0..C-1) or None."""

    name: str
    data: bytes
    label: int | None = None


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded from the BentoML store as its runner loads it: ``tag``, ``engine``
    (``predict(uint8 N×H×W×3) -> float32 N×C``), ``labels`` (C class names) and ``buckets``."""

    tag: str
    engine: object
    labels: list[str]
    buckets: dict[str, Bucket]


def base_photos(names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The bundled colour photos of real scenes as uint8 H×W×3 arrays (RGB), by name.

    scikit-image: ``astronaut`` 512×512, ``coffee`` 400×600, ``chelsea`` 300×451,
    ``rocket`` 427×640, ``motorcycle`` (left view of ``stereo_motorcycle``) 500×741;
    scikit-learn: ``china`` and ``flower`` 427×640. ``names`` selects some (all when None).
    """
    from skimage import data
    from sklearn.datasets import load_sample_image

    loaders = {
        "astronaut": data.astronaut,
        "coffee": data.coffee,
        "chelsea": data.chelsea,
        "rocket": data.rocket,
        "motorcycle": lambda: data.stereo_motorcycle()[0],
        "china": lambda: load_sample_image("china.jpg"),
        "flower": lambda: load_sample_image("flower.jpg"),
    }
    return {name: np.ascontiguousarray(loaders[name]()[..., :3]) for name in (names or tuple(loaders))}


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _crop(image: Image.Image, fraction: float, position: str) -> Image.Image:
    """The ``fraction``×``fraction`` (of each side) crop at ``position`` (centre or a corner)."""
    width, height = image.size
    box_w, box_h = round(width * fraction), round(height * fraction)
    left = {"centre": (width - box_w) // 2, "tl": 0, "bl": 0, "tr": width - box_w, "br": width - box_w}[position]
    top = {"centre": (height - box_h) // 2, "tl": 0, "tr": 0, "bl": height - box_h, "br": height - box_h}[position]
    return image.crop((left, top, left + box_w, top + box_h))


def _rotate(image: Image.Image, degrees: float) -> Image.Image:
    """``image`` rotated by ``degrees`` (counter-clockwise), cropped to a centred box with no empty corners.

    The kept fraction of each side, ``1 / (cos a + sin a × long/short)``, is a
    conservative bound for the largest axis-aligned box inside the rotated frame.
    """
    angle = np.deg2rad(abs(degrees))
    width, height = image.size
    keep = 1.0 / (np.cos(angle) + np.sin(angle) * max(width, height) / min(width, height))
    return _crop(image.rotate(degrees, resample=Image.Resampling.BICUBIC), keep, "centre")


def variant_names() -> list[str]:
    """The names of the 46 variants of ``variants``, in order."""
    names = []
    for suffix in ("", "_flip"):
        names.append(f"full{suffix}")
        names += [f"crop{percent}_{position}{suffix}" for percent in CROP_PERCENTS for position in CROP_POSITIONS]
        names += [f"full_scale{scale}{suffix}" for scale in SCALES]
        names += [f"full_jpeg{quality}{suffix}" for quality in JPEG_QUALITIES]
        names += [f"full_rot{degrees:+d}{suffix}" for degrees in ROTATIONS_DEG]
    return names


def variants(pixels: np.ndarray, names: tuple[str, ...] | None = None) -> dict[str, bytes]:
    """Deterministic variants of one uint8 H×W×3 photo, each encoded as an upload, by name.

    ``names`` selects some (default: all 46 of ``variant_names``). For the photo
    and its horizontal mirror (names ending ``_flip``):

    - ``full``, and crops keeping 80% and 60% of each side at the centre and at
      the four corners (``crop80_tl`` ...): 11;
    - ``full_scale{0.5,0.75,1.5}``: the whole photo resized (Lanczos);
    - ``full_jpeg{20,40,60,80,95}``: the whole photo as JPEG of that quality;
    - ``full_rot{-10,-5,+5,+10}``: rotated by that many degrees, then cropped so
      no empty corner remains (see ``_rotate``).

    Every variant not named ``_jpegQ`` is encoded losslessly (PNG).
    """
    original = Image.fromarray(pixels)
    out: dict[str, bytes] = {}
    for name in names or variant_names():
        base, flipped = (name[:-len("_flip")], True) if name.endswith("_flip") else (name, False)
        image = original.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flipped else original
        if base == "full":
            out[name] = _encode(image, LOSSLESS_FORMAT)
        elif base.startswith("crop"):
            percent, position = base[len("crop"):].split("_")
            out[name] = _encode(_crop(image, int(percent) / 100, position), LOSSLESS_FORMAT)
        elif base.startswith("full_scale"):
            scale = float(base[len("full_scale"):])
            size = (round(image.width * scale), round(image.height * scale))
            out[name] = _encode(image.resize(size, Image.Resampling.LANCZOS), LOSSLESS_FORMAT)
        elif base.startswith("full_jpeg"):
            out[name] = _encode(image, "JPEG", quality=int(base[len("full_jpeg"):]))
        elif base.startswith("full_rot"):
            out[name] = _encode(_rotate(image, int(base[len("full_rot"):])), LOSSLESS_FORMAT)
        else:
            raise ValueError(f"unknown variant {name!r}; see variant_names()")
    return out


def evaluation_set(quick: bool = False) -> list[EvalImage]:
    """The bundled evaluation set: every photo of ``base_photos`` × every variant (322 images),
    or with ``quick`` the 24 images of ``QUICK_PHOTOS`` × ``QUICK_VARIANTS``. Names are ``photo/variant``."""
    images = []
    for photo, pixels in base_photos(QUICK_PHOTOS if quick else None).items():
        for variant, data in variants(pixels, QUICK_VARIANTS if quick else None).items():
            images.append(EvalImage(f"{photo}/{variant}", data))
    return images


def _label_index(value: str, labels: list[str]) -> int:
    """A CSV label as a class index: an integer 0..C-1, or a class name (case-insensitive).

    Raises ``ValueError`` naming the value when it is neither.
    """
    text = value.strip()
    if text.isdigit():
        index = int(text)
        if index < len(labels):
            return index
        raise ValueError(f"label index {index} is out of range 0..{len(labels) - 1}")
    by_name = {name.lower(): i for i, name in enumerate(labels)}
    if text.lower() in by_name:
        return by_name[text.lower()]
    raise ValueError(f"label {text!r} is neither a class index nor one of the model's {len(labels)} class names")


def folder_set(images_dir: Path, labels_csv: Path | None, labels: list[str]) -> list[EvalImage]:
    """A user's images: every file of the CSV (columns ``filename,label``, a header row allowed),
    or without a CSV every regular file of ``images_dir`` (sorted, unlabelled).

    Raises ``FileNotFoundError`` for a listed file that is missing and
    ``ValueError`` for a label that is not a class (see ``_label_index``).
    """
    if labels_csv is None:
        return [EvalImage(path.name, path.read_bytes()) for path in sorted(images_dir.iterdir()) if path.is_file()]
    images = []
    with open(labels_csv, newline="", encoding="utf-8") as handle:
        for row_number, row in enumerate(csv.reader(handle), start=1):
            if not row or (row_number == 1 and [c.strip().lower() for c in row[:2]] == ["filename", "label"]):
                continue
            if len(row) < 2:
                raise ValueError(f"{labels_csv}:{row_number}: expected filename,label, got {row!r}")
            path = images_dir / row[0].strip()
            if not path.is_file():
                raise FileNotFoundError(f"{labels_csv}:{row_number}: {path} does not exist")
            try:
                label = _label_index(row[1], labels)
            except ValueError as error:
                raise ValueError(f"{labels_csv}:{row_number}: {error}") from None
            images.append(EvalImage(row[0].strip(), path.read_bytes(), label))
    return images


def load_models(settings: Settings) -> dict[str, LoadedModel]:
    """Both models by role ("primary", "fallback"), from the BentoML store as ``runners/primary.py``
    and ``runners/fallback.py`` load them (tags ``settings.primary.model`` / ``settings.fallback.model``).

    Loaded once per process and pair of tags (the tests evaluate several sets).
    """
    return _load_models(settings.primary.model, settings.fallback.model, settings.gpu_memory_fraction)


@functools.lru_cache(maxsize=2)
def _load_models(primary_tag: str, fallback_tag: str, memory_fraction: float) -> dict[str, LoadedModel]:
    import bentoml
    import torch

    primary = bentoml.models.get(primary_tag)
    meta = primary.info.metadata
    module = create_architecture(meta["family"], meta["arch"], num_classes=len(meta["labels"]))
    module.load_state_dict(torch.load(primary.path_of("weights.pt"), map_location="cpu", weights_only=True))
    engine = TorchClassifier(module, meta["mean"], meta["std"], memory_fraction=memory_fraction)
    models = {"primary": LoadedModel(str(primary.tag), engine, list(meta["labels"]),
                                     buckets_for_resolution(int(meta["resolution"])))}
    fallback = bentoml.models.get(fallback_tag)
    meta = fallback.info.metadata
    models["fallback"] = LoadedModel(str(fallback.tag), OnnxClassifier(fallback.path_of("model.onnx"), meta["mean"], meta["std"]),
                                     list(meta["labels"]), buckets_for_resolution(int(meta["resolution"])))
    return models


def predict(images: list[EvalImage], models: dict[str, LoadedModel], settings: Settings,
            batch_size: int = 16) -> tuple[dict[str, np.ndarray], list[int], list[dict]]:
    """Probabilities of every model for every image that the service would accept.

    Each image is prepared as the service does (``prepare`` with the service's
    ``DecodePlan``); images ``prepare`` refuses (an ``ImageError``, answered 4xx by
    the service) are left out and listed. Images are grouped per model and bucket,
    stacked into uint8 N×H×W×3 batches of at most ``batch_size`` and passed to the
    engine.

    Returns (per role a float32 K×C array of probabilities, the indices into
    ``images`` of the K accepted images, ``[{"name", "error"}]`` of the refused).
    """
    plan = decode_plan(settings, {role: model.buckets for role, model in models.items()})
    accepted, refused, inputs = [], [], defaultdict(list)
    for index, image in enumerate(images):
        try:
            prepared = prepare(image.data, plan)
        except ImageError as error:
            refused.append({"name": image.name, "error": f"{type(error).__name__}: {error}"})
            continue
        for role, model in models.items():
            bucket, pixels = model_input(prepared, role, model.buckets)
            inputs[role, bucket.name].append((len(accepted), pixels))
        accepted.append(index)
    probs = {}
    for role, model in models.items():
        out = np.zeros((len(accepted), len(model.labels)), dtype=np.float32)
        for bucket_name in model.buckets:
            group = inputs[role, bucket_name]
            for start in range(0, len(group), batch_size):
                chunk = group[start:start + batch_size]
                batch = np.stack([pixels for _, pixels in chunk]).astype(np.uint8, copy=False)
                out[[row for row, _ in chunk]] = model.engine.predict(batch)
        probs[role] = out
    return probs, accepted, refused


def threshold_curve(confidence: np.ndarray, small_top1: np.ndarray, large_top1: np.ndarray,
                    thresholds: np.ndarray, truth: np.ndarray | None = None) -> dict[str, list[float]]:
    """The cascade at each threshold: the fallback answers where ``confidence ≥ t``, the primary elsewhere.

    Args:
        confidence: float (N,), the fallback's confidence per image.
        small_top1, large_top1: int (N,), the fallback's and the primary's top-1 class.
        thresholds: float (T,).
        truth: optional int (N,) true classes.

    Returns ``{"agreement", "small_share"}`` (and ``"accuracy"`` with ``truth``),
    each a list of T floats in [0, 1]: the share of images whose cascade answer
    equals the primary's, the share answered by the fallback, the share correct.
    """
    small_answers = confidence[None, :] >= thresholds[:, None]  # T×N
    answer = np.where(small_answers, small_top1[None, :], large_top1[None, :])
    curve = {"agreement": (answer == large_top1[None, :]).mean(axis=1),
             "small_share": small_answers.mean(axis=1)}
    if truth is not None:
        curve["accuracy"] = (answer == truth[None, :]).mean(axis=1)
    return {key: [round(float(v), 6) for v in values] for key, values in curve.items()}


def choose_threshold(thresholds: np.ndarray, agreement: list[float], target: float) -> float | None:
    """The lowest threshold whose agreement is ≥ ``target``, or None when none is."""
    for threshold, value in zip(thresholds, agreement):
        if value >= target:
            return float(threshold)
    return None


def evaluate(images: list[EvalImage], models: dict[str, LoadedModel], settings: Settings,
             target: float = 0.99, step: float = 0.01, batch_size: int = 16) -> dict:
    """The report: curves per confidence kind, chosen thresholds, recommendation and per-image records.

    ``target`` is the agreement (share, 0..1) to keep; thresholds run 0..1 in
    ``step``. Raises ``ValueError`` when no image is accepted.
    """
    started = time.perf_counter()
    probs, accepted, refused = predict(images, models, settings, batch_size)
    if not accepted:
        raise ValueError(f"no image could be decoded ({len(refused)} refused)")
    seconds = time.perf_counter() - started
    kept = [images[i] for i in accepted]
    labelled = all(image.label is not None for image in kept)
    truth = np.array([image.label for image in kept]) if labelled else None
    large_top1 = probs["primary"].argmax(axis=1)
    small_top1 = probs["fallback"].argmax(axis=1)
    confidence = confidences(probs["fallback"])
    thresholds = np.round(np.arange(0.0, 1.0 + step / 2, step), 6)
    kinds = {}
    for kind in CONFIDENCE_KINDS:
        curve = threshold_curve(confidence[kind], small_top1, large_top1, thresholds, truth)
        chosen = choose_threshold(thresholds, curve["agreement"], target)
        at = None if chosen is None else int(np.argmin(np.abs(thresholds - chosen)))
        kinds[kind] = {
            **curve,
            "chosen_threshold": chosen,
            "agreement_at_chosen": None if at is None else curve["agreement"][at],
            "small_share_at_chosen": 0.0 if at is None else curve["small_share"][at],
            **({"accuracy_at_chosen": None if at is None else curve["accuracy"][at]} if labelled else {}),
            "confidence_quantiles": {str(q): round(float(np.quantile(confidence[kind], q)), 6)
                                     for q in (0.05, 0.25, 0.5, 0.75, 0.95)},
        }
    shares = {kind: kinds[kind]["small_share_at_chosen"] for kind in CONFIDENCE_KINDS}
    best = max(CONFIDENCE_KINDS,
               key=lambda kind: (shares[kind], kinds[kind]["chosen_threshold"] is not None, kind == "msp"))
    if all(kinds[kind]["chosen_threshold"] is None for kind in CONFIDENCE_KINDS):
        recommendation = {"kind": None, "threshold": None,
                          "reason": f"no threshold keeps top-1 agreement with the primary at or above {target * 100:g}%"}
    else:
        others = ", ".join(f"{kind} {shares[kind]:.1%} at threshold {kinds[kind]['chosen_threshold']}"
                           for kind in CONFIDENCE_KINDS if kind != best)
        recommendation = {
            "kind": best, "threshold": kinds[best]["chosen_threshold"],
            "reason": (f"at {target * 100:g}% top-1 agreement with the primary, {best} lets the small model answer "
                       f"{shares[best]:.1%} of the {len(kept)} images at threshold {kinds[best]['chosen_threshold']} "
                       f"(vs {others}); the larger share wins (ties: msp)"),
        }
    report = {
        "measures": ("top-1 agreement of the cascade with the primary model alone; NOT ImageNet accuracy"
                     + ("; accuracy against the given labels is reported too" if labelled else "")),
        "cascade_rule": "the fallback answers when its confidence >= threshold, else the primary answers",
        "confidence_kinds": {"msp": "maximum softmax probability of the fallback (Wisdom of Committees, ICLR 2022)",
                             "margin": "top-1 minus top-2 softmax probability of the fallback (margin sampling, "
                                       "Scheffer et al., IDA 2001)"},
        "models": {role: model.tag for role, model in models.items()},
        "device": {"primary": str(getattr(models["primary"].engine, "device", "cpu")),
                   "fallback": ",".join(getattr(models["fallback"].engine, "providers", ["?"]))},
        "preprocessing": "rampart.inputs.decode_job.prepare with the service's DecodePlan (decode_limits, buckets, crop_margin "
                         f"{settings.inputs.crop_margin})",
        "images": len(kept),
        "refused": refused,
        "target_agreement": target,
        "thresholds": [float(t) for t in thresholds],
        "fallback_alone_agreement": round(float((small_top1 == large_top1).mean()), 6),
        "kinds": kinds,
        "recommendation": recommendation,
        "inference_s": round(seconds, 2),
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "onnxruntime": _version("onnxruntime"), "pillow": _version("PIL")},
        "records": [
            {"name": image.name, "primary_top1": int(large_top1[i]), "fallback_top1": int(small_top1[i]),
             **{kind: round(float(confidence[kind][i]), 6) for kind in CONFIDENCE_KINDS},
             **({"label": image.label} if labelled else {})}
            for i, image in enumerate(kept)
        ],
    }
    if labelled:
        report["accuracy"] = {"primary_only": round(float((large_top1 == truth).mean()), 6),
                              "fallback_only": round(float((small_top1 == truth).mean()), 6)}
    return report


def _version(module: str) -> str:
    """``module.__version__`` (the distribution's name may differ: onnxruntime or onnxruntime-gpu)."""
    import importlib

    return str(importlib.import_module(module).__version__)


def plot(report: dict, path: Path) -> None:
    """Agreement and small-model share against threshold, both confidence kinds, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thresholds = report["thresholds"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, style in zip(CONFIDENCE_KINDS, ("-", "--")):
        data = report["kinds"][kind]
        left.plot(thresholds, data["agreement"], style, label=kind)
        right.plot(thresholds, data["small_share"], style, label=kind)
        if data["chosen_threshold"] is not None:
            for axis in (left, right):
                axis.axvline(data["chosen_threshold"], linestyle=style, color="grey", linewidth=0.8)
    left.axhline(report["target_agreement"], color="red", linewidth=0.8, label=f"target {report['target_agreement']:.0%}")
    left.set(xlabel="threshold on the fallback's confidence", ylabel="top-1 agreement with primary alone",
             title=f"Agreement ({report['images']} images; not accuracy)")
    right.set(xlabel="threshold on the fallback's confidence", ylabel="share answered by the fallback",
              title="Small-model share (grey: chosen thresholds)")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    """Command line entry point; returns the report it wrote."""
    parser = argparse.ArgumentParser(prog="python -m bench.cascade_eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="24 images instead of 322 (for make test)")
    parser.add_argument("--images", type=Path, help="evaluate this folder instead of the bundled photos")
    parser.add_argument("--labels", type=Path, help="CSV filename,label (ImageNet class name or index) for --images")
    parser.add_argument("--target-agreement", type=float, default=0.99, help="top-1 agreement to keep, 0..1")
    parser.add_argument("--step", type=float, default=0.01, help="threshold grid step (0..1)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/cascade_eval.json"))
    parser.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    args = parser.parse_args(argv)
    if args.labels and not args.images:
        parser.error("--labels needs --images")
    if not 0.0 < args.target_agreement <= 1.0 or not 0.0 < args.step <= 1.0:
        parser.error("--target-agreement and --step must be in (0, 1]")
    settings = get_settings()
    models = load_models(settings)
    if args.images:
        images = folder_set(args.images, args.labels, models["primary"].labels)
    else:
        images = evaluation_set(args.quick)
    report = evaluate(images, models, settings, args.target_agreement, args.step, args.batch_size)
    report["evaluation_set"] = str(args.images) if args.images else ("bundled photos, quick" if args.quick else "bundled photos")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot_path = args.plot or args.out.with_suffix(".png")
    plot(report, plot_path)
    print(f"{report['images']} images ({len(report['refused'])} refused); {report['measures']}")
    print(f"fallback alone agrees with the primary on {report['fallback_alone_agreement']:.1%}")
    for kind in CONFIDENCE_KINDS:
        data = report["kinds"][kind]
        print(f"{kind:>6}: threshold {data['chosen_threshold']} -> agreement {data['agreement_at_chosen']}, "
              f"small-model share {data['small_share_at_chosen']:.1%}")
    if "accuracy" in report:
        print(f"accuracy: primary only {report['accuracy']['primary_only']:.1%}, "
              f"fallback only {report['accuracy']['fallback_only']:.1%}")
    print(f"recommended: {report['recommendation']['reason']}")
    print(f"wrote {args.out} and {plot_path}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
