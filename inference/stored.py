"""An inference engine for a model in the BentoML model store, chosen by the metadata its import wrote.

Shared by the runners (``runners.common``) and the benchmark baselines
(``bench.baselines.common``), so both serve a stored model the same way. No BentoML
import: the model is anything with ``info.metadata`` and ``path_of(name)``.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["load_engine", "stored_graphs"]

logger = logging.getLogger("rampart.engines")


def stored_graphs(model) -> dict[tuple[int, int], object]:
    """The checked TorchScript graphs a PyTorch model's import saved (metadata ``torch_graph_files``: "HxW" -> file,
    written by ``models.import_models.export_graphs``), loaded once per file, by input shape (H, W).

    Empty when the import saved none, when they were made by another torch version than this process's
    (metadata ``torch_graph_torch_version``), or when a file does not load (damaged or missing; one warning): the
    engine then traces and checks in this process, as it does for
    any shape without a stored graph (``inference.engines.TorchClassifier``). Loading needs torch only.
    """
    import torch

    from inference.engines import parse_shape_key

    meta = model.info.metadata
    files = meta.get("torch_graph_files") or {}
    if not files:
        return {}
    made_by = meta.get("torch_graph_torch_version")
    if made_by != str(torch.__version__):
        logger.info("torch engine: %s's stored graphs were made by torch %s, this is %s: tracing here instead",
                    model.tag, made_by, torch.__version__)
        return {}
    loaded: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.load is deprecated in favour of torch.export (torch 2.14)
        for name in sorted(set(files.values())):
            try:
                loaded[name] = torch.jit.load(model.path_of(name), map_location="cpu")
            except Exception as error:  # noqa: BLE001 - a damaged or missing file: trace here rather than not start
                logger.warning("torch engine: %s's stored graph %s does not load (%s: %s): tracing here instead",
                               model.tag, name, type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
                return {}
    return {parse_shape_key(key): loaded[name] for key, name in files.items()}


def load_engine(model, memory_fraction: float, threads: int = 0, engine: str | None = None, torch_graph: str = "eager"):
    """The inference engine for a stored model (``bentoml.Model``), chosen by its metadata or by ``engine``.

    ``engine`` None: the model's own ``framework``. "onnx": ``inference.engines.OnnxClassifier``
    on ``model.onnx`` of an ONNX model, or on a PyTorch model's checked ONNX export (metadata
    ``onnx_file``, written by the import); "torch" (or framework "pytorch"): ``family``/``arch``
    built by ``inference.architectures`` with ``weights.pt`` loaded, in
    ``inference.engines.TorchClassifier`` capped at ``memory_fraction`` of the GPU's memory.
    ``threads`` > 0 sets the engine's intra-op CPU threads (0: the library's default); ``torch_graph`` is
    how torch runs the module on a CPU (``inference.engines.TORCH_GRAPHS``: "traced" or "eager"). Under "traced"
    the engine gets the import's checked graphs (``stored_graphs``) and builds the module only if a shape lacks
    one (so timm and torchvision are imported only then).
    Both take uint8 N×H×W×3 and return float32 N×C. Only the chosen engine's library is
    imported (no torch for an ONNX engine). Raises ``ValueError`` for another framework or
    an engine the model cannot run on (``inference.engine_choice.available_engines``).
    """
    meta = model.info.metadata
    framework = meta.get("framework")
    if framework not in ("onnx", "pytorch"):
        raise ValueError(f"model {model.tag}: framework {framework!r} is neither 'onnx' nor 'pytorch'")
    engine = engine or ("onnx" if framework == "onnx" else "torch")
    if engine == "onnx" and (framework == "onnx" or meta.get("onnx_file")):
        from inference.engines import OnnxClassifier

        filename = "model.onnx" if framework == "onnx" else meta["onnx_file"]
        return OnnxClassifier(model.path_of(filename), meta["mean"], meta["std"], threads)
    if engine == "torch" and framework == "pytorch":
        from inference.engines import TorchClassifier

        def build_module():
            import torch

            from inference.architectures import create_architecture

            module = create_architecture(meta["family"], meta["arch"], num_classes=len(meta["labels"]))
            module.load_state_dict(torch.load(model.path_of("weights.pt"), map_location="cpu", weights_only=True))
            return module

        return TorchClassifier(build_module, meta["mean"], meta["std"], memory_fraction=memory_fraction,
                               threads=threads, graph=torch_graph,
                               load_stored_graphs=lambda: stored_graphs(model))
    raise ValueError(f"model {model.tag}: a {framework} model without an ONNX export cannot run on {engine!r}")
