"""The shadow runner: a candidate model that gets mirrored traffic (README, "Shadow traffic").

Started by ``bentoml serve`` only when ``shadow_model`` names a model in the store
(``service.Rampart`` depends on it only then). The engine follows the stored
model's metadata, as written by ``python -m models.import_models``: ``framework``
"onnx" runs ``model.onnx`` on ONNX Runtime (as the fallback does), "pytorch" builds
``family``/``arch`` and loads ``weights.pt`` (as the primary does). Same bucketed
adaptive-batching API as both runners (``runners.common``), at ``shadow_nice``, with
batches of at most ``shadow_max_inflight`` (never more items than that are sent),
and its own fault injection (``fault_shadow_*``).
"""

from __future__ import annotations

import bentoml

from rampart.config import get_settings
from rampart.faults import FaultInjector, FaultSpec
from runners.common import BucketedRunner, bucket_apis, runner_service

settings = get_settings()


def load_engine(model, memory_fraction: float):
    """The inference engine for a stored model (``bentoml.Model``), chosen by its ``framework`` metadata.

    Returns an object with ``predict(uint8 N×H×W×3) -> float32 N×C``; raises ``ValueError``
    for a framework other than "onnx" or "pytorch". ``memory_fraction`` caps a PyTorch
    model's share of the GPU's memory (see ``inference.engines.TorchClassifier``).
    """
    meta = model.info.metadata
    framework = meta.get("framework")
    if framework == "onnx":
        from inference.engines import OnnxClassifier

        return OnnxClassifier(model.path_of("model.onnx"), meta["mean"], meta["std"])
    if framework == "pytorch":
        import torch

        from inference.architectures import create_architecture
        from inference.engines import TorchClassifier

        module = create_architecture(meta["family"], meta["arch"], num_classes=len(meta["labels"]))
        module.load_state_dict(torch.load(model.path_of("weights.pt"), map_location="cpu", weights_only=True))
        return TorchClassifier(module, meta["mean"], meta["std"], memory_fraction=memory_fraction)
    raise ValueError(f"model {model.tag}: framework {framework!r} is neither 'onnx' nor 'pytorch'")


@runner_service("rampart_shadow", timeout_s=settings.shadow_deadline_ms / 1000 + 10, concurrent_batches=1)
class Shadow(BucketedRunner):
    """A candidate model (ONNX or PyTorch) behind adaptive batching, for mirrored requests only."""

    if settings.shadow_model:  # no model to pack or load when shadow traffic is off
        model = bentoml.models.BentoModel(settings.shadow_model)

    square, landscape, portrait = bucket_apis(max(2, settings.shadow_max_inflight), settings.max_deadline_ms)

    def __init__(self) -> None:
        # The primary may take gpu_memory_fraction of the GPU; the candidate gets what it leaves.
        self.engine = load_engine(self.model, memory_fraction=max(0.05, 1.0 - settings.gpu_memory_fraction))
        self.setup(
            "shadow",
            self.model.info.metadata["resolution"],
            FaultInjector("shadow", FaultSpec(settings.fault_shadow_delay_ms, settings.fault_shadow_error_rate),
                          settings.fault_file),
            max(2, settings.shadow_max_inflight),
            settings.shadow_nice,
            settings.max_deadline_ms,
        )
        self.warm_up()
