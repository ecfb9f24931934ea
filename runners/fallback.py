"""The fallback runner: an ONNX Runtime classifier (EfficientNet-Lite0 by default).

``CUDAExecutionProvider`` when a GPU is present, ``CPUExecutionProvider``
otherwise. One batchable API per size bucket; see ``runners.common``.
"""

from __future__ import annotations

import bentoml

from rampart.config import get_settings
from rampart.faults import FaultInjector, FaultSpec
from runners.common import BucketedRunner, bucket_apis, runner_service

settings = get_settings()


@runner_service("rampart_fallback", timeout_s=settings.max_deadline_ms / 1000 + 10,
                concurrent_batches=settings.fallback_concurrent_batches)
class Fallback(BucketedRunner):
    """EfficientNet-Lite0 in ONNX (or an imported ONNX model) behind adaptive batching."""

    model = bentoml.models.BentoModel(settings.fallback_model)

    square, landscape, portrait = bucket_apis(settings.fallback_max_batch_size, settings.fallback_max_latency_ms)

    def __init__(self) -> None:
        from inference.engines import OnnxClassifier

        meta = self.model.info.metadata
        self.engine = OnnxClassifier(self.model.path_of("model.onnx"), meta["mean"], meta["std"])
        self.setup(
            "fallback",
            meta["resolution"],
            FaultInjector("fallback", FaultSpec(error_rate=settings.fault_fallback_error_rate), settings.fault_file),
            settings.fallback_max_batch_size,
            settings.fallback_nice,
            settings.max_deadline_ms,
        )
        self.warm_up()
