"""An inference engine for a model in the BentoML model store, chosen by the metadata its import wrote.

Shared by the runners (``runners.common``) and the benchmark baselines
(``bench.baselines.common``), so both serve a stored model the same way. No BentoML
import: the model is anything with ``info.metadata`` and ``path_of(name)``.
"""

from __future__ import annotations

__all__ = ["load_engine"]


def load_engine(model, memory_fraction: float, threads: int = 0):
    """The inference engine for a stored model (``bentoml.Model``), chosen by its ``framework`` metadata.

    "onnx": ``inference.engines.OnnxClassifier`` on ``model.onnx``; "pytorch":
    ``family``/``arch`` built by ``inference.architectures`` with ``weights.pt`` loaded, in
    ``inference.engines.TorchClassifier`` capped at ``memory_fraction`` of the GPU's
    memory. ``threads`` > 0 sets the engine's intra-op CPU threads (0: the library's default).
    Both take uint8 N×H×W×3 and return float32 N×C. Raises ``ValueError`` for
    another framework. The metadata is written by ``python -m models.import_models``.
    """
    meta = model.info.metadata
    framework = meta.get("framework")
    if framework == "onnx":
        from inference.engines import OnnxClassifier

        return OnnxClassifier(model.path_of("model.onnx"), meta["mean"], meta["std"], threads)
    if framework == "pytorch":
        import torch

        from inference.architectures import create_architecture
        from inference.engines import TorchClassifier

        module = create_architecture(meta["family"], meta["arch"], num_classes=len(meta["labels"]))
        module.load_state_dict(torch.load(model.path_of("weights.pt"), map_location="cpu", weights_only=True))
        return TorchClassifier(module, meta["mean"], meta["std"], memory_fraction=memory_fraction, threads=threads)
    raise ValueError(f"model {model.tag}: framework {framework!r} is neither 'onnx' nor 'pytorch'")
