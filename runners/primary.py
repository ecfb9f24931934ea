"""The primary runner: a PyTorch classifier (EfficientNet-Lite2 by default).

CUDA when ``torch.cuda.is_available()`` (channels_last, fp16 autocast), CPU
otherwise. One batchable API per size bucket; see ``runners.common``.
"""

from __future__ import annotations

import bentoml

from rampart.config import get_settings
from rampart.faults import FaultInjector, FaultSpec
from runners.common import BucketedRunner, bucket_apis, runner_service

settings = get_settings()


@runner_service("rampart_primary", timeout_s=settings.max_deadline_ms / 1000 + 10,
                concurrent_batches=settings.primary_concurrent_batches)
class Primary(BucketedRunner):
    """EfficientNet-Lite2 (or an imported PyTorch model) behind adaptive batching."""

    model = bentoml.models.BentoModel(settings.primary_model)

    square, landscape, portrait = bucket_apis(settings.primary_max_batch_size, settings.primary_max_latency_ms)

    def __init__(self) -> None:
        import torch

        from inference.architectures import create_architecture
        from inference.engines import TorchClassifier

        meta = self.model.info.metadata
        module = create_architecture(meta["family"], meta["arch"], num_classes=len(meta["labels"]))
        module.load_state_dict(torch.load(self.model.path_of("weights.pt"), map_location="cpu", weights_only=True))
        self.engine = TorchClassifier(module, meta["mean"], meta["std"], memory_fraction=settings.gpu_memory_fraction)
        self.setup(
            "primary",
            meta["resolution"],
            FaultInjector(
                "primary",
                FaultSpec(settings.fault_primary_delay_ms, settings.fault_primary_error_rate, settings.fault_primary_hang),
                settings.fault_file,
            ),
            settings.primary_max_batch_size,
            settings.primary_nice,
            settings.max_deadline_ms,
        )
        self.warm_up()
