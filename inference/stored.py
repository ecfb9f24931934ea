"""An inference engine for a model in the BentoML model store, chosen by the metadata its import wrote.

Shared by the runners (``runners.common``) and the benchmark baselines
(``bench.baselines.common``), so both serve a stored model the same way. No BentoML
import: the model is anything with ``info.metadata`` and ``path_of(name)``.
"""

from __future__ import annotations

__all__ = ["load_engine"]


def load_engine(model, memory_fraction: float, threads: int = 0, engine: str | None = None, torch_graph: str = "eager"):
    """The inference engine for a stored model (``bentoml.Model``), chosen by its metadata or by ``engine``.

    ``engine`` None: the model's own ``framework``. "onnx": ``inference.engines.OnnxClassifier``
    on ``model.onnx`` of an ONNX model, or on a PyTorch model's checked ONNX export (metadata
    ``onnx_file``, written by the import); "torch" (or framework "pytorch"): ``family``/``arch``
    built by ``inference.architectures`` with ``weights.pt`` loaded, in
    ``inference.engines.TorchClassifier`` capped at ``memory_fraction`` of the GPU's memory.
    ``threads`` > 0 sets the engine's intra-op CPU threads (0: the library's default); ``torch_graph`` is
    how torch runs the module on a CPU (``inference.engines.TORCH_GRAPHS``: "traced" or "eager").
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
        import torch

        from inference.architectures import create_architecture
        from inference.engines import TorchClassifier

        module = create_architecture(meta["family"], meta["arch"], num_classes=len(meta["labels"]))
        module.load_state_dict(torch.load(model.path_of("weights.pt"), map_location="cpu", weights_only=True))
        return TorchClassifier(module, meta["mean"], meta["std"], memory_fraction=memory_fraction, threads=threads,
                               graph=torch_graph)
    raise ValueError(f"model {model.tag}: a {framework} model without an ONNX export cannot run on {engine!r}")
